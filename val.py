"""Validate a detector on a dataset split: P, R, mAP50, mAP50-95 per class, speed, plots, COCO JSON.

Usage:
    python val.py --data data/shapes.yaml --weights runs/train/exp/weights/best.pt --imgsz 640

This is the command line: any weights file or export runs through the predictor and the evaluator
(utils/evaluation), the same ones training's ``utils.validation.validate`` and export.py's accuracy gate use.
"""

from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import sys
from pathlib import Path
from typing import Any

from models.families import titles_by
from utils.cli import (
    INFERENCE_IMGSZ_HELP,
    add_allow_pipe,
    add_device,
    add_end2end,
    add_half,
    add_imgsz,
    add_max_pixels,
    add_run_folder,
    add_workers,
    apply_data_limits,
    make_parser,
    positive_int,
)
from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, colorstr, setup_logging
from utils.process import setup_process
from utils.run_dir import increment_path
from utils.storage import is_url, local_copy
from utils.torch_utils import local_ranks_share_a_gpu, select_device
from utils.validation import CONF_THRES, MAX_DET, ValResults, tta_comparison

TASKS = ("val", "test", "speed")


# ---- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """val.py's options and their defaults (the only place they are declared; ``run`` takes the same names)."""
    parser = make_parser("Validate a detector checkpoint on a dataset split")
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=str, required=True, help="dataset YAML")
    data.add_argument("--task", default="val", choices=TASKS, help="split to use; speed: timing at conf 0.25")
    add_imgsz(data, help=INFERENCE_IMGSZ_HELP)
    data.add_argument("--batch-size", type=positive_int, default=32, help="images per forward pass")
    data.add_argument("--single-cls", action="store_true", help="treat every class as one")
    add_workers(data)
    add_allow_pipe(data)
    add_max_pixels(data)
    model = parser.add_argument_group("model and inference")
    model.add_argument(
        "--weights",
        type=str,
        required=True,
        help="checkpoint (.pt: this project's, YOLOv5's or Ultralytics'), or a file or folder export.py "
        "wrote (.onnx, .torchscript, ...); a DETR's official .pth or Hugging Face folder",
    )
    model.add_argument("--conf-thres", type=float, default=CONF_THRES, help="confidence threshold")
    model.add_argument(
        "--iou-thres",
        type=float,
        default=None,
        help=f"NMS IoU threshold (default: the model family's, {titles_by(lambda f: f.val_iou)})",
    )
    model.add_argument("--max-det", type=int, default=MAX_DET, help="detections kept per image")
    model.add_argument(
        "--augment",
        action="store_true",
        help="test-time augmentation (scales and flips); also runs and reports the plain pass",
    )
    add_end2end(model)
    add_half(model)
    add_device(model)
    output = parser.add_argument_group("output")
    add_run_folder(output, "val")
    output.add_argument("--verbose", action="store_true", help="a row per class")
    output.add_argument("--save-txt", action="store_true", help="predictions as YOLO label files")
    output.add_argument("--save-conf", action="store_true", help="with --save-txt: add the confidence")
    output.add_argument("--save-json", action="store_true", help="COCO results JSON (and COCOeval)")
    output.add_argument("--noplots", action="store_true", help="write no plots")
    return parser


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(**options: Any) -> ValResults:
    """``python val.py`` from Python: the same option names (``batch_size``, ``conf_thres``, ...) and defaults."""
    defaults = vars(build_parser().parse_args(["--data", "", "--weights", ""]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"run() got unknown option(s): {', '.join(unknown)}")
    return run_options(argparse.Namespace(**{**defaults, **options}))


def run_options(opt: argparse.Namespace) -> ValResults:
    """Load a model (any format) and a dataset split, validate, and save the outputs in a new run folder."""
    apply_data_limits(opt)
    from utils.data.config import load_data_config
    from utils.distributed import dist_info, init_process_group
    from utils.evaluation.predictor import open_for_prediction, threads_for

    if opt.task not in TASKS:
        raise UserError(f"--task {opt.task!r}: expected one of {', '.join(TASKS)}")
    info = dist_info()  # under torch.distributed.run every rank validates its part of the split
    device = select_device(opt.device, local_rank=info.local_rank, local_world_size=info.local_world_size)
    if info.is_distributed:
        init_process_group(device, info, shared_gpu=local_ranks_share_a_gpu(opt.device, info.local_world_size))
    data_cfg = load_data_config(opt.data)
    split = "test" if opt.task == "test" else "val"
    if not data_cfg.get(split):
        raise UserError(f"{data_cfg.get('yaml_file', opt.data)}: no '{split}' split to validate on")
    with local_copy(opt.weights) as weights:  # a URL (s3://, gs://) is downloaded through the storage seam
        runner = open_for_prediction(weights, device, end2end=opt.end2end, augment=opt.augment, half=opt.half)
    nc = int(data_cfg["nc"])
    if not opt.single_cls and runner.meta.nc != nc:
        raise UserError(
            f"{opt.weights}: the model predicts {runner.meta.nc} classes but {opt.data} has {nc}; "
            "use matching weights or --single-cls"
        )
    imgsz, batch_size, rect = input_size(opt, runner.meta)
    loader, save_dir = _loader_and_folder(opt, data_cfg, split, info, (imgsz, batch_size, rect), runner.meta.stride)
    if device.type == "cuda":  # the first CUDA call pays for context and kernel set-up: keep it out of the timings
        runner.warmup((imgsz, imgsz))
    with threads_for(runner):
        results = _passes(opt, runner, loader, data_cfg, split, save_dir, info)
    LOGGER.info(f"Results saved to {colorstr(str(save_dir))}")
    return results


def _passes(
    opt: argparse.Namespace, runner: Any, loader: Any, data_cfg: dict, split: str, save_dir: Path, info: Any
) -> ValResults:
    """The validation pass; with --augment the plain pass first, on the same loader, for the comparison."""
    plain = None
    if opt.augment:
        LOGGER.info("Plain pass (for comparison with --augment):")
        plain = _validate(
            opt,
            runner,
            loader,
            data_cfg,
            split,
            save_dir=None,
            augment=False,
            gather=info.is_distributed,
            main=info.is_main,
        )
        LOGGER.info("Test-time augmentation pass:")
    results = _validate(
        opt,
        runner,
        loader,
        data_cfg,
        split,
        save_dir=save_dir,
        augment=opt.augment,
        gather=info.is_distributed,
        main=info.is_main,
    )
    if plain is not None:
        results.plain = plain
        LOGGER.info(tta_comparison(plain, results))
    return results


def input_size(opt: argparse.Namespace, meta: Any) -> tuple[int, int, bool]:
    """(image size, batch size, rectangular batches): the size by the one policy (``inference_imgsz``); an exported
    file takes one input shape, which val.py's square letterboxes need square."""
    from utils.formats.metadata import inference_imgsz

    h, w = inference_imgsz(meta, opt.imgsz, opt.weights)
    if h != w:
        raise UserError(
            f"{opt.weights}: exported for {h}x{w} input; val.py needs a square one (export with a single --imgsz)"
        )
    # A file fixed to one shape takes no rectangular batches; fixed to a batch size, it runs any loader batch, that
    # many at a time.
    return h, opt.batch_size, meta.imgsz is None


def _loader_and_folder(
    opt: argparse.Namespace, data_cfg: dict, split: str, info: Any, shape: tuple[int, int, bool], stride: int
) -> tuple[Any, Path]:
    """This rank's loader over the split, and the run folder (named by rank 0)."""
    from utils.data.loader import create_dataloader, load_labels
    from utils.distributed import broadcast_object
    from utils.torch_utils import torch_distributed_zero_first

    imgsz, batch_size, rect = shape
    if is_url(opt.project):  # only train.py's run folder may be a URL
        raise UserError(f"--project {opt.project}: val.py writes its outputs to a local folder")
    save_dir = increment_path(Path(opt.project) / opt.name, exist_ok=opt.exist_ok, mkdir=True) if info.is_main else None
    save_dir = Path(broadcast_object(str(save_dir), info))  # one run folder, named by rank 0
    nc = int(data_cfg["nc"])
    with torch_distributed_zero_first(info.local_rank):  # local rank 0 builds label caches and shard indexes
        labels = load_labels(
            data_cfg[split], nc=nc, workers=opt.workers, prefix=colorstr(f"{split}: "), verbose=info.is_local_main
        )
    loader, _ = create_dataloader(
        None,
        imgsz,
        batch_size,
        stride,
        augment=False,
        rect=rect,
        pad=0.5 if rect else 0.0,
        world_size=info.world_size,
        global_rank=max(info.rank, 0),
        workers=opt.workers,
        single_cls=opt.single_cls,
        nc=nc,
        prefix=colorstr(f"{split}: "),
        label_set=labels,
    )
    return loader, save_dir


def _validate(
    opt: argparse.Namespace,
    runner: Any,
    loader: Any,
    data_cfg: dict,
    split: str,
    save_dir: Path | None,
    augment: bool,
    gather: bool,
    main: bool,
) -> ValResults:
    """One pass over the loader: the predictor at val.py's thresholds, the evaluator, and (with ``save_dir``) the
    outputs."""
    from models.families import family_of
    from utils.coco_json import json_identities
    from utils.evaluation.evaluator import DetectionEvaluator
    from utils.evaluation.loop import evaluate
    from utils.evaluation.outputs import OutputOptions, ValOutputs
    from utils.evaluation.predictor import PredictOptions, Predictor

    conf_thres, iou_thres, save_json = opt.conf_thres, opt.iou_thres, opt.save_json and save_dir is not None
    if opt.task == "speed":  # timing at deployment thresholds, not the mAP sweep
        conf_thres, iou_thres, save_json = 0.25, 0.45, False
    options = PredictOptions(
        conf_thres=conf_thres,
        iou_thres=iou_thres,
        max_det=opt.max_det,
        multi_label=True,
        agnostic=opt.single_cls,
        augment=augment,
    )
    predictor = Predictor(runner, family_of(runner.meta.family), options)
    evaluator = DetectionEvaluator(
        data_cfg["names"],
        single_cls=opt.single_cls,
        confusion=not opt.noplots,  # on every rank: synchronize sums it
    )
    if save_json:
        evaluator.json_ids = json_identities(loader.dataset, evaluator.names)
    outputs = (
        OutputOptions(save_dir=save_dir, main=main)
        if save_dir is None
        else OutputOptions(
            save_dir=save_dir,
            plots=not opt.noplots,
            verbose=opt.verbose,
            save_json=save_json,
            save_txt=opt.save_txt,
            save_conf=opt.save_conf,
            annotations_json=data_cfg.get("annotations") if split == "val" else None,
            main=main,
        )
    )
    return evaluate(predictor, loader, evaluator, ValOutputs(outputs, evaluator.names), gather=gather)


def main(argv: list[str] | None = None) -> int:
    from utils.distributed import destroy_process_group, dist_info, end_with_launcher

    opt = parse_opt(argv)
    info = dist_info()
    end_with_launcher(info)
    setup_logging(info.rank)
    LOGGER.info(setup_process(opt.device))
    try:
        return run_reporting_errors(lambda: run_options(opt) and None)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
