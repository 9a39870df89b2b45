"""The command-line options the scripts share, each declared once.

train.py, val.py, detect.py, export.py, check_data.py and shards.py add ``--imgsz``, ``--workers``, ``--device``,
``--project``/``--name``/``--exist-ok``, ``--half``, ``--end2end``, and the limits on what reading data may do
(``--allow-pipe``, ``--max-pixels``) through the functions here, so that one option has one spelling, one set of
aliases, one meaning and one default in every script. ``make_parser`` gives every script the same help layout:
option groups, and each option's default shown; it refuses abbreviated options (``--epoch`` is not ``--epochs``)
and suggests the nearest option for a misspelt one. The type functions below check a number's range where
argparse reads it, so a bad value is argparse's one error line, never a traceback later.

Run folders are relative to the current directory (``./runs/train/exp``, ``./runs/val/exp``, ...), as in
YOLOv5 and Ultralytics; scripts record the absolute path of the folder they made.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import UserError

ArgGroup = argparse._ActionsContainer  # where an option is declared: a parser or one of its groups

RUNS = Path("runs")  # under the current directory
INFERENCE_IMGSZ = 640  # YOLOv5's size, used when neither --imgsz nor the model says otherwise
INFERENCE_IMGSZ_HELP = (
    f"default: the size the checkpoint was trained at (an exported file: its own size), else {INFERENCE_IMGSZ}"
)
ALLOW_PIPE_ENV = "YOLO_ALLOW_PIPE"  # "1": pipe: shard URLs may run their commands (--allow-pipe)
MAX_PIXELS_ENV = "YOLO_MAX_PIXELS"  # --max-pixels, as the data readers of every process of a run see it
MAX_PIXELS = 2**28  # 16384 x 16384: larger images are skipped (a header claiming more is never allocated)
WORKERS = 8  # at most; the loaders use no more than the machine's cores (utils/data/loader.py)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and ``(default: X)`` after each option whose help does not state it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations (a prefix of a long option is an unknown option, not that option), whose
    error for an unknown option names the nearest known one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
            for token in message.split(":", 1)[1].split():
                flag = token.split("=", 1)[0]
                longer = sorted((o for o in known if o.startswith(flag)), key=len)  # what an abbreviation meant
                near = longer or difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                if token.startswith("--") and near:
                    message += f" (did you mean {near[0]}?)"
                    break
        super().error(message)


def make_parser(description: str | None) -> argparse.ArgumentParser:
    return Parser(description=description, formatter_class=HelpFormatter)


def ranged(kind: Callable[[str], int | float], low: float, high: float, wanted: str) -> Callable[[str], int | float]:
    """An argparse type: ``kind`` (int or float) of a finite value in [low, high], else argparse's error line
    saying what is ``wanted``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (ValueError, OverflowError) as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from e
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = ranged(int, 1, math.inf, "an integer of at least 1")  # --imgsz, --batch-size, --epochs
non_negative_int = ranged(int, 0, 2**63 - 1, "an integer from 0 to 2**63-1")  # --seed, --freeze
positive_float = ranged(float, math.ulp(0.0), math.inf, "a finite number above 0")  # --time


def add_imgsz(group: ArgGroup, *, help: str, pair: bool = False) -> None:
    """``--imgsz``/``--img``/``--img-size``, default None: each script says what None means in ``help``.

    ``pair`` (export.py): one value or ``h w``.
    """
    group.add_argument(
        "--imgsz",
        "--img",
        "--img-size",
        type=positive_int,
        default=None,
        nargs="+" if pair else None,
        metavar="PIXELS",
        help=f"image size in pixels{' (one value, or h w)' if pair else ''}; {help}",
    )


def add_workers(group: ArgGroup) -> None:
    group.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help="worker processes for loading and checking data, per rank (capped by the CPU cores)",
    )


@dataclass(frozen=True)
class DeviceRequest:
    """``--device`` parsed: the CPU, GPU ids in the order written (one per local rank under a launcher; an id
    written twice is a GPU two ranks share), or neither (auto: GPU 0 when there is one, else the CPU)."""

    cpu: bool = False
    gpus: tuple[int, ...] = ()

    @property
    def distinct(self) -> tuple[int, ...]:
        """Each GPU once, in order: what is made visible to CUDA (which stops reading the list at a repeat)."""
        return tuple(dict.fromkeys(self.gpus))

    def __str__(self) -> str:
        """The one written form: ``cpu``, ``0,1`` or ``''``."""
        return "cpu" if self.cpu else ",".join(map(str, self.gpus))


def parse_device(text: str | DeviceRequest) -> DeviceRequest:
    """``--device`` as written (``''``, ``cpu``, ``0``, ``0,1,2,3``, ``cuda:0``, case and spaces ignored) as a
    DeviceRequest: the one parser of the option (utils/torch_utils.py, utils/process.py and utils/distributed.py
    read it through here); a UserError when it is none of these."""
    if isinstance(text, DeviceRequest):
        return text
    spec = str(text).strip().lower().replace("cuda:", "").replace(" ", "")
    if spec == "cpu":
        return DeviceRequest(cpu=True)
    if not spec:
        return DeviceRequest()
    ids = spec.split(",")
    if not all(i.isascii() and i.isdigit() for i in ids):
        raise UserError(f"--device '{text}' is not valid: use 'cpu', '0' or '0,1,2,3'")
    return DeviceRequest(gpus=tuple(int(i) for i in ids))


def device_option(text: str) -> str:
    """An argparse type: ``--device`` in its one written form (``str(parse_device(text))``), else argparse's one
    error line."""
    try:
        return str(parse_device(text))
    except UserError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: use 'cpu', '0' or '0,1,2,3'") from e


def add_device(group: ArgGroup, default: str = "") -> None:
    group.add_argument(
        "--device",
        type=device_option,
        default=default,
        help="'' (auto: GPU 0 when there is one, else the CPU), 'cpu', '0', or '0,1,2,3' under a "
        "launcher, one GPU per rank ('0,0': two ranks share GPU 0, over gloo) "
        "(default: %(default)r)",
    )


def add_run_folder(group: ArgGroup, task: str) -> None:
    """``--project``, ``--name``, ``--exist-ok``: the run is saved to ``project/name`` (then ``name2``, ...)."""
    group.add_argument("--project", default=str(RUNS / task), help="runs are saved to project/name")
    group.add_argument("--name", default="exp", help="runs are saved to project/name")
    group.add_argument(
        "--exist-ok", action="store_true", help="reuse project/name when it exists instead of making name2, name3, ..."
    )


def add_half(group: ArgGroup) -> None:
    group.add_argument(
        "--half",
        action="store_true",
        help="fp16: val.py and detect.py compute in fp16 (CUDA devices, PyTorch models; fp32 "
        "elsewhere, with a warning); export.py writes fp16 files (on any device)",
    )


def add_end2end(group: ArgGroup) -> None:
    group.add_argument(
        "--end2end",
        action="store_true",
        help="NMS-free output of the one-to-one head (B, 300, 6), for a model family that has one (docs/families.md)",
    )


def add_allow_pipe(group: ArgGroup) -> None:
    group.add_argument(
        "--allow-pipe",
        action="store_true",
        help=f"let pipe:COMMAND shard URLs in the data YAML or a shard list run their shell commands (or set "
        f"{ALLOW_PIPE_ENV}=1); without it such a source is refused: a downloaded data YAML must not run code",
    )


def add_max_pixels(group: ArgGroup) -> None:
    group.add_argument(
        "--max-pixels",
        type=int,
        default=MAX_PIXELS,
        metavar="PIXELS",
        help="images with more pixels (width x height, as their header says) are skipped and counted, never "
        "allocated (default: 2**28)",
    )


def apply_data_limits(opt: argparse.Namespace) -> None:
    """Hand ``--allow-pipe`` and ``--max-pixels`` to the data readers of this process and of the processes it
    starts (loader workers, probe pools, ranks), through the environment they all inherit.

    ``YOLO_ALLOW_PIPE=1`` set by the user stays set; the flag only adds the opt-in.
    """
    if getattr(opt, "allow_pipe", False):
        os.environ[ALLOW_PIPE_ENV] = "1"
    max_pixels = getattr(opt, "max_pixels", None)
    if max_pixels is not None:
        if max_pixels < 100:
            raise UserError(f"--max-pixels {max_pixels}: must be at least 100 (an image is at least 10x10)")
        os.environ[MAX_PIXELS_ENV] = str(max_pixels)
