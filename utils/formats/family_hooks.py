"""A stand-in for the family contract (docs/design.md, "The family contract") built from today's models/families.py.

The deploy code (formats, predictor, export) calls only this module for what differs between families:
``hooks_for(model | config | name | Family)`` gives an object with the contract's members ``layout(model)``,
``val_iou``, ``detect_iou``, ``detections(...)``, ``export_module(model, end2end=...)``, ``candidates(output0)``
and ``int8_float_scope(model)``. When models/families/ provides them, this module goes and the calls point at
``family_of(...)`` directly.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from utils.errors import UserError

# detect.py's default NMS IoU per family: YOLOv5's detect.py uses 0.45, Ultralytics' predictor 0.7.
_DETECT_IOU = {"yolov5": 0.45}
_DEFAULT_DETECT_IOU = 0.7


@dataclass(frozen=True)
class Int8Scope:
    """What stays in float in an INT8 file: the head's own arithmetic (decoding: grids, strides, DFL, the class
    sigmoid, the concatenation of boxes with scores) and these op types wherever they are. ``modules`` are PyTorch
    qualified names; a module listed keeps its own ops in float, its convolutions (``quantized``) are quantized."""

    modules: tuple[str, ...]
    op_types: tuple[str, ...]
    quantized: tuple[str, ...] = ()


class PredictionsOnly(nn.Module):
    """A detector's decoded predictions alone (``output0``): what is exported, in input pixels."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]


class FamilyHooks:
    """The contract's members for one family, from today's ``models.families.Family``."""

    def __init__(self, family: Any):
        self.family = family
        self.name: str = family.name

    @property
    def val_iou(self) -> float:
        return float(self.family.nms_iou)

    @property
    def detect_iou(self) -> float:
        return _DETECT_IOU.get(self.name, _DEFAULT_DETECT_IOU)

    def layout(self, model: nn.Module) -> str:
        if self.family.anchor_based:
            return "yolov5"
        return "end2end" if getattr(model.model[-1], "end2end_output", False) else "anchor_free"

    def detections(self, pred: torch.Tensor, conf_thres: float, iou_thres: float, *, classes: list[int] | None = None,
                   agnostic: bool = False, multi_label: bool = False, max_det: int = 300) -> list[torch.Tensor]:
        return self.family.detections(pred, conf_thres, iou_thres, classes=classes, agnostic=agnostic,
                                      multi_label=multi_label, max_det=max_det)

    def export_module(self, model: nn.Module, *, end2end: bool = False) -> nn.Module:
        """Images (B, 3, H, W) in [0, 1] to ``output0`` in the family's layout; ``end2end``: YOLO26's one-to-one
        head's (B, 300, 6)."""
        head = model.model[-1]
        if end2end and not getattr(head, "end2end", False):
            raise UserError("--end2end: the model has no one-to-one head (YOLO26 only)")
        if getattr(head, "end2end", False):
            head.end2end_output = end2end
        return PredictionsOnly(model).eval()

    def candidates(self, output0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Boxes (B, N, 4) x1 y1 x2 y2 in input pixels and per-class scores (B, N, nc); None for end-to-end."""
        if self.family.anchor_based:
            return _corners(output0[..., :4]), output0[..., 5:] * output0[..., 4:5]
        if output0.shape[-1] == 6 and output0.shape[1] != 6:  # (B, k, 6): already final
            return None
        pred = output0.transpose(1, 2)
        return _corners(pred[..., :4]), pred[..., 4:]

    def int8_float_scope(self, model: nn.Module) -> Int8Scope:
        index = len(model.model) - 1
        head = f"model.{index}"
        children = [f"{head}.{name}" for name, _ in model.model[-1].named_children()]
        kept_float = [c for c in children if c.endswith(".dfl")]
        return Int8Scope(modules=(head, *kept_float), op_types=("Sigmoid", "Softmax"),
                         quantized=tuple(c for c in children if c not in kept_float))


def _corners(xywh: torch.Tensor) -> torch.Tensor:
    """x1 y1 x2 y2 from centre and size, computed as NMS computes them (utils/boxes.py), without in-place writes so
    it traces into a clean graph."""
    xy, half_wh = xywh[..., :2], xywh[..., 2:4] / 2
    return torch.cat((xy - half_wh, xy + half_wh), -1)


def hooks_for(source: nn.Module | Mapping[str, Any] | str | Any) -> FamilyHooks:
    """The family of a model, a model config, a family name or a family object."""
    from models.families import Family, family_of

    if isinstance(source, FamilyHooks):
        return source
    return FamilyHooks(source if isinstance(source, Family) else family_of(source))
