"""The command-line options the scripts share, each declared once.

train.py, val.py, detect.py, export.py and shards.py add ``--imgsz``, ``--workers``, ``--device``,
``--project``/``--name``/``--exist-ok``, ``--half`` and ``--end2end`` through the functions here, so that one option has one
spelling, one set of aliases, one meaning and one default in every script. ``make_parser`` gives every script the
same help layout: option groups, and each option's default shown; it refuses abbreviated options (``--epoch``
is not ``--epochs``) and suggests the nearest option for a misspelt one. The type functions below check a
number's range where argparse reads it, so a bad value is argparse's one error line, never a traceback later.

Run folders are relative to the current directory (``./runs/train/exp``, ``./runs/val/exp``, ...), as in
YOLOv5 and Ultralytics; scripts record the absolute path of the folder they made.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable
from pathlib import Path

RUNS = Path("runs")  # under the current directory
INFERENCE_IMGSZ = 640  # YOLOv5's size, used when neither --imgsz nor the model says otherwise
INFERENCE_IMGSZ_HELP = (
    f"default: the size the checkpoint was trained at (an exported file: its own size), else {INFERENCE_IMGSZ}"
)
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

    def __init__(self, **kwargs) -> None:
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


def add_imgsz(group, *, help: str, pair: bool = False) -> None:
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


def add_workers(group) -> None:
    group.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help="worker processes for loading and checking data, per rank (capped by the CPU cores)",
    )


def add_device(group, default: str = "") -> None:
    group.add_argument(
        "--device",
        default=default,
        help="'' (auto: GPU 0 when there is one, else the CPU), 'cpu', '0', or '0,1,2,3' under a "
        "launcher, one GPU per rank ('0,0': two ranks share GPU 0, over gloo) "
        "(default: %(default)r)",
    )


def add_run_folder(group, task: str) -> None:
    """``--project``, ``--name``, ``--exist-ok``: the run is saved to ``project/name`` (then ``name2``, ...)."""
    group.add_argument("--project", default=str(RUNS / task), help="runs are saved to project/name")
    group.add_argument("--name", default="exp", help="runs are saved to project/name")
    group.add_argument(
        "--exist-ok", action="store_true", help="reuse project/name when it exists instead of making name2, name3, ..."
    )


def add_half(group) -> None:
    group.add_argument(
        "--half",
        action="store_true",
        help="fp16: val.py and detect.py compute in fp16 (CUDA devices, PyTorch models; fp32 "
        "elsewhere, with a warning); export.py writes fp16 files (on any device)",
    )


def add_end2end(group) -> None:
    group.add_argument(
        "--end2end",
        action="store_true",
        help="NMS-free output of the one-to-one head (B, 300, 6), for a model family that has one (docs/families.md)",
    )
