"""Hungarian matching of a DETR's queries to an image's boxes, for every output set of a step at once.

The cost of query q for box g is the references' (RT-DETR, D-FINE): ``class * focal(q, class of g) + bbox * L1(q, g)
- giou * GIoU(q, g)``, boxes as centre and size in [0, 1], the focal class cost ``alpha (1 - p)^gamma (-log p) -
(1 - alpha) p^gamma (-log(1 - p))`` of the sigmoid score p of g's class (weights 2, 5, 2; alpha 0.25, gamma 2).

Every set that needs matching (each decoder layer's queries, D-FINE's pre-head, the encoder's top-k) is costed
against its image's boxes, padded to the most boxes of one image, in one (S, B, Q, M) tensor on the device, and that
tensor is copied to the host once: the step's one wait for the matching (docs/design.md, "Where the step may and may
not sync"). Where the boxes per image are not known on the host yet (validation), M is the batch's box count and the
boxes' image column comes in the same copy. scipy's ``linear_sum_assignment`` then solves each
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
    """(S, B, Q, M) generalised IoU of xyxy boxes ``a`` (S, B, Q, 4) and each image's ``b`` (B, M, 4)."""
    a, b = a[..., :, None, :], b[:, None, :, :]
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    inter = (torch.minimum(a[..., 2:], b[..., 2:]) - torch.maximum(a[..., :2], b[..., :2])).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    hull = (torch.maximum(a[..., 2:], b[..., 2:]) - torch.minimum(a[..., :2], b[..., :2])).clamp(min=0).prod(-1)
    return inter / union - (hull - union) / hull


def padded_boxes(targets: torch.Tensor, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's classes (B, M) and boxes (B, M, 4) from ``targets`` (rows grouped by image), padded to ``slots``
    with class 0 and a unit box; placed on the device by indices made there (nothing is read on the host)."""
    image = targets[:, 0].long()
    counts = torch.zeros(batch, dtype=torch.long, device=targets.device).index_add_(0, image, torch.ones_like(image))
    slot = torch.arange(len(image), device=targets.device) - (counts.cumsum(0) - counts)[image]
    labels = torch.zeros((batch, slots), dtype=torch.long, device=targets.device)
    boxes = torch.full((batch, slots, 4), 0.5, device=targets.device)
    labels[image, slot] = targets[:, 1].long()
    boxes[image, slot] = targets[:, 2:6].float()
    return labels, boxes


def cost_matrices(
    logits: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, gt_boxes: torch.Tensor, costs: MatchCosts
) -> torch.Tensor:
    """(S, B, Q, M) cost of each set's queries (``logits`` (S, B, Q, nc), ``boxes`` (S, B, Q, 4) cxcywh) for each
    of their image's boxes (``labels`` (B, M), ``gt_boxes`` (B, M, 4) cxcywh, padded), finite."""
    sets, batch, queries, _ = logits.shape
    index = labels[None, :, None, :].expand(sets, batch, queries, -1)
    prob = logits.float().gather(-1, index).sigmoid()
    positive = costs.alpha * (1 - prob) ** costs.gamma * -(prob + FOCAL_EPS).log()
    negative = (1 - costs.alpha) * prob**costs.gamma * -(1 - prob + FOCAL_EPS).log()
    boxes = boxes.float()
    l1 = (boxes[..., :, None, :] - gt_boxes[:, None, :, :]).abs().sum(-1)
    giou = pairwise_giou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(gt_boxes))
    cost = costs.class_weight * (positive - negative) + costs.bbox_weight * l1 - costs.giou_weight * giou
    largest = torch.finfo(cost.dtype).max
    return torch.nan_to_num(cost, nan=largest, posinf=largest, neginf=largest)


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def solve(cost: np.ndarray, per_image: list[int]) -> list[HostMatches]:
    """Each set's matches (image, query, box row) from the host costs (S, B, Q, M) and the boxes per image."""
    assign = linear_sum_assignment()
    starts = np.concatenate(([0], np.cumsum(per_image)))
    found = []
    for per_set in cost:
        images, queries, rows = [], [], []
        for b, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            if end == start:
                continue
            q, g = assign(per_set[b, :, : end - start])
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
        batch = logits.shape[1]
        # each image's boxes padded to the most of one image (the whole batch's count where that is not known yet)
        slots = max(per_image, default=0) if per_image is not None else targets.shape[0]
        labels, gt_boxes = padded_boxes(targets, batch, slots)
        cost = cost_matrices(logits.detach(), boxes.detach(), labels, gt_boxes, costs)
        host, per_image = host_costs(cost, targets[:, 0], per_image)
    found = solve(host, per_image)
    flat = [a for triple in found for a in triple] + (extra(per_image, found) if extra is not None else [])
    on_device = to_device(flat, logits.device)
    n = len(found)
    matches = Matches(on_device[0 : 3 * n : 3], on_device[1 : 3 * n : 3], on_device[2 : 3 * n : 3])
    return matches, per_image, on_device[3 * n :]
