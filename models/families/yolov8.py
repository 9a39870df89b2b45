"""YOLOv8 and YOLO11: the anchor-free head with a DFL box branch, task-aligned assignment, Ultralytics' checkpoints.

The two differ in their blocks only (YOLO11: C3k2 and C2PSA, and a depthwise class branch in the head, which the
head derives from the blocks). :class:`AnchorFreeFamily` holds what every anchor-free family here shares (YOLO26
and YOLO12 derive from it too): the hyper-parameter record, the loss, NMS at IoU 0.7, Ultralytics' importer.
Output layout ``"anchor_free"``: (B, 4 + nc, A) = box centre x, y, width, height in input pixels, then the sigmoid
class scores, as Ultralytics' models and exports give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from models.anchor_free import AnchorFreeDetect
from models.anchor_free_loss import AnchorFreeLoss
from models.families.base import Family, Int8Scope, block_names, head_name, head_of, prediction_convs
from models.families.ultralytics_import import ULTRALYTICS_IMPORTER
from models.loss import DetectionLoss
from utils.hyp import AugmentationHyp, HypRecord, Limit, OptimisationHyp, evolve_limits_of
from utils.nms import end_to_end_detections, non_max_suppression_anchor_free

# The loss terms of YOLOv5 that records written with one record for every family carry (an anchor-free run's
# checkpoint holds them at YOLOv5's defaults): read and dropped, never used.
_YOLOV5_TERMS = ("cls_pw", "obj", "obj_pw", "anchor_t", "anchors", "fl_gamma")


@dataclass(frozen=True)
class AnchorFreeLossGains(HypRecord):
    box: float = 7.5  # CIoU box loss gain
    cls: float = 0.5  # classification (BCE on task-aligned soft targets) loss gain
    dfl: float = 1.5  # distribution focal loss gain (YOLO26: the L1 distance loss)


@dataclass(frozen=True)
class AnchorFreeHyp(AugmentationHyp, AnchorFreeLossGains, OptimisationHyp):
    """The anchor-free families' hyper-parameters: the keys of ``data/hyps/hyp.anchor-free.yaml`` (Ultralytics'
    defaults), with its values as defaults. A file must set ``dfl``: that is what tells it from YOLOv5's."""

    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        **HypRecord.IGNORED_KEYS,
        **dict.fromkeys(_YOLOV5_TERMS, "a YOLOv5 loss term; anchor-free families have none"),
    }
    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ("dfl",)


class AnchorFreeFamily(Family):
    """What YOLOv8, YOLO11, YOLO26 and YOLO12 share; a family module sets its name and recognition rule."""

    head = AnchorFreeDetect
    loss_names = ("box", "cls", "dfl")
    hyp_type = AnchorFreeHyp
    default_hyp = "data/hyps/hyp.anchor-free.yaml"
    # YOLOv5's table for what they share; the box gain on their scale (7.5) and the DFL/L1 gain of their own.
    evolve_limits = evolve_limits_of(AnchorFreeHyp, box=Limit(1, 1.0, 20.0), dfl=Limit(1, 0.4, 6.0))
    layouts: ClassVar[tuple[str, ...]] = ("anchor_free",)
    val_iou = 0.7  # the threshold Ultralytics validates these families at
    detect_iou = 0.7  # Ultralytics' predictor
    importers = (ULTRALYTICS_IMPORTER,)

    def make_loss(self, model: nn.Module, hyp: Any, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        """Task-aligned assignment, CIoU, BCE and DFL at the hyp file's gains, used as given (the loss is normalised
        by the target scores, whatever the image size or number of classes)."""
        return AnchorFreeLoss(model, hyp, label_smoothing=label_smoothing)

    def detections(
        self,
        pred: torch.Tensor,
        conf_thres: float,
        iou_thres: float,
        *,
        classes: list[int] | None = None,
        agnostic: bool = False,
        multi_label: bool = False,
        max_det: int = 300,
    ) -> list[torch.Tensor]:
        """NMS of the (B, 4 + nc, A) layout; an end-to-end (B, max_det, 6) output is already final and only
        filtered. The two never have the same shape: A, the anchor count of three levels, is never 6."""
        if isinstance(pred, (list, tuple)):
            pred = pred[0]
        if pred.shape[-1] == 6:
            return end_to_end_detections(pred, conf_thres, classes=classes, max_det=max_det)
        return non_max_suppression_anchor_free(
            pred, conf_thres, iou_thres, classes=classes, agnostic=agnostic, multi_label=multi_label, max_det=max_det
        )

    def candidates(self, output0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B, 4 + nc, A) -> boxes (B, A, 4) xyxy and class scores (B, A, nc); None for a (B, k, 6) output."""
        if output0.shape[-1] == 6:
            return None
        xy, wh, scores = output0.transpose(1, 2).split((2, 2, output0.shape[1] - 4), -1)
        return torch.cat((xy - wh / 2, xy + wh / 2), -1), scores

    def int8_float_scope(self, model: nn.Module) -> Int8Scope:
        """The head's decoding (anchor points, strides, sigmoid, concatenation), its DFL where it has one, and its
        logits where a format asks."""
        head = head_name(model)
        dfl = (f"{head}.dfl",) if hasattr(head_of(model), "dfl") else ()
        return Int8Scope(modules=dfl, decoding=(head,), logits=tuple(prediction_convs(model)))


class YOLOv8Family(AnchorFreeFamily):
    name = "yolov8"
    title = "YOLOv8"

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        """Any anchor-free config the more specific families do not take (it is last in ``FAMILIES``)."""
        return "anchors" not in cfg


class YOLO11Family(AnchorFreeFamily):
    name = "yolo11"
    title = "YOLO11"

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        return "anchors" not in cfg and "C3k2" in block_names(cfg)


YOLOV8 = YOLOv8Family()
YOLO11 = YOLO11Family()
