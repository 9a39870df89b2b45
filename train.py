"""Train a YOLOv5, YOLOv8, YOLO11 or YOLO26 detector (the model family decides its loss, NMS and hyp file).

    python train.py                                   # yolo11n on the built-in shapes set, CPU or GPU 0
    python train.py --data path/to/data.yaml --cfg yolo11n.yaml --epochs 100 --img 640
    python train.py --data path/to/data.yaml --weights yolo11n.pt   # fine-tune an Ultralytics checkpoint
    python -m torch.distributed.run --nproc_per_node 4 train.py --device 0,1,2,3 --batch-size 64
    python train.py --resume                          # continue the latest interrupted run
"""
from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import contextlib
import itertools
import json
import logging
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from models.families import family_of
from models.yolo import build_model, load_model_config
from utils.amp import Precision, autocast, choose_precision
from utils.checkpoint import (latest_last_checkpoint, load_checkpoint, model_weights,
                              restore_training_state, resumed_options, run_folder_of, strip_training_state,
                              training_checkpoint)
from utils.cli import RUNS, add_device, add_imgsz, add_run_folder, add_workers, make_parser
from utils.data.config import data_yaml_path, load_data_config
from utils.data.image_weights import (class_weights_from_maps, draw_digest, labels_to_class_weights,
                                      labels_to_image_weights)
from utils.data.loader import create_dataloader, load_labels
from utils.data.webshards import ShardSet
from utils.distributed import (DistInfo, all_reduce_sum, broadcast_object, collective, collective_failure,
                               de_parallel, destroy_process_group, dist_info, end_with_launcher, init_process_group,
                               rank_zero_decides)
from utils.ema import ModelEMA
from utils.errors import UserError, run_reporting_errors
from utils.evolve import append_evolve_row, next_hyp, plot_evolve, read_evolve_csv, result_keys, write_best_hyp
from utils.hyp import Hyp
from utils.log import LOGGER, colorstr, setup_logging
from utils.loggers import NullLogger, RunLogger, make_logger
from utils.loss import DetectionLoss, LossNorm
from utils.lr_schedule import LrSchedule, apply_warmup, warmup_iterations
from utils.metrics import RECALL_POINTS, fitness
from utils.optimizer import NOMINAL_BATCH, build_optimizer, choose_optimizer, resumed_choice, unused_hyp_values
from utils.process import kernel_choice, setup_process
from utils.results_log import result_columns
from utils.run_dir import increment_path
from utils.run_record import RunRecord
from utils.sync_bn import convert_sync_batchnorm
from utils.torch_utils import init_torch_seeds, select_device, torch_distributed_zero_first
from utils.validation import validate

ROOT = Path(__file__).resolve().parent
MAX_NONFINITE_STEPS = 25  # in a row: training has diverged


DEMO_DATA = ROOT / "data/shapes.yaml"
# `python train.py` trains the built-in demo in a few minutes: yolo11n, whose 22 epochs in fp32 (as a CPU without bf16
# trains) take about the time of yolov5n's 30, at a far higher mAP (docs/benchmarks.md). Any other dataset gets
# YOLOv5's model, size and length. The model applies only to a run from scratch (no --weights, no --resume).
DEMO_PRESET = {"cfg": "yolo11n.yaml", "imgsz": 192, "epochs": 22}
DATASET_PRESET = {"cfg": "yolov5n.yaml", "imgsz": 640, "epochs": 100}


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    data = p.add_argument_group("data")
    data.add_argument("--data", default=str(DEMO_DATA), help="data YAML (default: the built-in shapes demo)")
    add_imgsz(data, help=f"train and val size (default: {DEMO_PRESET['imgsz']} on the built-in demo, "
                         f"{DATASET_PRESET['imgsz']} on any other --data)")
    data.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic)")
    data.add_argument("--single-cls", action="store_true", help="train every class as one")
    data.add_argument("--cache", nargs="?", const="ram", default="auto", choices=["auto", "ram", "disk", "off"],
                      help="cache decoded images: auto (in RAM when the dataset is small), ram, disk, off "
                           "(default: auto)")
    add_workers(data)
    data.add_argument("--shard-window", type=int, default=1000,
                      help="tar shards: samples shuffled together (and mosaic partners drawn from) within an epoch")
    data.add_argument("--resampled", action="store_true",
                      help="tar shards: draw shards with replacement (WebDataset's resampled mode; approximate epochs)")

    model = p.add_argument_group("model")
    model.add_argument("--weights", default="", help="checkpoint to start from (ours or YOLOv5's; '' trains from "
                                                     "scratch)")
    model.add_argument("--cfg", default=None,
                       help=f"model YAML (default: the config inside --weights; from scratch {DEMO_PRESET['cfg']} on "
                            f"the built-in demo, {DATASET_PRESET['cfg']} on any other --data)")
    model.add_argument("--freeze", nargs="+", type=int, default=[0],
                       help="freeze the first N layers, or listed layers")
    model.add_argument("--noautoanchor", action="store_true", help="keep the model's anchors as they are")
    model.add_argument("--sync-bn", action="store_true",
                       help="synchronised BatchNorm across ranks (DDP); on one CPU process: exact two-pass statistics")

    schedule = p.add_argument_group("schedule")
    schedule.add_argument("--epochs", type=int, default=None,
                          help=f"total training epochs, with --resume: extend the run (default: "
                               f"{DEMO_PRESET['epochs']} on the built-in demo, {DATASET_PRESET['epochs']} on any "
                               f"other --data)")
    schedule.add_argument("--time", type=float, default=None, help="train for this many hours (overrides --epochs)")
    schedule.add_argument("--batch-size", type=int, default=16, help="total batch size over all ranks")
    schedule.add_argument("--hyp", default="", help="hyper-parameter YAML (default: the model family's: "
                          "data/hyps/hyp.scratch-low.yaml, hyp.anchor-free.yaml for YOLOv8/11/26)")
    schedule.add_argument("--optimizer", default="auto", choices=["auto", "SGD", "Adam", "AdamW"],
                          help="auto: AdamW for short runs, SGD for long ones (see utils/optimizer.py)")
    schedule.add_argument("--cos-lr", action="store_true", help="cosine learning-rate decay instead of linear")
    schedule.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing epsilon")
    schedule.add_argument("--patience", type=int, default=100,
                          help="stop after this many epochs without improvement (0: never)")
    schedule.add_argument("--noval", action="store_true",
                          help="only validate after the final epoch (no early stopping)")
    schedule.add_argument("--seed", type=int, default=0, help="global seed: model init, data order, augmentations")
    schedule.add_argument("--deterministic", action="store_true", help="bit-for-bit repeatable kernels (slower)")
    schedule.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                          help="mixed precision where it helps: fp16 on CUDA, bf16 on CPUs with native bf16")
    schedule.add_argument("--evolve", type=int, nargs="?", const=300, default=None, metavar="N",
                          help="evolve hyper-parameters for N generations (300 when N is left out) in "
                               "runs/evolve/exp")
    schedule.add_argument("--resume-evolve", "--resume_evolve", default=None, metavar="CSV",
                          help="with --evolve N: continue this evolve.csv up to N generations in total")

    augmentation = p.add_argument_group("augmentation (the rates are in --hyp)")
    augmentation.add_argument("--multi-scale", action="store_true", help="vary the image size by +/- 50%% per batch")
    augmentation.add_argument("--close-mosaic", type=int, default=10,
                              help="train the last N epochs without mosaic and mixup")
    augmentation.add_argument("--image-weights", action="store_true",
                              help="draw each epoch's images weighted by their classes' difficulty (last "
                                   "validation's mAP)")
    augmentation.add_argument("--quad", action="store_true", help="merge every 4 training images into one at 2x size")

    distributed = p.add_argument_group("device and distributed runs")
    add_device(distributed)
    distributed.add_argument("--dist-timeout", type=float, default=10.0,
                             help="minutes a collective may wait for a rank before the run stops (DDP)")
    # torch.distributed.launch and older scripts pass these; LOCAL_RANK from the environment is what counts.
    distributed.add_argument("--local-rank", "--local_rank", type=int, default=-1, help=argparse.SUPPRESS)

    output = p.add_argument_group("output and checkpoints")
    add_run_folder(output, "train")
    output.add_argument("--resume", nargs="?", const=True, default=False,
                        help="resume the latest run (the newest last.pt under --project), or PATH/last.pt")
    output.add_argument("--nosave", action="store_true", help="only save the final checkpoint")
    output.add_argument("--noplots", action="store_true", help="write no plots")
    output.add_argument("--save-period", type=int, default=-1,
                        help="also save epochN.pt every N epochs (< 1: never)")
    output.add_argument("--save-steps", type=int, default=0,
                        help="also save last.pt every N optimizer steps (0: never)")
    output.add_argument("--save-minutes", type=float, default=10.0,
                        help="save last.pt inside an epoch once this many minutes passed since the last save (0: "
                             "never)")
    return p


def parse_opt(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The command line, and the names of the options the user gave explicitly.

    ``--cfg`` (from scratch), ``--imgsz`` and ``--epochs`` left out take the preset of the data
    (``training_preset``); a resumed run then replaces them with its own (utils/checkpoint.py resumed_options).
    """
    argv = sys.argv[1:] if argv is None else argv
    opt = build_parser().parse_args(argv)
    unset = object()
    probe = build_parser()
    probe.set_defaults(**{name: unset for name in vars(opt)})
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
    return f"defaults: {' '.join(taken)} (preset: {name})"


def main(argv: list[str] | None = None) -> int:
    opt, explicit = parse_opt(argv)
    info = dist_info()
    end_with_launcher(info)
    setup_logging(info.rank)
    LOGGER.info(setup_process(opt.device, opt.deterministic))
    preset = preset_line(opt, explicit)
    if preset:
        LOGGER.info(preset)
    return run_reporting_errors(lambda: run(opt, explicit, info))


def run(opt: argparse.Namespace, explicit: set[str], info: DistInfo) -> int:
    if not opt.resume:  # before joining the process group, so that every rank says so at once
        check_global_batch(opt.batch_size, info.world_size)
    device = setup_device(opt, info)
    try:
        if opt.evolve is not None or opt.resume_evolve:
            evolve(opt, explicit, device, info)
            return 0
        opt, ckpt = resume_point(opt, explicit, info)
        if ckpt is not None and ckpt["mid_epoch"] is None and ckpt["epoch"] + 1 >= opt.epochs:
            LOGGER.info(f"{opt.resume}: this run already finished its {opt.epochs} epochs; nothing to resume "
                        f"(add --epochs N to train it further)")
            return 0
        train(opt, device, info, ckpt)
    except RuntimeError as e:  # dist.DistError and CollectiveError are RuntimeErrors
        failure = collective_failure(e, info)
        if failure is None:
            raise
        LOGGER.error(failure)
        return 1
    finally:
        destroy_process_group()
    return 0


def setup_device(opt: argparse.Namespace, info: DistInfo) -> torch.device:
    """This process's device; in a distributed run, also join the process group."""
    ids = [i for i in opt.device.replace("cuda:", "").split(",") if i.strip()] if opt.device != "cpu" else []
    if len(ids) > 1 and not info.is_distributed:
        command = " ".join(shlex.quote(a) for a in opt.argv)
        raise UserError(f"--device {opt.device} names {len(ids)} GPUs but this is one process: start one per GPU "
                        f"with `python -m torch.distributed.run --nproc_per_node {len(ids)} train.py {command}`")
    device = select_device(opt.device, local_rank=info.local_rank, local_world_size=info.local_world_size)
    if info.is_distributed:
        init_process_group(device, info, opt.dist_timeout)
        LOGGER.info(f"DDP: world size {info.world_size}, backend {dist.get_backend()}, rank {info.rank} on {device}")
    return device


def resume_point(opt: argparse.Namespace, explicit: set[str],
                 info: DistInfo) -> tuple[argparse.Namespace, dict | None]:
    """The options and checkpoint to continue from: --resume, or the run a restarted launcher group was training.

    Rank 0 decides which file; every rank then reads it (on several machines the run folder must be shared).
    """
    path = None
    if opt.resume is True and info.is_main:  # the newest run rank 0 sees; the other nodes need not see it under
        path = latest_last_checkpoint(*resume_search(opt, explicit))  # their own working directory
    elif opt.resume and opt.resume is not True:
        path = Path(opt.resume).resolve()  # every node reads the same file, whatever its working directory
    elif info.restart_count > 0 and info.is_main:
        folder = run_folder_of(info.run_id, opt.project, info.launcher_started)
        if folder is not None and (folder / "weights/last.pt").is_file():
            path = folder / "weights/last.pt"
            LOGGER.info(f"restart {info.restart_count} of launcher run {info.run_id}: continuing {folder}")
    path = broadcast_object(None if path is None else str(path), info)
    if path is None:
        return opt, None
    ckpt = load_checkpoint(path)
    if info.restart_count > 0 and not opt.resume:
        explicit = set()  # the same command line as the run's own: nothing to check
    return resumed_options(opt, explicit, Path(path), ckpt), ckpt


@dataclass
class Training:
    """What every training step uses; made once by ``train``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: ModelEMA | None
    compute_loss: DetectionLoss
    precision: Precision
    device: torch.device
    info: DistInfo
    opt: argparse.Namespace
    hyp: Hyp
    momentum: float  # the optimizer's own, what warmup ramps towards
    grid: int
    accumulate: int
    n_warmup: int
    schedule: LrSchedule
    save_mid_epoch: object = None  # callable(epoch, next_batch, tally) on rank 0, or None
    logger: RunLogger = field(default_factory=NullLogger)  # TensorBoard on rank 0 (utils/loggers.py)
    steps_done: int = 0
    skipped_in_row: int = 0  # optimizer steps skipped for non-finite gradients, across epochs
    last_save: float = field(default_factory=time.monotonic)


@dataclass
class LossTally:
    """An epoch's training losses so far, summed over ranks (items of micro-batches, see utils/loss.py)."""

    sums: np.ndarray = field(default_factory=lambda: np.zeros(3))
    micro_batches: float = 0.0  # global micro-batches counted (whatever the number of ranks)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients

    def add(self, synced: torch.Tensor, world_size: int) -> None:
        """Add the all-reduced [three loss items, finite micro-batches] of some steps."""
        self.sums += synced[:3].cpu().numpy()
        self.micro_batches += float(synced[3]) / world_size

    def means(self) -> np.ndarray:
        return self.sums / max(self.micro_batches, 1.0)

    def state(self) -> dict:
        return {"sums": self.sums.tolist(), "micro_batches": self.micro_batches, "skipped_steps": self.skipped_steps}


def train(opt: argparse.Namespace, device: torch.device, info: DistInfo, ckpt: dict | None,
          hyp: Hyp | None = None) -> dict:
    """One training run; ``hyp`` (an --evolve generation's) replaces reading --hyp."""
    # ---- options, data, model -------------------------------------------------------------------------
    check_options(opt, info, resumed=ckpt is not None)
    source = load_checkpoint(opt.weights) if opt.weights and not ckpt else None  # --weights to start from
    family = family_of(model_config(opt, ckpt, source))
    if ckpt:
        hyp = Hyp.from_dict(ckpt["hyp"], f"{opt.resume} (hyp)")
    elif hyp is None:
        hyp = Hyp.from_yaml(opt.hyp or family.default_hyp_path)
        family.check_hyp(hyp, opt.hyp or family.default_hyp)
    if ckpt and opt.deterministic != torch.backends.cudnn.deterministic:  # the resumed run's own, or given now
        LOGGER.info(kernel_choice(opt.deterministic) or "kernels: cuDNN benchmark (the resumed run's own)")
    init_torch_seeds(opt.seed)
    with torch_distributed_zero_first(info.local_rank):  # local rank 0 makes built-in data and label caches first
        data = load_data_config(opt.data)
        check_data_options(opt, data)  # before a shard index or label cache is built
        train_labels = load_labels(data["train"], nc=data["nc"], workers=opt.workers, prefix=colorstr("train: "),
                                   verbose=info.is_local_main)
        val_labels = load_labels(data["val"], nc=data["nc"], workers=opt.workers, prefix=colorstr("val: "),
                                 verbose=info.is_local_main)
    # Labels were checked against the data YAML's classes above; --single-cls folds them into one afterwards.
    nc, names = (1, ["item"]) if opt.single_cls else (data["nc"], data["names"])
    model = create_model(opt, nc, names, hyp, ckpt, source).to(device, memory_format=torch.channels_last)
    freeze_layers(model, opt.freeze)
    # Before the optimizer and the EMA take the parameters. On one CPU process --sync-bn still swaps in the CPU
    # SyncBN for its exact statistics, so that the run equals a W-rank --sync-bn run up to rounding.
    if opt.sync_bn and (info.is_distributed or device.type == "cpu"):
        model = convert_sync_batchnorm(model, device)
    grid = max(int(model.stride.max()), 32)
    if opt.imgsz % grid:
        raise UserError(f"--imgsz {opt.imgsz} must be a multiple of the largest stride ({grid})")
    precision = choose_precision(device, opt.amp)
    LOGGER.info(f"precision: {precision.reason}")

    batch_per_rank = opt.batch_size // info.world_size
    train_loader, dataset = create_dataloader(
        None, opt.imgsz, batch_per_rank, grid, hyp=hyp, augment=True, cache=image_cache(opt.cache),
        rect=opt.rect, global_rank=max(info.rank, 0), world_size=info.world_size, workers=opt.workers, shuffle=True,
        seed=opt.seed, single_cls=opt.single_cls, prefix=colorstr("train: "), label_set=train_labels,
        close_mosaic_epoch=close_mosaic_epoch(opt.epochs, opt.close_mosaic), image_weights=opt.image_weights,
        quad=opt.quad, shard_window=getattr(opt, "shard_window", 1000), resampled=getattr(opt, "resampled", False))
    # Every rank validates its own part of the split; the results are gathered (validate(gather=True)).
    val_loader, _ = create_dataloader(
        None, opt.imgsz, batch_per_rank * 2, grid, hyp=hyp, cache=image_cache(opt.cache), rect=True, pad=0.5,
        workers=opt.workers, single_cls=opt.single_cls, prefix=colorstr("val: "), label_set=val_labels,
        world_size=info.world_size, global_rank=max(info.rank, 0))
    if not ckpt and not opt.noautoanchor:
        family.fit_anchors(dataset, model, thr=hyp.anchor_t, imgsz=opt.imgsz)

    # ---- the run folder: made only now that every start-up check has passed ------------------------------
    save_dir = run_folder(opt, info, hyp)

    # ---- optimisation ------------------------------------------------------------------------------------
    if ckpt:  # the run's own choice, whatever --epochs or --time say now
        choice = resumed_choice(ckpt.get("optimizer_choice"), ckpt["opt"], len(dataset), nc, hyp, ckpt["optimizer"])
    else:
        choice = choose_optimizer(opt.optimizer, opt.epochs, len(dataset), opt.batch_size, nc, hyp,
                                  family.adamw_lr_per_class_term)
    accumulate = choice.accumulate
    LOGGER.info(f"optimizer: {choice.name} lr0={choice.lr0} momentum={choice.momentum} accumulate={accumulate} "
                f"({choice.reason})")
    if unused := unused_hyp_values(choice, hyp):
        LOGGER.info(f"optimizer: the hyp file's {' and '.join(unused)} not used ({choice.name}'s own instead)")
    decay = hyp.weight_decay * opt.batch_size * accumulate / NOMINAL_BATCH
    optimizer = build_optimizer(model, choice.name, choice.lr0, choice.momentum, decay)
    schedule = LrSchedule.for_run(opt.epochs, hyp.lrf, opt.cos_lr)
    ema = ModelEMA(model)  # on every rank: each validates its part with the same EMA weights
    scaler = torch.amp.GradScaler(device.type, enabled=precision.needs_scaler)
    start_epoch, start_batch, tally = 0, 0, LossTally()
    best_fitness, best_epoch = 0.0, -1
    if ckpt:
        restore_training_state(ckpt, optimizer, scaler, ema)
        schedule, start_epoch, start_batch, tally = resumed_position(ckpt, opt, hyp, info)
        best_fitness, best_epoch = float(ckpt["best_fitness"]), int(ckpt.get("best_epoch", -1))
    # Made at start_epoch - 1 and stepped once on creation, the scheduler sets this epoch's rates (a fresh
    # LambdaLR would restart a resumed run at lr0 * schedule(0)).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule, last_epoch=start_epoch - 1)
    if info.is_distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    compute_loss = family.make_loss(model, hyp, imgsz=opt.imgsz, label_smoothing=opt.label_smoothing)
    t = Training(model, optimizer, scaler, ema, compute_loss, precision, device, info, opt, hyp, choice.momentum, grid,
                 accumulate, warmup_iterations(hyp.warmup_epochs, len(train_loader)), schedule)
    columns = result_columns(compute_loss.item_names)
    # --image-weights: the class weights of the next epoch's draw (on every rank; rank 0 updates them).
    base_class_weights = labels_to_class_weights(dataset.labels, nc)
    class_weights = np.array(ckpt["class_weights"]) if ckpt and ckpt.get("class_weights") is not None else \
        base_class_weights
    record = None
    if info.is_main:
        record = RunRecord(save_dir, columns, patience=opt.patience, noval=opt.noval, nosave=opt.nosave,
                           save_period=opt.save_period, best_fitness=best_fitness, best_epoch=best_epoch,
                           start_epoch=start_epoch + (start_batch > 0))

        def checkpoint(epoch: int, mid_epoch: dict | None) -> dict:
            ckpt_now = training_checkpoint(model, ema, optimizer, scaler, epoch=epoch, mid_epoch=mid_epoch,
                                           best_fitness=record.best_fitness, best_epoch=record.best_epoch,
                                           lr_schedule=t.schedule.segments, optimizer_choice=choice.to_dict(),
                                           opt=opt, hyp=hyp.to_dict(),
                                           world_size=info.world_size, run_id=info.run_id)
            # The weights of the epoch after `epoch` (the one a resume draws next), set before this is called.
            ckpt_now["class_weights"] = [float(w) for w in class_weights] if opt.image_weights else None
            return ckpt_now

        t.logger = make_logger(save_dir, info.is_main)
        t.save_mid_epoch = lambda epoch, batch, so_far: record.save_mid_epoch(
            checkpoint(epoch - 1, {"epoch": epoch, "batch": batch, **so_far.state()}))
        if not ckpt and not opt.noplots:
            from utils.plots import plot_labels

            plot_labels(np.concatenate([lb for lb in dataset.labels if len(lb)] or [np.zeros((0, 5))]), names,
                        save_dir)

    # ---- training loop -----------------------------------------------------------------------------------
    workers = getattr(train_loader, "loader", train_loader).num_workers  # --workers capped by cores and batch
    LOGGER.info(f"Image sizes {opt.imgsz} train, {opt.imgsz} val; {workers} dataloader workers per rank; "
                f"logging to {colorstr(str(save_dir))}\nStarting training for {opt.epochs} epochs...")
    t_start, results, epoch = time.time(), (0.0,) * 7, start_epoch
    r = None  # the last validation's ValResults
    # On an error, the checkpoint being written in the background is finished first (rank 0 writes them).
    with record.kept_on_error() if record is not None else contextlib.nullcontext():
        for epoch in itertools.count(start_epoch):  # --time may change opt.epochs on the way
            t_epoch = time.perf_counter()
            if opt.image_weights:
                train_loader.set_image_weights(labels_to_image_weights(dataset.labels, class_weights))
                check_same_draw(info, train_loader.sampler.global_draw(epoch), epoch, device)
            compute_loss.set_epoch(epoch, opt.epochs)
            tally = train_one_epoch(t, train_loader, epoch, start_batch, tally, plots_dir=None if opt.noplots or
                                    epoch != start_epoch or not info.is_main else save_dir)
            lrs = [g["lr"] for g in optimizer.param_groups]  # the epoch's own rates, for results.csv
            scheduler.step()
            decision: dict = {}
            final = epoch + 1 == opt.epochs
            ema.update_attributes(model)
            if not opt.noval or final:
                r = validate(ema.ema, val_loader, names=names, device=device, compute_loss=t.compute_loss,
                             family=family, plots=final and not opt.noplots, verbose=final and nc < 50,
                             save_dir=save_dir, autocast_dtype=precision.dtype, gather=info.is_distributed,
                             main=info.is_main)
                results = r.as_row()
            if info.is_main:
                if opt.image_weights and (not opt.noval or final):
                    class_weights = class_weights_from_maps(base_class_weights, r.maps)
                    decision["class_weights"] = [float(w) for w in class_weights]  # repr round-trips exactly
                decision["stop"] = record.end_epoch(epoch, tally.means(), results if not opt.noval or
                                                    final else None, lrs, checkpoint(epoch, None), final)
                t.logger.log_epoch(epoch, dict(zip(columns[1:], [*tally.means().tolist(), *results, *lrs])))
                if opt.time:
                    decision.update(fit_to_time(opt, epoch, start_epoch, time.time() - t_start,
                                                time.perf_counter() - t_epoch))
            decision = json.loads(rank_zero_decides(info, json.dumps(decision)))  # the others wait on the store
            if decision.get("class_weights") is not None:
                class_weights = np.array(decision["class_weights"], dtype=np.float64)
            if decision.get("epochs"):
                refit_schedule(t, scheduler, train_loader, opt, decision["epochs"])
            if decision.get("stop") or epoch + 1 >= opt.epochs:
                break
            start_batch, tally = 0, LossTally()

    # ---- final validation --------------------------------------------------------------------------------
    del train_loader  # ends the training workers before the last validation
    best: tuple | None = None
    if info.is_main:
        LOGGER.info(f"\n{epoch - start_epoch + 1} epochs completed in {(time.time() - t_start) / 3600:.3f} hours.")
        record.close()
        strip_training_state(record.best)
        if record.best.exists() and record.best_epoch != epoch:  # the last epoch's report was not for the best weights
            best_ckpt = load_checkpoint(record.best)
            best = (best_ckpt["model_cfg"], model_weights(best_ckpt))
            LOGGER.info(f"\nValidating {record.best} (epoch {record.best_epoch})...")
    best = broadcast_object(best, info)  # every rank validates its part of the split with rank 0's best weights
    if best is not None:
        final_model = build_model(best[0], weights=best[1], names=names)
        r = validate(final_model.to(device, memory_format=torch.channels_last), val_loader, names=names,
                     device=device, plots=not opt.noplots, save_dir=save_dir, verbose=nc < 50,
                     compute_loss=t.compute_loss, family=family, autocast_dtype=precision.dtype,
                     gather=info.is_distributed, main=info.is_main)
        results = r.as_row()
    if info.is_main:
        if r is not None and r.class_metrics is not None and len(r.class_metrics.pr_curve):
            t.logger.log_pr_curve(r.class_metrics.pr_curve.mean(0), RECALL_POINTS, epoch)
        t.logger.close()
        if not opt.noplots:
            from utils.plots import plot_results

            plot_results(save_dir / "results.csv")
        LOGGER.info(f"Results saved to {colorstr(str(save_dir))}")
    return {"save_dir": save_dir, "results": results}


def train_one_epoch(t: Training, loader, epoch: int, start_batch: int, tally: LossTally,
                    plots_dir: Path | None = None) -> LossTally:
    """One epoch of optimizer steps, from ``start_batch`` on (a resumed epoch), with one all-reduce per step.

    That all-reduce carries the positive counts of the step's micro-batches (the loss divides by global counts:
    the step equals a one-process step on the global batch), the previous step's losses and rank 0's wish to
    save a checkpoint, which is then written before this step with the state after the previous one.
    """
    model, info, world = t.model, t.info, t.info.world_size
    model.train()
    loader.set_epoch(epoch, start_batch)
    n_batches = len(loader)
    batches = enumerate(loader, start_batch)
    if info.is_main:
        losses = "".join(f"{name + '_loss':>11}" for name in t.compute_loss.item_names)
        LOGGER.info(f"\n{'Epoch':>11}{'GPU_mem':>11}{losses}{'Instances':>11}{'Size':>11}")
        batches = tqdm(batches, total=n_batches, initial=start_batch, bar_format="{l_bar}{bar:10}{r_bar}")
    pending = torch.zeros(4, device=t.device)  # this rank's loss items and finite micro-batches since the last sync
    t0, data_wait, t_ready = time.perf_counter(), 0.0, time.perf_counter()
    for window in accumulation_windows(batches, t.accumulate, n_batches):
        data_wait += time.perf_counter() - t_ready
        first = window[0][0]
        if LOGGER.isEnabledFor(logging.DEBUG):
            for i, b in window:
                LOGGER.debug(f"rank {max(info.rank, 0)} epoch {epoch} batch {i}: {' '.join(Path(f).name for f in b[2])}")
        micro = [(prepare_images(b[0], t, epoch, i), b[1].to(t.device, non_blocking=True)) for i, b in window]
        prepared = [t.compute_loss.prepare(targets, imgs.shape[2:]) for imgs, targets in micro]
        counts = torch.stack([t.compute_loss.counts(p) for p in prepared]).to(t.device)
        save_now = t.save_mid_epoch is not None and first > start_batch and wants_save(t)
        synced = all_reduce_sum(torch.cat((counts.flatten(), pending, torch.tensor([float(save_now)], device=t.device))))
        counts, done = synced[:counts.numel()].view_as(counts), synced[counts.numel():]
        tally.add(done, world)
        pending.zero_()
        if done[4] > 0 and t.save_mid_epoch is not None:
            t.save_mid_epoch(epoch, first, tally)
            t.last_save = time.monotonic()
        iteration = window[-1][0] + n_batches * epoch
        if iteration <= t.n_warmup:
            apply_warmup(t.optimizer, iteration, t.n_warmup, t.schedule(epoch), t.hyp, t.momentum)
        step_items = torch.zeros(3, device=t.device)
        reduce = all_reduce_sum if info.is_distributed else None
        for k, ((imgs, targets), positives, prep) in enumerate(zip(micro, counts, prepared)):
            with gradient_sync(model, k == len(micro) - 1), autocast(t.device, t.precision):
                loss, items = t.compute_loss(model(imgs), targets, LossNorm(positives, imgs.shape[0] * world),
                                             prepared=prep, reduce=reduce)
            if t.opt.quad:  # as YOLOv5: a quad image stands for 4 images of the batch the gradient scale is set for
                loss = loss * 4
            t.scaler.scale(loss * world).backward()  # DDP averages gradients over ranks; the loss sums over them
            step_items += items
            if torch.isfinite(items).all():
                pending += torch.cat((items, items.new_ones(1)))
        if optimizer_step(t):
            t.skipped_in_row = 0
        else:
            tally.skipped_steps += 1
            t.skipped_in_row += 1
            LOGGER.warning(f"WARNING epoch {epoch} batch {window[-1][0]}: non-finite gradients (losses "
                           f"{', '.join(t.compute_loss.item_names)} "
                           f"{', '.join(f'{x:.4g}' for x in step_items.tolist())} on this rank): step skipped")
            if t.skipped_in_row >= MAX_NONFINITE_STEPS:
                raise UserError(f"epoch {epoch} batch {window[-1][0]}: {t.skipped_in_row} optimizer steps in a row had "
                                "non-finite gradients: training diverged (lower lr0, or check the data)")
        t.steps_done += 1
        if info.is_main:
            batches.set_description(progress_line(epoch, t.opt.epochs, t.device, tally.means(), micro))
            if first == 0:
                t.logger.log_batch(window[0][1][0], epoch)
            if plots_dir is not None and first < 3:
                from utils.plots import plot_images

                for (i, b) in window:
                    if i < 3:
                        plot_images(b[0], b[1], b[2], plots_dir / f"train_batch{i}.jpg", de_parallel(model).names)
        t_ready = time.perf_counter()
    tally.add(all_reduce_sum(pending.clone()), world)
    elapsed = time.perf_counter() - t0
    gpu = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if t.device.type == "cuda" else ""
    skipped = f", {tally.skipped_steps} steps skipped (non-finite gradients)" if tally.skipped_steps else ""
    LOGGER.info(f"epoch {epoch}: {(n_batches - start_batch) * t.opt.batch_size / elapsed:.1f} images/s, "
                f"{100 * data_wait / elapsed:.0f}% of the time waiting for data{gpu}{skipped}")
    return tally


def evolve(opt: argparse.Namespace, explicit: set[str], device: torch.device, info: DistInfo) -> Path:
    """--evolve N: train generations until evolve.csv holds N (see utils/evolve.py); returns the folder.

    Each generation is a normal run (validated after its last epoch only, final weights only) in
    ``<folder>/gen<i>``; every rank of a distributed launch trains it together. Rank 0 keeps the record and
    decides each generation's hyper-parameters, drawn from ``(seed, generation)`` and the csv so far.
    """
    if opt.evolve is None:
        raise UserError(f"--resume-evolve {opt.resume_evolve} needs --evolve N, the number of generations in total")
    if opt.evolve < 1:
        raise UserError(f"--evolve {opt.evolve}: give the number of generations, at least 1 (e.g. --evolve 10)")
    if opt.resume:
        raise UserError("--evolve trains new runs and cannot --resume one; continue an evolution with "
                        "--resume-evolve path/to/evolve.csv")
    family = family_of(model_config(opt, None, load_checkpoint(opt.weights) if opt.weights else None))
    base = Hyp.from_yaml(opt.hyp or family.default_hyp_path)
    family.check_hyp(base, opt.hyp or family.default_hyp)
    keys = family.evolve_keys(base)
    loss_names = family.loss_names
    if opt.resume_evolve:
        csv_file = Path(opt.resume_evolve)
        if not csv_file.is_file():
            raise UserError(f"--resume-evolve {csv_file}: file not found")
        folder = csv_file.parent
    else:
        project = Path(opt.project) if "project" in explicit else RUNS / "evolve"
        folder = Path(broadcast_object(str(increment_path(project / opt.name, opt.exist_ok).resolve()), info))
        csv_file = folder / "evolve.csv"
    rows = np.zeros((0, len(result_keys(loss_names)) + len(keys)))
    if info.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        if csv_file.exists():
            rows = read_evolve_csv(csv_file, keys, loss_names)
    rows = broadcast_object(rows, info)
    if len(rows) >= opt.evolve:
        LOGGER.info(f"{csv_file} already holds {len(rows)} generations (--evolve {opt.evolve}): nothing to do")
        return folder
    LOGGER.info(f"Evolving hyper-parameters: generations {len(rows)} to {opt.evolve - 1} in {colorstr(str(folder))}")
    for generation in range(len(rows), opt.evolve):
        hyp = next_hyp(base, rows, keys, np.random.default_rng([opt.seed, generation]), family.evolve_limits)
        hyp = Hyp.from_dict(broadcast_object(hyp.to_dict(), info), f"generation {generation}")
        run_opt = argparse.Namespace(**{**vars(opt), "project": str(folder), "name": f"gen{generation}",
                                        "exist_ok": True, "noval": True, "nosave": True, "noplots": True,
                                        "evolve": None, "resume_evolve": None})
        out = train(run_opt, device, info, None, hyp=hyp)
        if info.is_main:
            append_evolve_row(csv_file, out["results"], hyp, keys, loss_names)
            rows = read_evolve_csv(csv_file, keys, loss_names)  # the rounded values, as a resumed evolution reads
            write_best_hyp(rows, keys, base, folder / "hyp_evolve.yaml")
            LOGGER.info(f"generation {generation}: fitness {float(fitness(np.array(out['results'][:4]))):.5g}; "
                        f"best so far in {folder / 'hyp_evolve.yaml'}")
        rows = broadcast_object(rows, info)
    if info.is_main:  # once at the end: a figure of every hyper-parameter costs seconds
        plot_evolve(rows, keys, folder / "evolve.png")
    LOGGER.info(f"Evolution done: {csv_file}, {folder / 'hyp_evolve.yaml'}, {folder / 'evolve.png'}")
    return folder


# ---- helpers of train() ----------------------------------------------------------------------------------

def check_options(opt: argparse.Namespace, info: DistInfo, resumed: bool) -> None:
    """The flags that cannot train, as one-line UserErrors, before any data is read or folder made.

    A run ``resumed`` on a number of ranks that does not split its global batch keeps the nearest batch that does.
    """
    if opt.epochs < 1 or opt.batch_size < 1:
        raise UserError(f"--epochs {opt.epochs} and --batch-size {opt.batch_size} must be at least 1")
    if opt.time is not None and not opt.time > 0:
        raise UserError(f"--time {opt.time}: give the training time in hours, more than 0 (e.g. --time 0.5)")
    if opt.batch_size % info.world_size and resumed:
        kept = max(opt.batch_size // info.world_size, 1) * info.world_size
        LOGGER.warning(f"WARNING the global batch {opt.batch_size} cannot be split over {info.world_size} ranks: "
                       f"continuing with {kept} from the next epoch boundary")
        opt.batch_size = kept
    for flag in ("image_weights", "quad"):
        if getattr(opt, flag) and opt.rect:
            raise UserError(f"--{flag.replace('_', '-')} needs shuffled square batches: drop --rect")
    if opt.quad and opt.batch_size // info.world_size < 4:
        raise UserError(f"--quad merges 4 images into one: --batch-size {opt.batch_size} must give every rank at "
                        f"least 4 (it gives {opt.batch_size // info.world_size})")
    check_global_batch(opt.batch_size, info.world_size)


def check_data_options(opt: argparse.Namespace, data: dict) -> None:
    """The flags that the form of the training data rules out, as one-line UserErrors, once the data YAML is read."""
    if opt.image_weights and isinstance(data["train"], ShardSet):
        raise UserError(f"--image-weights draws images by index and is not available for tar shards "
                        f"({data['yaml_file']} names shards for 'train'): drop --image-weights or train on image files")


def check_global_batch(batch_size: int, world_size: int) -> None:
    if batch_size % world_size:
        raise UserError(f"--batch-size {batch_size} must be a multiple of WORLD_SIZE {world_size}")


def image_cache(mode: str) -> str | None:
    return None if mode == "off" else mode


def close_mosaic_epoch(epochs: int, close_mosaic: int) -> int | None:
    return max(epochs - close_mosaic, 0) if close_mosaic > 0 else None


def model_config(opt: argparse.Namespace, ckpt: dict | None, source: dict | None) -> dict:
    """The config of the model a run trains: the resumed run's, --cfg (given or the preset's), or the --weights
    checkpoint's."""
    if ckpt:
        return ckpt["model_cfg"]
    return load_model_config(opt.cfg or source["model_cfg"])  # without --weights the preset gave --cfg


def create_model(opt: argparse.Namespace, nc: int, names: list[str], hyp: Hyp, ckpt: dict | None,
                 source: dict | None) -> nn.Module:
    """The resumed model, a new one with the tensors of ``source`` (--weights) that fit, or a new one from --cfg."""
    if ckpt:
        return build_model(ckpt["model_cfg"], weights=ckpt["model"], names=names)
    if source is not None:
        LOGGER.info(f"Starting from {opt.weights}")
        # Anchors come with the weights unless another config or anchor count is asked for (AutoAnchor may refit).
        return build_model(opt.cfg or source["model_cfg"], nc=nc, weights=model_weights(source), transfer=True,
                           keep_anchors=not (opt.cfg or hyp.anchors), anchors=hyp.anchors, names=names)
    return build_model(opt.cfg, nc=nc, anchors=hyp.anchors, names=names)


def resume_search(opt: argparse.Namespace, explicit: set[str]) -> list[Path]:
    """Where ``--resume`` without a path looks for the newest last.pt: --project, and by default also the folder
    beside train.py where runs were written before they went under the current directory."""
    if "project" in explicit:
        return [Path(opt.project)]
    return [Path(opt.project), ROOT / "runs/train"]


def run_folder(opt: argparse.Namespace, info: DistInfo, hyp: Hyp) -> Path:
    """The run's folder: a resumed run keeps its own; rank 0 makes a new one and writes the options into it."""
    restarted = (run_folder_of(info.run_id, opt.project, info.launcher_started)
                 if info.restart_count > 0 and info.is_main else None)
    if opt.resume:
        save_dir = Path(opt.save_dir)
    elif restarted is not None:  # the launcher restarted the group before the run's first checkpoint
        save_dir = restarted
    else:
        save_dir = increment_path(Path(opt.project) / opt.name, opt.exist_ok)
    # Rank 0's absolute path: every node (and a later resume) finds the folder whatever its working directory.
    save_dir = Path(broadcast_object(str(save_dir.resolve()), info))
    opt.save_dir = str(save_dir)
    if info.is_main:
        (save_dir / "weights").mkdir(parents=True, exist_ok=True)
        import yaml

        options = {k: v for k, v in vars(opt).items() if k != "argv"}
        (save_dir / "opt.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
        hyp.to_yaml(save_dir / "hyp.yaml")
        if info.run_id:  # launcher restarts find the folder by it
            (save_dir / "run_id").write_text(info.run_id)
        LOGGER.info(colorstr("hyperparameters: ") + ", ".join(f"{k}={v}" for k, v in hyp.to_dict().items()))
    return save_dir


def resumed_position(ckpt: dict, opt: argparse.Namespace, hyp: Hyp,
                     info: DistInfo) -> tuple[LrSchedule, int, int, LossTally]:
    """Where a resumed run goes on (epoch, batch, the epoch's losses so far) and its learning-rate schedule."""
    saved_opt = ckpt["opt"]
    schedule = LrSchedule(ckpt.get("lr_schedule") or [[0, saved_opt["epochs"], 1.0, hyp.lrf]], opt.cos_lr)
    mid = ckpt.get("mid_epoch")
    start_epoch, start_batch, tally = int(ckpt["epoch"]) + 1, 0, LossTally()
    if mid:
        start_epoch = int(mid["epoch"])
        if opt.batch_size == saved_opt["batch_size"]:  # the same global batches, whatever the number of ranks
            start_batch = int(mid["batch"])
            tally = LossTally(np.array(mid["sums"]), float(mid["micro_batches"]), int(mid["skipped_steps"]))
        else:
            start_epoch += 1
            LOGGER.warning(f"WARNING the global batch changed: epoch {start_epoch - 1} is not finished, training "
                           f"goes on from the next epoch boundary ({start_epoch})")
    if opt.epochs != saved_opt["epochs"]:
        schedule = schedule.extended(start_epoch, opt.epochs, hyp.lrf)
        LOGGER.info(f"--epochs {opt.epochs} (was {saved_opt['epochs']}): the learning rate goes on from "
                    f"{schedule(start_epoch):.4g} x lr0 to {hyp.lrf} x lr0 at epoch {opt.epochs - 1}")
    where = f"batch {start_batch} of epoch {start_epoch}" if start_batch else f"epoch {start_epoch}"
    LOGGER.info(f"Resuming training at {where}")
    return schedule, start_epoch, start_batch, tally


def fit_to_time(opt: argparse.Namespace, epoch: int, start_epoch: int, elapsed: float, epoch_seconds: float) -> dict:
    """--time: after the first epoch, the number of epochs that fit the budget; a stop when it is spent."""
    budget = opt.time * 3600
    if elapsed + epoch_seconds > budget:
        LOGGER.info(f"--time {opt.time} h: the budget is spent after epoch {epoch}")
        return {"stop": True}
    if epoch != start_epoch:
        return {}
    epochs = max(epoch + 2, int(budget / epoch_seconds))
    LOGGER.info(f"--time {opt.time} h: an epoch takes {epoch_seconds:.1f} s, so {epochs} epochs; the learning-rate "
                f"schedule and close-mosaic ({opt.close_mosaic} last epochs) are fitted to that")
    return {"epochs": epochs}


def refit_schedule(t: Training, scheduler, loader, opt: argparse.Namespace, epochs: int) -> None:
    """Apply a new run length (--time): learning-rate schedule and the close-mosaic epoch."""
    opt.epochs = epochs
    t.schedule = LrSchedule.for_run(epochs, t.hyp.lrf, opt.cos_lr)
    scheduler.lr_lambdas = [t.schedule] * len(scheduler.lr_lambdas)
    for group, base_lr in zip(t.optimizer.param_groups, scheduler.base_lrs):  # the next epoch's, already set
        group["lr"] = base_lr * t.schedule(scheduler.last_epoch)
    loader.update_dataset(close_mosaic_epoch=close_mosaic_epoch(epochs, opt.close_mosaic))


def freeze_layers(model: nn.Module, freeze: list[int]) -> None:
    """--freeze: stop training the listed layers. Parameters a model keeps fixed itself (the DFL head's bins) stay
    fixed: trainable, they would get no gradient, and DDP stops at a parameter that takes no part in the loss."""
    layers = [f"model.{x}." for x in (freeze if len(freeze) > 1 else range(freeze[0]))]
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in layers):
            p.requires_grad = False
            LOGGER.debug(f"freezing {name}")


def accumulation_windows(batches, accumulate: int, n_batches: int):
    """Consecutive groups of ``(index, batch)`` that make one optimizer step each: ``accumulate`` batches, the
    last of an epoch possibly fewer. Windows start at multiples of ``accumulate``, so a resumed epoch lines up."""
    window = []
    for i, batch in batches:
        window.append((i, batch))
        if (i + 1) % accumulate == 0 or i == n_batches - 1:
            yield window
            window = []


def prepare_images(imgs: torch.Tensor, t: Training, epoch: int, batch_index: int) -> torch.Tensor:
    """uint8 batch -> float [0, 1] on the device, resized for --multi-scale by a (seed, epoch, batch) draw."""
    imgs = imgs.to(t.device, non_blocking=True).contiguous(memory_format=torch.channels_last).float() / 255
    if t.opt.multi_scale:
        rng = np.random.default_rng([t.opt.seed, epoch, batch_index, 1])
        size = int(rng.uniform(t.opt.imgsz * 0.5, t.opt.imgsz * 1.5 + t.grid)) // t.grid * t.grid
        factor = size / max(imgs.shape[2:])
        if factor != 1:
            new_shape = [math.ceil(x * factor / t.grid) * t.grid for x in imgs.shape[2:]]
            imgs = F.interpolate(imgs, size=new_shape, mode="bilinear", align_corners=False)
    return imgs


def wants_save(t: Training) -> bool:
    """Rank 0's wish for a checkpoint now: every --save-steps steps, or --save-minutes after the last save."""
    by_steps = t.opt.save_steps > 0 and t.steps_done > 0 and t.steps_done % t.opt.save_steps == 0
    by_time = t.opt.save_minutes > 0 and time.monotonic() - t.last_save >= t.opt.save_minutes * 60
    return by_steps or by_time


def gradient_sync(model: nn.Module, step_now: bool) -> contextlib.AbstractContextManager:
    """Under DDP, all-reduce gradients only on the micro-batch that ends an accumulation window."""
    return model.no_sync() if isinstance(model, DDP) and not step_now else contextlib.nullcontext()


def optimizer_step(t: Training) -> bool:
    """Clip, step, update the EMA; False (and no step) when the gradients are not finite.

    The gradients are all-reduced, so every rank makes the same decision. With a gradient scaler (fp16) the
    scaler skips overflowing steps itself, as it should early in training; those are not counted.
    """
    t.scaler.unscale_(t.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm=10.0)
    finite = t.scaler.is_enabled() or bool(torch.isfinite(norm))
    if finite:
        t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad()
    if finite and t.ema is not None:
        t.ema.update(t.model)
    return finite


def check_same_draw(info: DistInfo, draw: list[int], epoch: int, device: torch.device) -> None:
    """--image-weights under DDP: stop when the ranks' global draws of ``epoch`` differ (their shards would overlap)."""
    if not info.is_distributed:
        return
    digest = draw_digest(np.array(draw))
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    with collective("all_reduce"):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the largest and (negated) the smallest digest
    if int(extremes[0]) != -int(extremes[1]):
        raise RuntimeError(f"--image-weights: the ranks drew different image lists for epoch {epoch}")
    LOGGER.info(f"image weights: epoch {epoch} draw {digest:08x} is the same on all {info.world_size} ranks")


def progress_line(epoch: int, epochs: int, device: torch.device, mean_loss: np.ndarray, micro: list) -> str:
    mem = f"{torch.cuda.memory_reserved() / 1e9:.3g}G" if device.type == "cuda" else "0G"
    losses = "".join(f"{x:>11.4g}" for x in mean_loss.tolist())
    imgs, targets = micro[-1]
    return f"{f'{epoch}/{epochs - 1}':>11}{mem:>11}{losses}{targets.shape[0]:>11}{imgs.shape[-1]:>11}"


if __name__ == "__main__":
    sys.exit(main())
