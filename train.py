"""Train a detector of any model family here (docs/families.md; the family decides its loss, NMS and hyp file).

    python train.py                                   # yolo11n on the built-in shapes set, CPU or GPU 0
    python train.py --data path/to/data.yaml --cfg yolo11n.yaml --epochs 100 --img 640
    python train.py --data path/to/data.yaml --weights yolo11n.pt   # fine-tune an Ultralytics checkpoint
    python -m torch.distributed.run --nproc_per_node 4 train.py --device 0,1,2,3 --batch-size 64
    python train.py --resume                          # continue the latest interrupted run

This file is the command line: its options, the presets, and one call into the engine (utils/engine/).
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.monotonic()  # the demo's time budget counts from here: start-up and data generation included

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import shlex
import sys
from pathlib import Path

from models.families import titles_by
from utils.cli import (
    RUNS,
    add_allow_pipe,
    add_device,
    add_imgsz,
    add_max_pixels,
    add_run_folder,
    add_workers,
    apply_data_limits,
    make_parser,
    non_negative_int,
    positive_float,
    positive_int,
)
from utils.data.config import data_yaml_path
from utils.distributed import check_one_process_per_gpu, dist_info, end_with_launcher
from utils.engine.config import TrainConfig, field_names
from utils.engine.resume import ResumeRequest
from utils.engine.run import Launch, run
from utils.errors import run_reporting_errors
from utils.log import LOGGER, setup_logging
from utils.process import setup_process, watch_exit
from utils.search.options import add_search_options
from utils.storage import is_url
from utils.trackers import DEFAULT_TRACKERS, TRACKER_NAMES

ROOT = Path(__file__).resolve().parent

DEMO_DATA = ROOT / "data/shapes.yaml"
# `python train.py` trains the built-in demo in a few minutes: yolo11n, whose 22 epochs in fp32 (as a CPU without bf16
# trains) take about the time of yolov5n's 30, at a far higher mAP (docs/benchmarks.md). Any other dataset gets
# YOLOv5's model, size and length. The model applies only to a run from scratch (no --weights, no --resume).
DEMO_PRESET = {"cfg": "yolo11n.yaml", "imgsz": 192, "epochs": 22}
DATASET_PRESET = {"cfg": "yolov5n.yaml", "imgsz": 640, "epochs": 100}
# On a slower machine the demo trains fewer of its 22 epochs: as many as let the whole process (data generation,
# start-up, training, validation) end within this budget, leaving the rest of 5 minutes to the final validation.
DEMO_TIME_BUDGET_S = 270


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    data = p.add_argument_group("data")
    data.add_argument("--data", default=str(DEMO_DATA), help="data YAML (default: the built-in shapes demo)")
    add_imgsz(
        data,
        help=f"train and val size (default: {DEMO_PRESET['imgsz']} on the built-in demo, "
        f"{DATASET_PRESET['imgsz']} on any other --data)",
    )
    data.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic)")
    data.add_argument("--single-cls", action="store_true", help="train every class as one")
    data.add_argument(
        "--cache",
        nargs="?",
        const="ram",
        default="auto",
        choices=["auto", "ram", "disk", "off"],
        help="cache decoded images: auto (in RAM when the dataset is small), ram, disk, off (default: auto)",
    )
    add_workers(data)
    add_allow_pipe(data)
    add_max_pixels(data)
    data.add_argument(
        "--shard-window",
        type=int,
        default=1000,
        help="tar shards: samples shuffled together (and mosaic partners drawn from) within an epoch",
    )
    data.add_argument(
        "--resampled",
        action="store_true",
        help="tar shards: draw shards with replacement (WebDataset's resampled mode; approximate epochs)",
    )

    model = p.add_argument_group("model")
    model.add_argument(
        "--weights",
        default="",
        help="checkpoint to start from (ours, YOLOv5's or Ultralytics' detection .pt, e.g. yolo11n.pt; '' trains "
        "from scratch)",
    )
    model.add_argument(
        "--cfg",
        default=None,
        help=f"model YAML (default: the config inside --weights; from scratch {DEMO_PRESET['cfg']} on "
        f"the built-in demo, {DATASET_PRESET['cfg']} on any other --data)",
    )
    model.add_argument(
        "--freeze", nargs="+", type=non_negative_int, default=[0], help="freeze the first N layers, or listed layers"
    )
    model.add_argument("--noautoanchor", action="store_true", help="keep the model's anchors as they are")
    model.add_argument(
        "--sync-bn",
        action="store_true",
        help="synchronised BatchNorm across ranks (DDP); on one CPU process: exact two-pass statistics",
    )

    add_schedule_options(p.add_argument_group("schedule"))
    augmentation = p.add_argument_group("augmentation (the rates are in --hyp)")
    augmentation.add_argument("--multi-scale", action="store_true", help="vary the image size by +/- 50%% per batch")
    augmentation.add_argument(
        "--close-mosaic",
        type=int,
        default=10,
        help="train the last N epochs without mosaic and mixup (a family whose hyp sets no_aug_share: that stage instead)",
    )
    augmentation.add_argument(
        "--image-weights",
        action="store_true",
        help="draw each epoch's images weighted by their classes' difficulty (last validation's mAP)",
    )
    augmentation.add_argument("--quad", action="store_true", help="merge every 4 training images into one at 2x size")

    distributed = p.add_argument_group("device and distributed runs")
    add_device(distributed)
    distributed.add_argument(
        "--dist-timeout",
        type=float,
        default=10.0,
        help="minutes a collective may wait for a rank before the run stops (DDP)",
    )
    distributed.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default="",
        choices=("inductor", "aot_eager", "eager"),
        metavar="BACKEND",
        help="torch.compile the model's forward (not the loss) with BACKEND (alone: inductor; aot_eager traces "
        "without generating code, for checks); off by default: see docs/training.md",
    )
    # torch.distributed.launch and older scripts pass these; LOCAL_RANK from the environment is what counts.
    distributed.add_argument("--local-rank", "--local_rank", type=int, default=-1, help=argparse.SUPPRESS)

    output = p.add_argument_group("output and checkpoints")
    add_run_folder(output, "train")
    output.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        help="resume the newest interrupted run (not finished) under --project, or PATH/last.pt",
    )
    output.add_argument("--nosave", action="store_true", help="only save the final checkpoint")
    output.add_argument("--noplots", action="store_true", help="write no plots")
    output.add_argument("--save-period", type=int, default=-1, help="also save epochN.pt every N epochs (< 1: never)")
    output.add_argument(
        "--save-steps", type=int, default=0, help="also save last.pt every N optimizer steps (0: never)"
    )
    output.add_argument(
        "--save-minutes",
        type=float,
        default=10.0,
        help="save last.pt inside an epoch once this many minutes passed since the last save (0: never)",
    )
    output.add_argument(
        "--log-interval",
        type=int,
        default=TrainConfig.log_interval,
        metavar="N",
        help="read the losses back from the device every N optimizer steps (the progress line, Ctrl-C and "
        "--save-minutes act at these steps)",
    )
    output.add_argument(
        "--loggers",
        nargs="*",
        default=list(DEFAULT_TRACKERS),
        choices=TRACKER_NAMES,
        metavar="NAME",
        help=f"experiment trackers, any of {', '.join(TRACKER_NAMES)} (--loggers alone: none, results.csv only)",
    )
    output.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="write a torch.profiler trace of N optimizer steps to the run folder (profile.json, "
        "Chrome's trace format; 0: none)",
    )
    return p


def add_schedule_options(schedule: argparse._ArgumentGroup) -> None:
    """The run's length, optimisation, seed, precision and evolution."""
    schedule.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help=f"total training epochs, with --resume: extend the run (default: "
        f"{DEMO_PRESET['epochs']} on the built-in demo, {DATASET_PRESET['epochs']} on any "
        f"other --data)",
    )
    schedule.add_argument(
        "--time", type=positive_float, default=None, help="train for this many hours (overrides --epochs)"
    )
    schedule.add_argument("--batch-size", type=positive_int, default=16, help="total batch size over all ranks")
    schedule.add_argument(
        "--hyp",
        default="",
        help="hyper-parameter YAML (default: the model family's: "
        f"{titles_by(lambda family: family.default_hyp, '{value} for {titles}')})",
    )
    schedule.add_argument(
        "--optimizer",
        default="auto",
        choices=["auto", "SGD", "Adam", "AdamW"],
        help="auto: AdamW for short runs, SGD for long ones (see utils/optimizer.py)",
    )
    schedule.add_argument("--cos-lr", action="store_true", help="cosine learning-rate decay instead of linear")
    schedule.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing epsilon")
    schedule.add_argument(
        "--patience", type=int, default=100, help="stop after this many epochs without improvement (0: never)"
    )
    schedule.add_argument(
        "--noval", action="store_true", help="only validate after the final epoch (no early stopping)"
    )
    schedule.add_argument(
        "--seed", type=non_negative_int, default=0, help="global seed: model init, data order, augmentations"
    )
    schedule.add_argument("--deterministic", action="store_true", help="bit-for-bit repeatable kernels (slower)")
    schedule.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mixed precision where it helps: fp16 on CUDA, bf16 on CPUs with native bf16",
    )
    add_search_options(schedule)


def parse_opt(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The command line, and the names of the options the user gave explicitly.

    ``--cfg`` (from scratch), ``--imgsz`` and ``--epochs`` left out take the preset of the data
    (``training_preset``); a resumed run then replaces them with its own (utils/engine/resume.py).
    """
    argv = sys.argv[1:] if argv is None else argv
    opt = build_parser().parse_args(argv)
    unset = object()
    probe = build_parser()
    probe.set_defaults(**dict.fromkeys(vars(opt), unset))
    explicit = {name for name, value in vars(probe.parse_args(argv)).items() if value is not unset}
    if not opt.cfg:  # YOLOv5's commands often say --cfg '' for "no config": the same as leaving it out
        opt.cfg = None
        explicit.discard("cfg")
    for name, value in preset_values(opt, training_preset(opt.data)[1]).items():
        if getattr(opt, name) is None:
            setattr(opt, name, value)
    opt.argv = list(argv)
    return opt, explicit


def preset_values(opt: argparse.Namespace, preset: dict[str, int | str]) -> dict[str, int | str]:
    """The preset's values that can apply to this run: its model only to a run from scratch."""
    from_scratch = not (opt.weights or opt.resume)
    return {name: value for name, value in preset.items() if name != "cfg" or from_scratch}


def is_demo_data(data: str | Path) -> bool:
    """Whether ``data`` names the built-in demo's YAML (as a path, or as `shapes.yaml` found in data/)."""
    return data_yaml_path(data) == DEMO_DATA.resolve()


def training_preset(data: str | Path) -> tuple[str, dict[str, int | str]]:
    """The name and values of the defaults for ``--data``: the demo's for the built-in set, YOLOv5's otherwise."""
    if is_demo_data(data):
        return "the built-in demo's", DEMO_PRESET
    return "YOLOv5's, for any --data but the built-in demo", DATASET_PRESET


def preset_line(opt: argparse.Namespace, explicit: set[str]) -> str | None:
    """The one log line saying which preset gave --cfg/--imgsz/--epochs; None when all were given or a run resumes."""
    name, preset = training_preset(opt.data)
    taken = [f"--{k} {v}" for k, v in preset_values(opt, preset).items() if k not in explicit]
    if opt.resume or not taken:
        return None
    budget = (
        f", fewer if the whole run would not end within {DEMO_TIME_BUDGET_S} s" if demo_budget(opt, explicit) else ""
    )
    return f"defaults: {' '.join(taken)}{budget} (preset: {name})"


def demo_budget(opt: argparse.Namespace, explicit: set[str]) -> bool:
    """Whether the demo's time budget applies: the built-in data, a new run (no evolution), no --epochs or --time."""
    new_run = not (opt.resume or opt.evolve is not None or opt.resume_evolve)
    return is_demo_data(opt.data) and new_run and not explicit & {"epochs", "time"}


def make_launch(opt: argparse.Namespace, explicit: set[str]) -> Launch:
    """The engine's configuration and resume request from the command line."""
    values = {name: getattr(opt, name) for name in field_names() if hasattr(opt, name)}
    if demo_budget(opt, explicit):
        values.update(time=DEMO_TIME_BUDGET_S / 3600, time_includes_startup=True, time_max_epochs=opt.epochs)
    if (opt.evolve is not None or opt.resume_evolve) and "project" not in explicit:
        values["project"] = str(RUNS / "evolve")
    given = explicit & set(field_names())
    if "time" in given:  # --time replaces a stored budget entirely
        given |= {"time_includes_startup", "time_max_epochs"}
    resume = ResumeRequest(
        path=opt.resume if isinstance(opt.resume, str) else None,
        latest_under=tuple(map(str, resume_search(opt, explicit))) if opt.resume is True else (),
        explicit=frozenset(given),
    )
    return Launch(TrainConfig(**values), resume, PROCESS_STARTED)


def resume_search(opt: argparse.Namespace, explicit: set[str]) -> list[Path | str]:
    """Where ``--resume`` without a path looks for the newest interrupted run: --project, and by default also the folder
    beside train.py where runs were written before they went under the current directory."""
    if "project" in explicit:
        return [opt.project if is_url(opt.project) else Path(opt.project)]  # a URL: a project on object storage
    return [Path(opt.project), ROOT / "runs/train"]


def main(argv: list[str] | None = None) -> int:
    opt, explicit = parse_opt(argv)
    info = dist_info()
    end_with_launcher(info)
    setup_logging(info.rank)
    LOGGER.info(setup_process(opt.device, opt.deterministic))
    preset = preset_line(opt, explicit)
    if preset:
        LOGGER.info(preset)
    launch = make_launch(opt, explicit)

    def start() -> int:
        apply_data_limits(opt)
        check_one_process_per_gpu(opt.device, info, f"train.py {shlex.join(opt.argv)}")
        return run(launch, info)

    return run_reporting_errors(start)


if __name__ == "__main__":
    sys.exit(watch_exit(main()))
