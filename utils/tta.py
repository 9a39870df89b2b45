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

from utils.errors import UserError

TTA_SCALES: tuple[float, ...] = (1.0, 0.83, 0.67)
TTA_FLIPS: tuple[str | None, ...] = (None, "lr", None)
PAD_VALUE = 0.447  # grey (114 / 255) for the padding to a stride multiple, as letterboxing uses


def check_tta_applies(weights: str, kind: str, layout: str | None = None) -> None:
    """Refuse --augment in one line where it cannot work: for val.py and detect.py alike.

    ``kind`` (the format's name) and ``layout`` are the model's (utils/formats/metadata.py ModelMeta); without the
    layout only the format is checked."""
    if kind != "pytorch":
        raise UserError(f"--augment needs a PyTorch .pt model (its passes change the input size); {weights} is {kind}")
    if layout == "end2end":
        raise UserError(
            "--augment needs predictions before NMS to merge its passes; --end2end gives the one-to-one "
            "head's final detections (leave out one of the two)"
        )


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


def output_levels(raw: Sequence[torch.Tensor] | dict) -> list[torch.Tensor]:
    """The per-level training-mode outputs of an eval forward's ``raw`` (YOLO26: its one-to-many head's)."""
    return list(raw["one2many"]) if isinstance(raw, dict) else list(raw)


def level_sizes(raw: Sequence[torch.Tensor] | dict) -> list[int]:
    """Predictions per output level of one image: YOLOv5's (b, anchors, ny, nx, no) levels give anchors x rows x
    columns, the anchor-free (b, channels, ny, nx) levels rows x columns."""
    return [int(math.prod(r.shape[1:-1] if r.dim() == 5 else r.shape[2:])) for r in output_levels(raw)]


def tta_predict(
    model: nn.Module,
    imgs: torch.Tensor,
    stride: int,
    scales: Sequence[float] = TTA_SCALES,
    flips: Sequence[str | None] = TTA_FLIPS,
) -> torch.Tensor:
    """Merged predictions of every pass for ``imgs`` (b, 3, h, w, float in [0, 1]), before NMS, in the model's own
    layout: YOLOv5's (b, n, 5 + nc) or the anchor-free (b, 4 + nc, n)."""
    width = imgs.shape[3]
    merged = []
    anchors_last = False
    for k, (scale, flip) in enumerate(zip(scales, flips)):
        x = imgs.flip(3) if flip == "lr" else imgs
        out = model(scale_images(x, scale, stride))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("test-time augmentation needs a PyTorch model that returns (predictions, raw outputs)")
        pred, raw = out
        anchors_last = output_levels(raw)[0].dim() == 4  # anchor-free: boxes and scores along dim 1
        if anchors_last and pred.shape[-1] == 6:
            raise ValueError("test-time augmentation needs predictions before NMS, not an end-to-end head's output")
        if anchors_last:
            pred = pred.transpose(1, 2)  # (b, n, 4 + nc): boxes in the last dimension, as YOLOv5's
        sizes = level_sizes(raw)
        if len(sizes) > 1 and k == 0:
            pred = pred[:, : -sizes[-1]]  # the full-size pass without its coarsest level
        elif len(sizes) > 1 and k == len(scales) - 1:
            pred = pred[:, sizes[0] :]  # the smallest pass without its finest level
        merged.append(deaugment(pred, scale, flip, width))
    merged_pred = torch.cat(merged, 1)
    return merged_pred.transpose(1, 2) if anchors_last else merged_pred
