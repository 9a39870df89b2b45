"""Test-time augmentation (val.py and detect.py ``--augment``): several scales and flips, merged before NMS.

Each batch runs at scales 1, 0.83 and 0.67 (the second one flipped left-right), as YOLOv5 does. Each pass's
boxes are mapped back to the input's pixel coordinates (divided by the scale, the flip undone) and the passes'
predictions are concatenated, so one NMS merges them. Two prediction sets are left out, because those scales
see such objects badly: the coarsest output level (largest objects) of the full-size pass and the finest
level (smallest objects) of the smallest pass. Needs a PyTorch model, whose raw outputs give the level sizes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

TTA_SCALES: tuple[float, ...] = (1.0, 0.83, 0.67)
TTA_FLIPS: tuple[str | None, ...] = (None, "lr", None)
PAD_VALUE = 0.447  # grey (114 / 255) for the padding to a stride multiple, as letterboxing uses


def scale_images(imgs: torch.Tensor, scale: float, stride: int) -> torch.Tensor:
    """``imgs`` (b, 3, h, w, float) resized by ``scale`` and padded right and bottom to a multiple of ``stride``.

    The padding goes after the image, so pixel coordinates of the scaled image are the original's times scale.
    """
    if scale == 1.0:
        return imgs
    h, w = imgs.shape[2:]
    size = (int(h * scale), int(w * scale))
    out = F.interpolate(imgs, size=size, mode="bilinear", align_corners=False)
    ph, pw = (math.ceil(x * scale / stride) * stride for x in (h, w))
    return F.pad(out, [0, pw - size[1], 0, ph - size[0]], value=PAD_VALUE)


def deaugment(pred: torch.Tensor, scale: float, flip: str | None, width: int) -> torch.Tensor:
    """Map predictions (b, n, 4 + ...) with boxes xywh in pixels of an augmented pass to the input's pixels.

    ``width`` is the input's (the flip happened before scaling).
    """
    pred = pred.clone()
    pred[..., :4] /= scale
    if flip == "lr":
        pred[..., 0] = width - pred[..., 0]
    elif flip == "ud":
        raise ValueError("up-down flips are not used")
    return pred


def level_sizes(raw: Sequence[torch.Tensor]) -> list[int]:
    """Predictions per output level of one image: anchors x rows x columns."""
    return [int(math.prod(r.shape[1:-1])) for r in raw]


def tta_predict(model: nn.Module, imgs: torch.Tensor, stride: int, scales: Sequence[float] = TTA_SCALES,
                flips: Sequence[str | None] = TTA_FLIPS) -> torch.Tensor:
    """Merged predictions (b, n, 5 + nc) of every pass for ``imgs`` (b, 3, h, w, float in [0, 1]), before NMS."""
    width = imgs.shape[3]
    merged = []
    for k, (scale, flip) in enumerate(zip(scales, flips)):
        x = imgs.flip(3) if flip == "lr" else imgs
        out = model(scale_images(x, scale, stride))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("test-time augmentation needs a PyTorch model that returns (predictions, raw outputs)")
        pred, raw = out
        sizes = level_sizes(raw)
        if len(sizes) > 1 and k == 0:
            pred = pred[:, : -sizes[-1]]  # the full-size pass without its coarsest level
        elif len(sizes) > 1 and k == len(scales) - 1:
            pred = pred[:, sizes[0]:]  # the smallest pass without its finest level
        merged.append(deaugment(pred, scale, flip, width))
    return torch.cat(merged, 1)
