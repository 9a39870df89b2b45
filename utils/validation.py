"""Validation of a model in memory, as training calls it every epoch: ``validate(model, loader, ...)``.

A thin layer over the predictor and the evaluator (``utils/evaluation``): the model becomes a runner, the runner's
detections are matched with the labels, and the outputs are written. val.py builds the same pieces for any
weights file.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from models.families import Family, family_of
from utils.evaluation.evaluator import DetectionEvaluator, ValResults
from utils.evaluation.loop import evaluate
from utils.evaluation.outputs import OutputOptions, ValOutputs
from utils.evaluation.predictor import PredictOptions, Predictor
from utils.formats.metadata import ModelMeta
from utils.formats.pytorch import PytorchRunner

__all__ = [
    "CONF_THRES",
    "MAX_DET",
    "OutputOptions",
    "PredictOptions",
    "ValOptions",
    "ValResults",
    "tta_comparison",
    "validate",
]

# The mAP sweep's thresholds: the defaults of both validate() (train.py's epochs) and the command line. The NMS
# IoU threshold is the model family's.
CONF_THRES, MAX_DET = 0.001, 300


@dataclass
class ValOptions:
    """``validate``'s options. ``predict``: how predictions become detections (at the mAP sweep's thresholds by
    default; NMS at the family's IoU threshold unless ``iou_thres`` is given; always multi-label, and class-agnostic
    with ``single_cls``). ``half`` (CUDA only) runs an fp32 model under fp16 autocast, so the caller's weights (such
    as training's EMA) are never converted; a model already in fp16 gets fp16 images; otherwise
    ``predict.autocast_dtype`` (e.g. bf16 on a CPU, as training uses) applies; NMS and metrics stay in fp32.
    ``family`` decodes the predictions: the model's own by default, and it must be given for anything but a
    ``Model``. ``compute_loss`` (a ``models/loss.py: DetectionLoss``) adds the mean of each of its terms
    (``item_names``) to the results. ``outputs``: what is written and printed. ``gather``: distributed, every rank
    passes a loader over its own part of the split; see the evaluator."""

    names: Sequence[str]
    device: torch.device | str
    compute_loss: Any = None
    family: Any = None
    predict: PredictOptions = field(default_factory=lambda: PredictOptions(conf_thres=CONF_THRES, max_det=MAX_DET))
    single_cls: bool = False
    half: bool = False
    outputs: OutputOptions = field(default_factory=OutputOptions)
    gather: bool = False


def without_cudnn_benchmark(fn: Callable[..., ValResults]) -> Callable[..., ValResults]:
    """Run ``fn`` with cuDNN's benchmark off, then restore the caller's setting.

    Training keeps the benchmark: one input shape, timed once, then every step runs the fastest kernels. Rectangular
    validation batches come in many shapes, and the benchmark times each new one again, at a higher cost than
    cuDNN's heuristic choice and for no faster inference (docs/benchmarks.md, "cuDNN benchmark on and off").
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> ValResults:
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = False
        try:
            return fn(*args, **kwargs)
        finally:
            torch.backends.cudnn.benchmark = before

    return wrapper


def module_runner(model: torch.nn.Module, names: Sequence[str], device: torch.device, family: Family) -> PytorchRunner:
    """A model in memory as a runner. A ``Model`` with BatchNorm is validated as a copy with each BatchNorm folded
    into its convolution, as val.py's loaded weights are: one op less per layer. A copy, since the caller's model
    (training's EMA) trains on."""
    from models.yolo import Model

    model.eval()
    if isinstance(model, Model) and any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()):
        model = copy.deepcopy(model).fuse()
    strides = getattr(model, "stride", None)
    stride = int(strides.max()) if isinstance(strides, torch.Tensor) else 32
    try:
        layout = family.layout(model)
    except (AttributeError, TypeError, IndexError):  # not a detector of this project (a test's stand-in)
        layout = family.layouts[0]
    meta = ModelMeta(names=list(names), stride=stride, kind="pytorch", family=family.name, layout=layout)
    return PytorchRunner(model, meta, device)


def _family(model: torch.nn.Module, family: Any) -> Family:
    from models.yolo import Model

    if family is None:
        if not isinstance(model, Model):
            raise ValueError(f"validate: {type(model).__name__} is not a Model of this project: pass its family")
        return family_of(model)
    return family_of(family)


@without_cudnn_benchmark
@torch.no_grad()
def validate(model: torch.nn.Module, dataloader: Any, options: ValOptions | None = None, **fields: Any) -> ValResults:
    """Run ``model`` over ``dataloader`` (letterboxed batches with shapes entries) and measure it; the options are
    one ``ValOptions``, or its fields given as keywords. The model is put in eval mode and left there."""
    o = options if options is not None else ValOptions(**fields)
    device = torch.device(o.device)
    family = _family(model, o.family)
    runner = module_runner(model, o.names, device, family)
    first_weight = next(runner.model.parameters(), None)
    fp16_weights = first_weight is not None and first_weight.dtype == torch.float16
    autocast = o.predict.autocast_dtype
    if o.half and device.type == "cuda" and not fp16_weights:
        autocast = torch.float16
    # The mAP sweep: every class above the threshold of a box counts (multi-label).
    predict = replace(o.predict, multi_label=True, agnostic=o.single_cls, autocast_dtype=autocast)
    predictor = Predictor(runner, family, predict)
    json_ids = None
    if o.outputs.save_json:
        from utils.coco_json import json_identities

        names = list(o.names) if not o.single_cls or len(o.names) == 1 else ["item"]
        json_ids = json_identities(getattr(dataloader, "dataset", None), names)
    loss_terms = len(o.compute_loss.item_names) if o.compute_loss is not None else 0
    # Every rank counts its images into the confusion matrix (summed by the gather); only the main rank plots it.
    evaluator = DetectionEvaluator(
        o.names, single_cls=o.single_cls, confusion=o.outputs.plots, json_ids=json_ids, loss_terms=loss_terms
    )
    outputs = ValOutputs(o.outputs, evaluator.names)
    return evaluate(predictor, dataloader, evaluator, outputs, o.compute_loss, o.gather)


def tta_comparison(plain: ValResults, augmented: ValResults) -> str:
    """One line: mAP and time per image of the --augment pass beside the plain one."""
    t_plain, t_aug = sum(plain.speed), sum(augmented.speed)
    factor = t_aug / t_plain if t_plain > 0 else float("nan")
    return (
        f"--augment: mAP50 {augmented.map50:.4f} (plain {plain.map50:.4f}, {augmented.map50 - plain.map50:+.4f}), "
        f"mAP50-95 {augmented.map:.4f} (plain {plain.map:.4f}, {augmented.map - plain.map:+.4f}); "
        f"{t_aug:.1f} ms per image (plain {t_plain:.1f} ms, x{factor:.2f})"
    )
