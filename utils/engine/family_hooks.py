"""What the engine asks a model family (models/families.py), in one place.

The family contract (docs/design.md) gives every family ``forward_train``, ``loss_names`` and ``make_loss``; a
family that does not define ``forward_train`` or ``build_model`` gets the YOLO default here. This adapter stands
in until the family base class provides those defaults itself; then the engine calls the family directly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from models.yolo import build_model as build_yolo_model


def forward_train(family: Any, model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> Any:
    """The training forward pass: the family's own (a detector that takes the targets, as DETR-style denoising
    queries do), or ``model(images)``."""
    own = getattr(family, "forward_train", None)
    return own(model, images, targets) if own is not None else model(images)


def loss_names(family: Any) -> tuple[str, ...]:
    """The names of the family's loss terms, any number of them (results.csv, the log, TensorBoard)."""
    return tuple(family.loss_names)


def build_model(family: Any, cfg: Any, **options: Any) -> nn.Module:
    """The family's model from a config (``options``: nc, weights, transfer, keep_anchors, anchors, names, as
    ``models.yolo.build_model`` takes them); a family that builds its own model says so with ``build_model``."""
    own = getattr(family, "build_model", None)
    return (own or build_yolo_model)(cfg, **options)
