"""Hungarian matching of a DETR's queries to an image's boxes, for every output set of a step at once.

The cost of query q for box g is the references' (RT-DETR, D-FINE): ``class * focal(q, class of g) + bbox * L1(q, g)
- giou * GIoU(q, g)``, boxes as centre and size in [0, 1], the focal class cost ``alpha (1 - p)^gamma (-log p) -
(1 - alpha) p^gamma (-log(1 - p))`` of the sigmoid score p of g's class (weights 2, 5, 2; alpha 0.25, gamma 2).

Every set that needs matching (each decoder layer's queries, the encoder's top-k) is costed against every box of the
batch in one (S, B, Q, N) tensor on the device, and that tensor is copied to the host once (with the boxes' image
column, so the host learns how many boxes each image holds from the same copy): this is the step's one wait for the
device (docs/design.md, "Where the step may and may not sync"). scipy's ``linear_sum_assignment`` then solves each
(set, image) block; it is a deterministic function of the block, so equal costs (ties) resolve the same way in every
run, on every rank and at every world size. A non-finite cost becomes the largest float: that query is matched only
where nothing else can be.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from utils.errors import UserError

FOCAL_EPS = 1e-8  # inside the logs of the focal class cost, as the references


@dataclass(frozen=True)
class MatchCosts:
    """The cost weights and the focal cost's alpha and gamma (transformers' ``matcher_*`` config fields)."""

    class_weight: float = 2.0
    bbox_weight: float = 5.0
    giou_weight: float = 2.0
    alpha: float = 0.25
    gamma: float = 2.0


class Matches(NamedTuple):
    """The matched (query, box) pairs of each set: index tensors on the device, one entry per set."""

    image: list[torch.Tensor]  # (P,) long: the image in the batch
    query: list[torch.Tensor]  # (P,) long: the query in the image
    box: list[torch.Tensor]  # (P,) long: the box's row in the batch's targets


HostMatches = tuple[np.ndarray, np.ndarray, np.ndarray]  # (image, query, box row) of one set's pairs, on the host


def union_of_matches(found: list[HostMatches]) -> HostMatches:
    """D-FINE's union of the sets' matches (its "go" indices): each query matched to a box in any set, with the box
    it is matched to in the most sets (on a tie the box of the lowest row: the references leave ties to an unstable
    sort)."""
    if not found or not sum(len(m[0]) for m in found):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pairs = np.concatenate([np.stack(m, 1) for m in found])
    unique, counts = np.unique(pairs, axis=0, return_counts=True)
    order = np.lexsort((unique[:, 2], -counts, unique[:, 1], unique[:, 0]))
    ranked = unique[order]
    first = np.ones(len(ranked), dtype=bool)
    first[1:] = (ranked[1:, 0] != ranked[:-1, 0]) | (ranked[1:, 1] != ranked[:-1, 1])
    kept = ranked[first]
    return kept[:, 0].copy(), kept[:, 1].copy(), kept[:, 2].copy()


def linear_sum_assignment() -> Any:
    """scipy's solver (scipy comes with transformers), or one line naming the package."""
    try:
        return importlib.import_module("scipy.optimize").linear_sum_assignment
    except ImportError as e:
        raise UserError("the DETR families' matcher needs scipy: pip install scipy") from e


def cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    centre, size = boxes[..., :2], boxes[..., 2:]
    return torch.cat((centre - size / 2, centre + size / 2), -1)


def pairwise_giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., Q, N) generalised IoU of xyxy boxes ``a`` (..., Q, 4) and ``b`` (N, 4)."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(a[..., :, None, :2], b[:, :2])
    rb = torch.minimum(a[..., :, None, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[..., :, None] + area_b - inter
    iou = inter / union
    hull = (torch.maximum(a[..., :, None, 2:], b[:, 2:]) - torch.minimum(a[..., :, None, :2], b[:, :2])).clamp(min=0)
    hull_area = hull.prod(-1)
    return iou - (hull_area - union) / hull_area


def cost_matrices(
    logits: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, gt_boxes: torch.Tensor, costs: MatchCosts
) -> torch.Tensor:
    """(S, B, Q, N) cost of each set's queries (``logits`` (S, B, Q, nc), ``boxes`` (S, B, Q, 4) cxcywh) for every
    box of the batch (``labels`` (N,), ``gt_boxes`` (N, 4) cxcywh), finite."""
    prob = logits.float().sigmoid().index_select(-1, labels)  # (S, B, Q, N)
    positive = costs.alpha * (1 - prob) ** costs.gamma * -(prob + FOCAL_EPS).log()
    negative = (1 - costs.alpha) * prob**costs.gamma * -(1 - prob + FOCAL_EPS).log()
    boxes = boxes.float()
    l1 = (boxes[..., :, None, :] - gt_boxes).abs().sum(-1)
    giou = pairwise_giou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(gt_boxes))
    cost = costs.class_weight * (positive - negative) + costs.bbox_weight * l1 - costs.giou_weight * giou
    largest = torch.finfo(cost.dtype).max
    return torch.nan_to_num(cost, nan=largest, posinf=largest, neginf=largest)


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def solve(cost: np.ndarray, per_image: list[int]) -> list[HostMatches]:
    """Each set's matches (image, query, box row) from the host costs (S, B, Q, N) and the boxes per image."""
    assign = linear_sum_assignment()
    starts = np.concatenate(([0], np.cumsum(per_image)))
    found = []
    for per_set in cost:
        images, queries, rows = [], [], []
        for b, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            if end == start:
                continue
            q, g = assign(per_set[b, :, start:end])
            images.append(np.full(len(q), b, dtype=np.int64))
            queries.append(q.astype(np.int64))
            rows.append(g.astype(np.int64) + start)

        found.append((joined(images), joined(queries), joined(rows)))
    return found


def host_costs(cost: torch.Tensor, image: torch.Tensor, per_image: list[int] | None) -> tuple[np.ndarray, list[int]]:
    """The costs on the host, and the boxes per image: given, or counted from ``image`` (the boxes' image column)
    brought in the same copy."""
    batch = cost.shape[1]
    if per_image is not None:
        return cost.cpu().numpy(), per_image  # the step's one wait for the device
    both = torch.cat((cost.reshape(-1), image.to(cost.dtype))).cpu().numpy()  # one copy: costs and image column
    counts = np.bincount(both[cost.numel() :].astype(np.int64), minlength=batch)
    return both[: cost.numel()].reshape(cost.shape), [int(n) for n in counts]


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host index arrays onto the device in one copy (pinned on CUDA: queued without waiting)."""
    sizes = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64))
    if device.type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split(sizes))


def hungarian(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    targets: torch.Tensor,
    costs: MatchCosts,
    per_image: list[int] | None = None,
    extra: Callable[[list[int], list[HostMatches]], list[np.ndarray]] | None = None,
) -> tuple[Matches, list[int], list[torch.Tensor]]:
    """Match every set of queries (``logits`` (S, B, Q, nc), ``boxes`` (S, B, Q, 4)) to the batch's ``targets``
    (N, 6: image, class, cx, cy, w, h; rows grouped by image, as the loader gives them).

    Returns the matches of each set, the boxes per image, and the host index arrays ``extra`` makes of the boxes per
    image and the host matches (the denoising groups' fixed pairs, D-FINE's union of the matches) on the device,
    copied with the matches."""
    with torch.no_grad():
        cost = cost_matrices(logits.detach(), boxes.detach(), targets[:, 1].long(), targets[:, 2:6].float(), costs)
        host, per_image = host_costs(cost, targets[:, 0], per_image)
    found = solve(host, per_image)
    flat = [a for triple in found for a in triple] + (extra(per_image, found) if extra is not None else [])
    on_device = to_device(flat, logits.device)
    n = len(found)
    matches = Matches(on_device[0 : 3 * n : 3], on_device[1 : 3 * n : 3], on_device[2 : 3 * n : 3])
    return matches, per_image, on_device[3 * n :]
