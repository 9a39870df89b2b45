"""Model families: what differs between YOLOv5 (anchor-based) and the anchor-free detectors, in one place.

A family decides its loss and target assignment, how its predictions become detections (NMS and its IoU
threshold), its default hyper-parameters and the ranges ``--evolve`` explores, the names of its three loss
terms (results.csv, the log, TensorBoard) and whether AutoAnchor applies. train.py, val.py, detect.py and
export.py ask the family of their model (``family_of``) and never branch on its name; adding a family means
its blocks, its YAMLs and one entry in ``FAMILIES``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from utils.anchor_free_loss import AnchorFreeLoss, End2EndLoss
from utils.autoanchor import check_anchors
from utils.distributed import de_parallel
from utils.errors import UserError
from utils.hyp import ANCHOR_FREE_EVOLVE_LIMITS, EVOLVE_LIMITS, Hyp, Limit
from utils.log import LOGGER
from utils.loss import ComputeLoss, DetectionLoss
from utils.nms import end_to_end_detections, non_max_suppression, non_max_suppression_anchor_free

ROOT = Path(__file__).resolve().parents[1]


def family_name(cfg: Mapping[str, Any]) -> str:
    """The family of a model config (ours or Ultralytics' YAML form): 'yolov5', 'yolov8', 'yolo11' or 'yolo26'.

    Anchors make it YOLOv5; an end-to-end head or a head without DFL (reg_max 1) YOLO26; C3k2 blocks YOLO11.
    """
    if "anchors" in cfg:
        return "yolov5"
    if cfg.get("end2end") or cfg.get("reg_max") == 1:
        return "yolo26"
    layers = list(cfg.get("backbone") or []) + list(cfg.get("head") or [])
    if any(len(row) > 2 and row[2] == "C3k2" for row in layers):
        return "yolo11"
    return "yolov8"


def yolov5_loss(model: nn.Module, hyp: Hyp, imgsz: int, label_smoothing: float) -> DetectionLoss:
    """YOLOv5's loss, its gains scaled to the number of levels, classes and the image size (hyp values are for
    3 levels, 80 classes and 640 pixels), as YOLOv5's trainer scales them."""
    detect = de_parallel(model).model[-1]
    scaled = hyp.replace(box=hyp.box * 3 / detect.nl, cls=hyp.cls * detect.nc / 80 * 3 / detect.nl,
                         obj=hyp.obj * (imgsz / 640) ** 2 * 3 / detect.nl)
    return ComputeLoss(model, scaled, label_smoothing)


def anchor_free_loss(model: nn.Module, hyp: Hyp, imgsz: int, label_smoothing: float) -> DetectionLoss:
    """YOLOv8 / YOLO11: task-aligned assignment, CIoU, BCE and DFL at the hyp file's gains, used as given (their
    loss is normalised by the target scores, whatever the image size or number of classes)."""
    return AnchorFreeLoss(model, hyp, label_smoothing=label_smoothing)


def end_to_end_loss(model: nn.Module, hyp: Hyp, imgsz: int, label_smoothing: float) -> DetectionLoss:
    """YOLO26: both heads, the one-to-one head's weight rising over the epochs (``set_epoch``)."""
    return End2EndLoss(model, hyp, label_smoothing=label_smoothing)


def yolov5_detections(pred: torch.Tensor, conf_thres: float, iou_thres: float, **options: Any) -> list[torch.Tensor]:
    return non_max_suppression(pred, conf_thres, iou_thres, **options)


def anchor_free_detections(pred: torch.Tensor, conf_thres: float, iou_thres: float, *, classes: list[int] | None,
                           agnostic: bool, multi_label: bool, max_det: int) -> list[torch.Tensor]:
    """NMS of the (B, 4 + nc, A) layout; an end-to-end head's (B, max_det, 6) output (YOLO26 with
    ``end2end_output``) is already final and only filtered. The two never have the same shape: A, the anchor
    count of three levels, is never 6."""
    if isinstance(pred, (list, tuple)):
        pred = pred[0]
    if pred.shape[-1] == 6:
        return end_to_end_detections(pred, conf_thres, classes=classes, max_det=max_det)
    return non_max_suppression_anchor_free(pred, conf_thres, iou_thres, classes=classes, agnostic=agnostic,
                                           multi_label=multi_label, max_det=max_det)


@dataclass(frozen=True)
class Family:
    """One model family's choices. ``loss_names`` name the three items its loss returns."""

    name: str
    anchor_based: bool
    loss_names: tuple[str, str, str]
    default_hyp: str  # relative to the repository root
    nms_iou: float  # NMS IoU threshold of validation (the mAP sweep)
    evolve_limits: Mapping[str, Limit]
    build_loss: Callable[[nn.Module, Hyp, int, float], DetectionLoss]
    nms: Callable[..., list[torch.Tensor]]
    # The automatic optimizer's AdamW learning rate for short runs is this / (4 + nc) (see utils/optimizer.py). Every
    # family keeps the value measured for YOLOv5; Ultralytics' own rule (0.01 / (4 + nc)) is not measured against it.
    adamw_lr_per_class_term: float = 0.05

    @property
    def default_hyp_path(self) -> Path:
        return ROOT / self.default_hyp

    def make_loss(self, model: nn.Module, hyp: Hyp, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        return self.build_loss(model, hyp, imgsz, label_smoothing)

    def detections(self, pred: torch.Tensor, conf_thres: float, iou_thres: float, *, classes: list[int] | None = None,
                   agnostic: bool = False, multi_label: bool = False, max_det: int = 300) -> list[torch.Tensor]:
        """Per image (n, 6) = x1 y1 x2 y2 conf cls, best first, from the model's decoded predictions."""
        return self.nms(pred, conf_thres, iou_thres, classes=classes, agnostic=agnostic, multi_label=multi_label,
                        max_det=max_det)

    def check_hyp(self, hyp: Hyp, source: str) -> None:
        """A one-line error when ``hyp`` is another family's (its box gain is on another scale)."""
        if self.anchor_based and hyp.dfl is not None:
            raise UserError(f"{source}: 'dfl' is a loss gain of the anchor-free families; {self.name} has none (its "
                            f"hyper-parameters: {self.default_hyp})")
        if not self.anchor_based and hyp.dfl is None:
            raise UserError(f"{source}: no 'dfl' gain: not hyper-parameters of {self.name} (anchor-free, box gain "
                            f"~7.5); use {self.default_hyp}")

    def fit_anchors(self, dataset: Any, model: nn.Module, *, thr: float, imgsz: int) -> None:
        """AutoAnchor for anchor-based families; a note for the others."""
        if self.anchor_based:
            check_anchors(dataset, model, thr=thr, imgsz=imgsz)
        else:
            LOGGER.info(f"AutoAnchor does not apply: {self.name} is anchor-free")

    def evolve_keys(self, base: Hyp) -> list[str]:
        """The hyper-parameters an evolve.csv row holds: those of ``base`` with a value that this family uses."""
        return [k for k in base.to_dict() if k in self.evolve_limits]


YOLOV5 = Family(name="yolov5", anchor_based=True, loss_names=("box", "obj", "cls"),
                default_hyp="data/hyps/hyp.scratch-low.yaml", nms_iou=0.6, evolve_limits=EVOLVE_LIMITS,
                build_loss=yolov5_loss, nms=yolov5_detections)
# NMS IoU 0.7: the threshold Ultralytics validates these families at.
_ANCHOR_FREE = dict(anchor_based=False, default_hyp="data/hyps/hyp.anchor-free.yaml", nms_iou=0.7,
                    evolve_limits=ANCHOR_FREE_EVOLVE_LIMITS, nms=anchor_free_detections)
YOLOV8 = Family(name="yolov8", loss_names=("box", "cls", "dfl"), build_loss=anchor_free_loss, **_ANCHOR_FREE)
YOLO11 = Family(name="yolo11", loss_names=("box", "cls", "dfl"), build_loss=anchor_free_loss, **_ANCHOR_FREE)
YOLO26 = Family(name="yolo26", loss_names=("box", "cls", "l1"), build_loss=end_to_end_loss, **_ANCHOR_FREE)

FAMILIES: dict[str, Family] = {f.name: f for f in (YOLOV5, YOLOV8, YOLO11, YOLO26)}


def family_of(model_or_cfg: nn.Module | Mapping[str, Any] | str | Family) -> Family:
    """The family of a model (DDP-wrapped or not), a model config, or a family name."""
    if isinstance(model_or_cfg, Family):
        return model_or_cfg
    if isinstance(model_or_cfg, nn.Module):
        cfg = getattr(de_parallel(model_or_cfg), "yaml", None)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{type(model_or_cfg).__name__} has no model config: its family is unknown")
        name = family_name(cfg)
    elif isinstance(model_or_cfg, Mapping):
        name = family_name(model_or_cfg)
    else:
        name = str(model_or_cfg)
    if name not in FAMILIES:
        raise UserError(f"model family {name!r} is not supported here (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]
