"""Non-maximum suppression of the model's decoded predictions."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

from utils.boxes import xywh2xyxy

# Cap on the boxes one image sends to NMS: an untrained model can put tens of thousands of boxes over the
# threshold, and NMS cost grows quadratically within a class.
MAX_NMS_CANDIDATES = 30000
NMS_PREFIX_PER_DETECTION = 10  # the first NMS pass looks at this many best boxes per detection kept


def non_max_suppression(
    prediction: torch.Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
    classes: list[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_det: int = 300,
    max_nms: int = MAX_NMS_CANDIDATES,
) -> list[torch.Tensor]:
    """Filter raw predictions (bs, N, 5 + nc) = [x, y, w, h, obj, cls...] into detections per image.

    Returns one float tensor (n, 6) = [x1, y1, x2, y2, conf, cls] per image, highest confidence first, with
    conf = objectness * class score. ``multi_label`` keeps every class whose score passes the threshold
    (one row each); otherwise only the best class of a box. ``agnostic`` suppresses across classes;
    ``classes`` keeps only those class indices.
    """
    _check_thresholds(conf_thres, iou_thres)
    if isinstance(prediction, (list, tuple)):  # an eval forward's (pred, raw)
        prediction = prediction[0]

    device = prediction.device
    class_filter = torch.tensor(classes, device=device) if classes is not None else None
    # conf = obj * cls <= obj, so a box whose objectness fails the threshold can never pass it
    has_candidates = prediction[..., 4] > conf_thres
    output: list[torch.Tensor] = []
    for image_pred, keep_mask in zip(prediction, has_candidates):
        x = image_pred[keep_mask]
        # second cheap filter on the best class, before building the (n, nc) score matrix
        x = x[x[:, 5:].amax(1) * x[:, 4] > conf_thres]
        scores = x[:, 5:] * x[:, 4:5]
        output.append(
            _image_detections(
                x[:, :4], scores, conf_thres, iou_thres, class_filter, agnostic, multi_label, max_det, max_nms
            )
        )
    return output


def non_max_suppression_anchor_free(
    prediction: torch.Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.7,
    classes: list[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_det: int = 300,
    max_nms: int = MAX_NMS_CANDIDATES,
) -> list[torch.Tensor]:
    """NMS of the anchor-free layout (bs, 4 + nc, N) = rows x, y, w, h (pixels), then each class's score.

    There is no objectness: a box's confidence for a class is that class's score. Otherwise as
    ``non_max_suppression``: one (n, 6) = [x1, y1, x2, y2, conf, cls] per image, highest confidence first.
    """
    _check_thresholds(conf_thres, iou_thres)
    if isinstance(prediction, (list, tuple)):  # an eval forward's (pred, raw)
        prediction = prediction[0]
    device = prediction.device
    class_filter = torch.tensor(classes, device=device) if classes is not None else None
    has_candidates = prediction[:, 4:].amax(1) > conf_thres  # (bs, N)
    output: list[torch.Tensor] = []
    for image_pred, keep_mask in zip(prediction, has_candidates):
        x = image_pred[:, keep_mask].T  # (n, 4 + nc)
        output.append(
            _image_detections(
                x[:, :4], x[:, 4:], conf_thres, iou_thres, class_filter, agnostic, multi_label, max_det, max_nms
            )
        )
    return output


def end_to_end_detections(
    prediction: torch.Tensor,
    conf_thres: float = 0.25,
    classes: list[int] | None = None,
    max_det: int = 300,
) -> list[torch.Tensor]:
    """The detections of an NMS-free head's output (bs, k, 6) = [x1, y1, x2, y2, score, cls], best first:
    those above ``conf_thres`` (of the wanted ``classes``), at most ``max_det`` per image."""
    _check_thresholds(conf_thres, 0.0)
    if isinstance(prediction, (list, tuple)):
        prediction = prediction[0]
    output = []
    for det in prediction:
        keep = det[:, 4] > conf_thres
        if classes is not None:
            keep &= (det[:, 5:6] == torch.tensor(classes, device=det.device, dtype=det.dtype)).any(1)
        output.append(det[keep][:max_det])
    return output


def _check_thresholds(conf_thres: float, iou_thres: float) -> None:
    if not 0 <= conf_thres <= 1:
        raise ValueError(f"conf_thres must be in [0, 1], got {conf_thres}")
    if not 0 <= iou_thres <= 1:
        raise ValueError(f"iou_thres must be in [0, 1], got {iou_thres}")


def _image_detections(
    boxes_xywh: torch.Tensor,
    scores: torch.Tensor,
    conf_thres: float,
    iou_thres: float,
    class_filter: torch.Tensor | None,
    agnostic: bool,
    multi_label: bool,
    max_det: int,
    max_nms: int,
) -> torch.Tensor:
    """One image's detections (n, 6) from candidate boxes (m, 4) and their class confidences (m, nc)."""
    device, dtype = scores.device, scores.dtype
    if scores.shape[0] == 0:
        return torch.zeros((0, 6), device=device, dtype=dtype)
    if multi_label:
        box_index, cls_index = (scores > conf_thres).nonzero(as_tuple=True)
        conf = scores[box_index, cls_index]
    else:
        conf, cls_index = scores.max(1)
        box_index = (conf > conf_thres).nonzero(as_tuple=True)[0]
        conf, cls_index = conf[box_index], cls_index[box_index]
    if class_filter is not None:
        wanted = (cls_index[:, None] == class_filter).any(1)
        box_index, cls_index, conf = box_index[wanted], cls_index[wanted], conf[wanted]
    if conf.shape[0] == 0:
        return torch.zeros((0, 6), device=device, dtype=dtype)
    if conf.shape[0] > max_nms:  # cap before building the (n, 6) rows: an untrained model can pass millions
        top = conf.topk(max_nms).indices
        box_index, cls_index, conf = box_index[top], cls_index[top], conf[top]
    det = torch.cat((xywh2xyxy(boxes_xywh[box_index]), conf[:, None], cls_index[:, None].to(dtype)), 1)
    return det[_first_kept(det, iou_thres, agnostic, max_det)]


def _first_kept(det: torch.Tensor, iou_thres: float, agnostic: bool, max_det: int) -> torch.Tensor:
    """Indices of the ``max_det`` best boxes greedy NMS keeps, in score order.

    Whether greedy NMS keeps a box depends only on the boxes scored above it, so NMS over the best-scored
    prefix keeps exactly the first boxes full NMS keeps; once that prefix yields ``max_det`` of them the rest
    cannot change the answer. An untrained model sends tens of thousands of boxes and NMS time grows with
    their square, so starting with a short prefix makes its validation many times cheaper.
    """
    group = torch.zeros_like(det[:, 5]) if agnostic else det[:, 5]
    # NMS in float32: half-precision IoU is too coarse near the threshold
    boxes, scores = det[:, :4].float(), det[:, 4].float()
    n, prefix = det.shape[0], max(NMS_PREFIX_PER_DETECTION * max_det, 1)
    while prefix < n:
        top = scores.topk(prefix).indices  # sorted, best first
        keep = batched_nms(boxes[top], scores[top], group[top], iou_thres)
        if keep.numel() >= max_det:
            return top[keep[:max_det]]
        prefix *= 4  # heavy suppression: a longer prefix
    return batched_nms(boxes, scores, group, iou_thres)[:max_det]


@functools.lru_cache(maxsize=1)
def nms_kernel() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """torchvision's NMS kernel (boxes (n, 4) xyxy, scores (n,), IoU threshold -> kept indices, best first), loaded
    from its compiled library without importing the torchvision package: that import brings in torch._dynamo for
    operators NMS does not use, a second or more of every val.py and detect.py start. Falls back to the import."""
    spec = importlib.util.find_spec("torchvision")
    folder = Path(spec.origin).parent if spec is not None and spec.origin else None
    libraries = sorted(folder.glob("_C*.so"), key=lambda p: "_stable" not in p.name) if folder else []
    try:
        torch.ops.load_library(str(libraries[0]))
        return torch.ops.torchvision.nms
    except (IndexError, OSError, RuntimeError, AttributeError):
        import torchvision

        return torchvision.ops.nms


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor, iou_thres: float) -> torch.Tensor:
    """Indices of the boxes greedy NMS keeps within each group (class), best score first: one NMS over the boxes
    shifted apart by group, so that boxes of different groups never overlap."""
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    shift = groups.to(boxes.dtype)[:, None] * (boxes.max() + 1)
    return nms_kernel()(boxes + shift, scores, iou_thres)
