"""YOLO26: anchor-free without DFL (reg_max 1), a one-to-many and a one-to-one head trained together, an NMS-free
output of the one-to-one head's top-k.

Configs: ``models/yolo26.yaml`` (``family: yolo26``); a config without the key is YOLO26's when it has an
end-to-end head or no DFL (``end2end`` or ``reg_max: 1``). Output layouts: ``"anchor_free"`` (the one-to-many
head, decoded as YOLOv8's) and, after ``use_end_to_end``, ``"end2end"``: (B, k, 6) = x1 y1 x2 y2 score class.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.nn as nn

from models.anchor_free_loss import End2EndLoss
from models.families.base import head_of
from models.families.yolov8 import AnchorFreeFamily
from models.loss import DetectionLoss
from utils.errors import UserError


class YOLO26Family(AnchorFreeFamily):
    name = "yolo26"
    title = "YOLO26"
    loss_names = ("box", "cls", "l1")  # its logged items are the one-to-one head's, the head used at inference
    layouts = ("anchor_free", "end2end")
    end_to_end = True

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        return "anchors" not in cfg and bool(cfg.get("end2end") or cfg.get("reg_max") == 1)

    def make_loss(self, model: nn.Module, hyp: Any, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        """Both heads, the one-to-one head's weight rising over the epochs (``set_epoch``)."""
        return End2EndLoss(model, hyp, label_smoothing=label_smoothing)

    def layout(self, model: nn.Module) -> str:
        return "end2end" if getattr(head_of(model), "end2end_output", False) else "anchor_free"

    def use_end_to_end(self, model: nn.Module, source: str | Path) -> None:
        """The one-to-one head's best 300 boxes per image, (B, 300, 6), instead of the one-to-many predictions."""
        head = head_of(model)
        if not getattr(head, "end2end", False):
            raise UserError(f"--end2end: {source} has no one-to-one head")
        head.end2end_output = True


YOLO26 = YOLO26Family()
