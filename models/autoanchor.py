"""AutoAnchor: measure how well the Detect anchors fit a dataset's boxes and refit them when they do not.

A box fits an anchor when neither side is more than ``thr`` times larger or smaller than the anchor's, the
same rule the loss uses to assign targets. Best possible recall (BPR) is the fraction of boxes that fit at
least one anchor. Everything here is deterministic, so every DDP rank reaches the same anchors.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn as nn

from models.heads import Detect
from utils.distributed import de_parallel
from utils.log import LOGGER, colorstr

PREFIX = "AutoAnchor: "
BPR_GOOD_ENOUGH = 0.98
MIN_BOX_PX = 2.0  # boxes smaller than this on either side say nothing useful about anchor shapes


def _worst_log_ratio(log_wh: np.ndarray, log_anchors: np.ndarray) -> np.ndarray:
    """(n, k) larger of |log(w / anchor w)| and |log(h / anchor h)|: 0 is a perfect fit."""
    gap_w = np.abs(log_wh[:, 0:1] - log_anchors[:, 0])
    gap_h = np.abs(log_wh[:, 1:2] - log_anchors[:, 1])
    return np.maximum(gap_w, gap_h)


def anchor_metrics(wh: np.ndarray, anchors: np.ndarray, thr: float) -> tuple[float, float]:
    """(best possible recall, mean number of anchors above threshold per box) of pixel ``anchors`` on ``wh``."""
    above = _worst_log_ratio(np.log(wh), np.log(anchors)) < np.log(thr)
    return float(above.any(1).mean()), float(above.sum(1).mean())


def _fitness(log_wh: np.ndarray, log_anchors: np.ndarray, log_thr: float) -> float:
    """Mean best fit over boxes, counting boxes that fit no anchor as 0: what the evolution maximises."""
    gap = _worst_log_ratio(log_wh, log_anchors).min(1)
    return float(np.exp(-gap[gap < log_thr]).sum() / len(gap))


def anchor_fitness(wh: np.ndarray, anchors: np.ndarray, thr: float) -> float:
    return _fitness(np.log(wh), np.log(anchors), float(np.log(thr)))


def _kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; returns (k, d) centroids."""
    centroids = np.empty((k, x.shape[1]))
    centroids[0] = x[rng.integers(len(x))]
    nearest_sq = ((x - centroids[0]) ** 2).sum(1)
    for i in range(1, k):
        total = nearest_sq.sum()
        pick = rng.choice(len(x), p=nearest_sq / total) if total > 0 else rng.integers(len(x))
        centroids[i] = x[pick]
        nearest_sq = np.minimum(nearest_sq, ((x - centroids[i]) ** 2).sum(1))

    for _ in range(iters):
        dist_sq = ((x[:, None, :] - centroids[None]) ** 2).sum(2)
        assign = dist_sq.argmin(1)
        counts = np.bincount(assign, minlength=k)
        sums = np.zeros_like(centroids)
        np.add.at(sums, assign, x)
        updated = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centroids)
        empty = np.flatnonzero(counts == 0)
        if len(empty):  # re-seed empty clusters at the points worst served by their centroid
            worst = np.argsort(-dist_sq[np.arange(len(x)), assign])[: len(empty)]
            updated[empty] = x[worst]
        if np.allclose(updated, centroids):
            break
        centroids = updated
    return centroids


def kmean_anchors(
    wh: np.ndarray,
    n: int = 9,
    img_size: int = 640,
    thr: float = 4.0,
    gen: int = 1000,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Fit ``n`` anchors (pixels, sorted by area) to box sizes ``wh`` (m, 2) in pixels at ``img_size``.

    k-means on whitened sizes gives a start; a hill-climbing evolution of ``gen`` multiplicative mutations then
    maximises ``anchor_fitness``. The same ``rng`` seed gives the same anchors.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 2)
    small = (wh < MIN_BOX_PX).any(1)
    if small.any():
        LOGGER.info(f"{PREFIX}ignoring {int(small.sum())} of {len(wh)} boxes smaller than {MIN_BOX_PX:g} pixels")
    wh = wh[~small]
    if len(wh) < n:
        raise ValueError(f"k-means needs at least {n} boxes of {MIN_BOX_PX:g}+ pixels, got {len(wh)}")

    scale = wh.std(0)
    scale[scale == 0] = 1.0  # all boxes equally wide (or tall): nothing to whiten
    anchors = _kmeans(wh / scale, n, rng) * scale
    anchors = np.clip(anchors, MIN_BOX_PX, None)

    # The evolution's hot loop works on logs in float32: much faster than the plain ratio form.
    log_wh = np.log(wh).astype(np.float32)
    log_thr = float(np.log(thr))
    best = _fitness(log_wh, np.log(anchors).astype(np.float32), log_thr)
    start = best
    mutation_prob, sigma = 0.9, 0.1
    for _ in range(gen):
        factor = np.ones_like(anchors)
        while (factor == 1).all():  # a mutation that changes nothing is wasted work
            mutate = rng.random(anchors.shape) < mutation_prob
            factor = (mutate * rng.random() * rng.standard_normal(anchors.shape) * sigma + 1).clip(0.3, 3.0)
        candidate = np.clip(anchors * factor, MIN_BOX_PX, None)
        fitness = _fitness(log_wh, np.log(candidate).astype(np.float32), log_thr)
        if fitness > best:
            best, anchors = fitness, candidate

    anchors = anchors[np.argsort(anchors.prod(1))]
    bpr, aat = anchor_metrics(wh, anchors, thr)
    LOGGER.info(
        f"{PREFIX}k-means + {gen} generations on {len(wh)} boxes at {img_size}px: fitness {start:.4f} -> "
        f"{best:.4f}, BPR {bpr:.4f}, {aat:.2f} anchors/target, anchors "
        + ", ".join(f"{w:.0f}x{h:.0f}" for w, h in anchors)
    )
    return anchors


def dataset_box_sizes(dataset: Any, imgsz: int, rng: np.random.Generator) -> np.ndarray:
    """Pixel (w, h) of every labelled box with the image's long side at ``imgsz``, randomly rescaled 0.9-1.1."""
    shapes = np.asarray(dataset.shapes, dtype=np.float64).reshape(-1, 2)
    image_sizes = imgsz * shapes / shapes.max(1, keepdims=True)
    scales = rng.uniform(0.9, 1.1, size=(len(shapes), 1))
    sizes = [
        np.asarray(labels, dtype=np.float64).reshape(-1, 5)[:, 3:5] * size
        for size, labels in zip(image_sizes * scales, dataset.labels)
    ]
    wh = np.concatenate(sizes, 0) if sizes else np.zeros((0, 2))
    return wh[(wh > 0).all(1)]


def anchor_order_matches_stride(detect: Detect) -> bool:
    """True when the mean pixel anchor area grows with the stride across levels."""
    stride = detect.stride.detach().cpu().double()
    area = (detect.anchors.detach().cpu().double() * stride.view(-1, 1, 1)).prod(-1).mean(-1)
    ordered = area[torch.argsort(stride)]
    return bool((ordered[1:] >= ordered[:-1]).all())


def set_anchors(detect: Detect, anchors_px: np.ndarray) -> None:
    """Write (nl * na, 2) pixel anchors into ``detect.anchors`` in place: smallest to the finest stride."""
    nl, na = detect.nl, detect.na
    anchors_px = anchors_px[np.argsort(anchors_px.prod(1))].reshape(nl, na, 2)
    stride = detect.stride.detach().cpu().double()
    levels = torch.argsort(stride)
    new = torch.empty(nl, na, 2, dtype=torch.float64)
    new[levels] = torch.from_numpy(anchors_px) / stride[levels].view(-1, 1, 1)
    with torch.no_grad():
        detect.anchors.copy_(new.to(detect.anchors))  # in place: EMA and DDP keep pointing at this buffer
    if not anchor_order_matches_stride(detect):
        raise RuntimeError("anchors were written out of stride order")


def check_anchors(dataset: Any, model: nn.Module, thr: float = 4.0, imgsz: int = 640) -> bool:
    """Log the anchors' BPR on ``dataset``; below 0.98, refit them with k-means and keep the better set.

    Returns True when the Detect anchors were replaced.
    """
    net: Any = de_parallel(model)  # a Model: its layers are untyped nn.Module attributes
    detect = cast(Detect, net.model[-1])  # YOLOv5's models: the only ones with anchors
    rng = np.random.default_rng(0)
    wh = dataset_box_sizes(dataset, imgsz, rng)
    stride = detect.stride.detach().cpu().double().view(-1, 1, 1)
    current = (detect.anchors.detach().cpu().double() * stride).view(-1, 2).numpy()
    if len(wh) == 0:
        LOGGER.warning(f"{PREFIX}no labelled boxes in the dataset, anchors left as they are")
        return False

    bpr, aat = anchor_metrics(wh, current, thr)
    verdict = "current anchors fit the dataset" if bpr >= BPR_GOOD_ENOUGH else "refitting anchors"
    LOGGER.info(f"{colorstr(PREFIX)}{aat:.2f} anchors/target, {bpr:.3f} best possible recall (BPR): {verdict}")
    if not anchor_order_matches_stride(detect):
        LOGGER.warning(f"{PREFIX}anchor sizes do not grow with the stride")
    if bpr >= BPR_GOOD_ENOUGH:
        return False

    usable = int((wh >= MIN_BOX_PX).all(1).sum())
    n = detect.nl * detect.na
    if usable < n:
        LOGGER.warning(f"{PREFIX}only {usable} boxes of {MIN_BOX_PX:g}+ pixels, too few to fit {n} anchors")
        return False
    anchors = kmean_anchors(wh, n=n, img_size=imgsz, thr=thr, gen=1000, rng=rng)
    new_bpr, _ = anchor_metrics(wh, anchors, thr)
    if new_bpr <= bpr:
        LOGGER.info(f"{PREFIX}refitted anchors reach BPR {new_bpr:.3f}, not better: keeping the current ones")
        return False
    set_anchors(detect, anchors)
    LOGGER.info(f"{PREFIX}new anchors written to the model (BPR {bpr:.3f} -> {new_bpr:.3f})")
    return True
