"""YOLOv5 (v6 and later): anchor-based head with objectness, its loss, AutoAnchor and YOLOv5's checkpoints.

Configs: ``models/yolov5*.yaml`` (``family: yolov5``); a config without the key is YOLOv5's when it has ``anchors``.
Output layout ``"yolov5"``: (B, A, 5 + nc) = box centre x, y, width, height in input pixels, objectness, class
scores; a detection's confidence is objectness times its class score.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from models.autoanchor import check_anchors
from models.families.base import Family, head_of
from models.families.yolov5_import import YOLOV5_IMPORTER
from models.heads import Detect
from models.loss import ComputeLoss, DetectionLoss
from utils.hyp import AugmentationHyp, HypRecord, OptimisationHyp, evolve_limits_of
from utils.nms import non_max_suppression


@dataclass(frozen=True)
class YOLOv5LossGains(HypRecord):
    box: float = 0.05  # box loss gain
    cls: float = 0.5  # classification loss gain
    cls_pw: float = 1.0  # classification BCE positive weight
    obj: float = 1.0  # objectness loss gain (scaled with image size)
    obj_pw: float = 1.0  # objectness BCE positive weight
    anchor_t: float = 4.0  # anchor-multiple threshold for matching targets to anchors
    anchors: float | None = None  # anchors per output level (None: the model YAML's), then fitted by AutoAnchor
    fl_gamma: float = 0.0  # focal loss gamma (0: plain BCE)


@dataclass(frozen=True)
class YOLOv5Hyp(AugmentationHyp, YOLOv5LossGains, OptimisationHyp):
    """YOLOv5's hyper-parameters: the keys of ``data/hyps/hyp.scratch-low.yaml``, with its values as defaults."""

    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("anchors",)


class YOLOv5Family(Family):
    name = "yolov5"
    title = "YOLOv5"
    head = Detect
    loss_names = ("box", "obj", "cls")
    hyp_type = YOLOv5Hyp
    default_hyp = "data/hyps/hyp.scratch-low.yaml"
    evolve_limits = evolve_limits_of(YOLOv5Hyp)
    layouts = ("yolov5",)
    val_iou = 0.6  # YOLOv5's val.py
    detect_iou = 0.45  # YOLOv5's detect.py
    importers = (YOLOV5_IMPORTER,)
    anchor_based = True

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        return "anchors" in cfg

    def make_loss(self, model: nn.Module, hyp: Any, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        """YOLOv5's loss, its gains scaled to the number of levels, classes and the image size (hyp values are for
        3 levels, 80 classes and 640 pixels), as YOLOv5's trainer scales them."""
        detect = head_of(model)
        scaled = hyp.replace(
            box=hyp.box * 3 / detect.nl,
            cls=hyp.cls * detect.nc / 80 * 3 / detect.nl,
            obj=hyp.obj * (imgsz / 640) ** 2 * 3 / detect.nl,
        )
        return ComputeLoss(model, scaled, label_smoothing)

    def fit_anchors(
        self, dataset: Any, model: nn.Module, hyp: Any = None, *, thr: float | None = None, imgsz: int
    ) -> None:
        """AutoAnchor: check the anchors against the labels at ``thr`` (default: ``hyp.anchor_t``), refit if poor."""
        check_anchors(dataset, model, thr=hyp.anchor_t if thr is None else thr, imgsz=imgsz)

    def anchors(self, hyp: Any) -> float | None:
        return getattr(hyp, "anchors", None)

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
        return non_max_suppression(
            pred, conf_thres, iou_thres, classes=classes, agnostic=agnostic, multi_label=multi_label, max_det=max_det
        )

    def candidates(self, output0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A, 5 + nc) -> boxes (B, A, 4) xyxy, scores (B, A, nc) = objectness times each class score."""
        xy, wh, objectness, classes = output0.split((2, 2, 1, output0.shape[-1] - 5), -1)
        return torch.cat((xy - wh / 2, xy + wh / 2), -1), classes * objectness


YOLOV5 = YOLOv5Family()
