"""YOLO12: YOLO11's anchor-free head and loss on a backbone and neck of area-attention blocks (A2C2f).

Configs: ``models/yolo12.yaml`` (``family: yolo12``); a config without the key is YOLO12's when it has A2C2f
blocks. Everything else is the anchor-free families' (models/families/yolov8.py): DFL box branch, task-aligned
loss, NMS at IoU 0.7, Ultralytics' checkpoints, layout ``"anchor_free"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.families.base import block_names
from models.families.yolov8 import AnchorFreeFamily


class YOLO12Family(AnchorFreeFamily):
    name = "yolo12"
    title = "YOLO12"

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        return "anchors" not in cfg and "A2C2f" in block_names(cfg)


YOLO12 = YOLO12Family()
