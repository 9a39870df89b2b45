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


# utils/validation.py sums exactly three loss terms today; a loss with fewer is padded for it, and the row of
# results keeps the family's own terms. This goes when validation sums the loss's own number of terms.
VALIDATION_LOSS_TERMS = 3


class _PaddedLoss:
    """A loss whose items are padded with zeros to the three terms validation sums."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss, items = self.loss(*args, **kwargs)
        return loss, torch.nn.functional.pad(items, (0, VALIDATION_LOSS_TERMS - len(items)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loss, name)


def validation_loss(loss: Any, n_terms: int) -> Any:
    """The loss as validation takes it."""
    if n_terms > VALIDATION_LOSS_TERMS:
        raise NotImplementedError(f"validation sums {VALIDATION_LOSS_TERMS} loss terms, this family's loss has "
                                  f"{n_terms}")
    return loss if n_terms == VALIDATION_LOSS_TERMS else _PaddedLoss(loss)


def validation_row(results: Any, n_terms: int) -> tuple[float, ...]:
    """P, R, mAP50, mAP50-95 and the family's validation loss terms (results.csv's order)."""
    return results.as_row()[:4 + n_terms]
