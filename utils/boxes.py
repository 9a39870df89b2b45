"""Box format conversions, IoU and coordinate mapping.

Formats: ``xyxy`` = (x1, y1, x2, y2) corners, ``xywh`` = (x_center, y_center, width, height).
A trailing ``n`` means normalised to [0, 1] by the image size. Functions accept torch tensors
or numpy arrays of shape (..., 4) unless stated otherwise.
"""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np
import torch

# Boxes in a tensor or an array: each function gives back the kind it was given (a constrained type variable, so
# that the checker follows each kind through the arithmetic).
Array = TypeVar("Array", torch.Tensor, np.ndarray)


def _clone(x: Array) -> Array:
    return x.clone() if isinstance(x, torch.Tensor) else np.copy(x)


def xyxy2xywh(x: Array) -> Array:
    y = _clone(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2
    y[..., 2] = x[..., 2] - x[..., 0]
    y[..., 3] = x[..., 3] - x[..., 1]
    return y


def xywh2xyxy(x: Array) -> Array:
    y = _clone(x)
    y[..., 0] = x[..., 0] - x[..., 2] / 2
    y[..., 1] = x[..., 1] - x[..., 3] / 2
    y[..., 2] = x[..., 0] + x[..., 2] / 2
    y[..., 3] = x[..., 1] + x[..., 3] / 2
    return y


def xywhn2xyxy(x: Array, w: float, h: float, padw: float = 0.0, padh: float = 0.0) -> Array:
    """Normalised xywh to pixel xyxy in an image of size (w, h), shifted by the padding."""
    y = _clone(x)
    y[..., 0] = w * (x[..., 0] - x[..., 2] / 2) + padw
    y[..., 1] = h * (x[..., 1] - x[..., 3] / 2) + padh
    y[..., 2] = w * (x[..., 0] + x[..., 2] / 2) + padw
    y[..., 3] = h * (x[..., 1] + x[..., 3] / 2) + padh
    return y


def xyxy2xywhn(x: Array, w: float, h: float, clip: bool = False, eps: float = 0.0) -> Array:
    """Pixel xyxy to normalised xywh; ``clip`` first clips the corners to the image minus ``eps``."""
    if clip:
        x = _clone(x)
        clip_boxes(x, (h - eps, w - eps))
    y = _clone(x)
    y[..., 0] = ((x[..., 0] + x[..., 2]) / 2) / w
    y[..., 1] = ((x[..., 1] + x[..., 3]) / 2) / h
    y[..., 2] = (x[..., 2] - x[..., 0]) / w
    y[..., 3] = (x[..., 3] - x[..., 1]) / h
    return y


def clip_boxes(boxes: Array, shape: tuple[float, float]) -> Array:
    """Clip xyxy boxes in place to an image of shape (height, width)."""
    h, w = shape[0], shape[1]
    if isinstance(boxes, torch.Tensor):
        boxes[..., 0].clamp_(0, w)
        boxes[..., 1].clamp_(0, h)
        boxes[..., 2].clamp_(0, w)
        boxes[..., 3].clamp_(0, h)
    else:
        boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, w)
        boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, h)
    return boxes


def scale_boxes(
    letterboxed_shape: tuple[int, int],
    boxes: Array,
    original_shape: tuple[int, int],
    ratio_pad: tuple | None = None,
) -> Array:
    """Map xyxy boxes (in place) from a letterboxed image of shape (h, w) back to the original (h0, w0).

    ``ratio_pad`` is ((ratio_h, ratio_w), (pad_w, pad_h)) as recorded by the letterbox; when absent it is
    recomputed assuming a centred letterbox with equal scale on both axes.
    """
    if ratio_pad is None:
        gain = min(letterboxed_shape[0] / original_shape[0], letterboxed_shape[1] / original_shape[1])
        pad_w = (letterboxed_shape[1] - original_shape[1] * gain) / 2
        pad_h = (letterboxed_shape[0] - original_shape[0] * gain) / 2
        gain_w = gain_h = gain
    else:
        gain_h, gain_w = ratio_pad[0][0], ratio_pad[0][1]
        pad_w, pad_h = ratio_pad[1][0], ratio_pad[1][1]
    boxes[..., [0, 2]] -= pad_w
    boxes[..., [1, 3]] -= pad_h
    boxes[..., [0, 2]] /= gain_w
    boxes[..., [1, 3]] /= gain_h
    return clip_boxes(boxes, original_shape)


def box_iou_exact(box1: np.ndarray, box2: np.ndarray) -> np.ndarray:
    """Pairwise IoU of xyxy boxes (N, 4) x (M, 4) -> (N, M) in float64, as COCO computes it (0 if no union)."""
    box1 = np.asarray(box1, dtype=np.float64).reshape(-1, 4)
    box2 = np.asarray(box2, dtype=np.float64).reshape(-1, 4)
    iw = np.minimum(box1[:, None, 2], box2[None, :, 2]) - np.maximum(box1[:, None, 0], box2[None, :, 0])
    ih = np.minimum(box1[:, None, 3], box2[None, :, 3]) - np.maximum(box1[:, None, 1], box2[None, :, 1])
    inter = np.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    area1 = (box1[:, 2] - box1[:, 0]) * (box1[:, 3] - box1[:, 1])
    area2 = (box2[:, 2] - box2[:, 0]) * (box2[:, 3] - box2[:, 1])
    union = area1[:, None] + area2[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Element-wise Complete IoU of xywh boxes of shape (..., 4); returns shape (...)."""
    corners1 = (
        box1[..., 0] - box1[..., 2] / 2,
        box1[..., 1] - box1[..., 3] / 2,
        box1[..., 0] + box1[..., 2] / 2,
        box1[..., 1] + box1[..., 3] / 2,
    )
    corners2 = (
        box2[..., 0] - box2[..., 2] / 2,
        box2[..., 1] - box2[..., 3] / 2,
        box2[..., 0] + box2[..., 2] / 2,
        box2[..., 1] + box2[..., 3] / 2,
    )
    centre_dist_sq = (box2[..., 0] - box1[..., 0]) ** 2 + (box2[..., 1] - box1[..., 1]) ** 2
    return _ciou(corners1, corners2, (box1[..., 2], box1[..., 3]), (box2[..., 2], box2[..., 3]), centre_dist_sq, eps)


def bbox_ciou_xyxy(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Element-wise Complete IoU of xyxy boxes of shape (..., 4); returns shape (...).

    The corner form of ``bbox_ciou``, for callers whose boxes are corners already (the anchor-free loss and its
    assigner): converting them to centre form and back would cost rounding on every coordinate.
    """
    b1_x1, b1_y1, b1_x2, b1_y2 = corners1 = box1.unbind(-1)
    b2_x1, b2_y1, b2_x2, b2_y2 = corners2 = box2.unbind(-1)
    # Twice each centre's coordinates, so (sum of differences)^2 / 4 is the squared centre distance.
    centre_dist_sq = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
    return _ciou(
        corners1, corners2, (b1_x2 - b1_x1, b1_y2 - b1_y1), (b2_x2 - b2_x1, b2_y2 - b2_y1), centre_dist_sq, eps
    )


def _ciou(
    corners1: tuple[torch.Tensor, ...],
    corners2: tuple[torch.Tensor, ...],
    wh1: tuple[torch.Tensor, torch.Tensor],
    wh2: tuple[torch.Tensor, torch.Tensor],
    centre_dist_sq: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """CIoU from both boxes' corners (x1, y1, x2, y2), widths and heights, and their squared centre distance:
    each public form passes the values it has exactly, so neither rounds through the other's."""
    b1_x1, b1_y1, b1_x2, b1_y2 = corners1
    b2_x1, b2_y1, b2_x2, b2_y2 = corners2
    (w1, h1), (w2, h2) = (wh1[0], wh1[1] + eps), (wh2[0], wh2[1] + eps)
    inter = (torch.min(b1_x2, b2_x2) - torch.max(b1_x1, b2_x1)).clamp(0) * (
        torch.min(b1_y2, b2_y2) - torch.max(b1_y1, b2_y1)
    ).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union

    enclose_w = torch.max(b1_x2, b2_x2) - torch.min(b1_x1, b2_x1)
    enclose_h = torch.max(b1_y2, b2_y2) - torch.min(b1_y1, b2_y1)
    diag_sq = enclose_w**2 + enclose_h**2 + eps
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (centre_dist_sq / diag_sq + v * alpha)
