"""--image-weights: per-image sampling weights from the classes' current difficulty, and the epoch's draw.

As in YOLOv5, a class weighs the inverse of its label frequency times ``(1 - mAP)**2`` of its last validation
(mAP 0 before the first), and an image weighs the sum of its labels' class weights, so images of rare or
poorly learnt classes are drawn more often. Images without labels weigh 0 and are not drawn while others
weigh more. The draw is a pure function of (seed, epoch, weights): every rank makes the same one and then takes
its own disjoint shard of it (see ``WeightedShardedSampler``), and a resumed run makes it again exactly.
"""

from __future__ import annotations

import zlib

import numpy as np


def labels_to_class_weights(labels: list[np.ndarray], nc: int) -> np.ndarray:
    """(nc,) inverse label frequency, normalised to sum 1; a class without labels counts as seen once."""
    classes = np.concatenate([lb[:, 0] for lb in labels if len(lb)] or [np.zeros(0)]).astype(int)
    counts = np.bincount(classes[(classes >= 0) & (classes < nc)], minlength=nc).astype(np.float64)
    counts[counts == 0] = 1  # an absent class would divide by zero; it draws no image anyway
    weights = 1.0 / counts
    return weights / weights.sum()


def class_weights_from_maps(base: np.ndarray, maps: np.ndarray) -> np.ndarray:
    """(nc,) class weights for the next epoch: ``base`` (inverse frequency) times ``(1 - mAP)**2``.

    (YOLOv5 also divides by nc, a constant factor that no draw can see.)
    """
    maps = np.clip(np.asarray(maps, dtype=np.float64), 0.0, 1.0)
    return np.asarray(base, dtype=np.float64) * (1.0 - maps) ** 2


def labels_to_image_weights(labels: list[np.ndarray], class_weights: np.ndarray) -> np.ndarray:
    """(n,) the sum of the class weights of each image's labels."""
    nc = len(class_weights)
    out = np.zeros(len(labels))
    for i, lb in enumerate(labels):
        if len(lb):
            counts = np.bincount(lb[:, 0].astype(int).clip(0, nc - 1), minlength=nc)
            out[i] = float(counts @ class_weights)
    return out


def weighted_draw(weights: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """``len(weights)`` image indices drawn with replacement, with probability proportional to ``weights``.

    Uniform when no weight is positive. The stream (seed, epoch, 17) is not the order shuffle's (seed, epoch).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    total = w.sum()
    p = w / total if total > 0 and np.isfinite(total) else None
    rng = np.random.default_rng([int(seed), int(epoch), 17])
    return rng.choice(n, size=n, replace=True, p=p).astype(np.int64)


def draw_digest(indices: np.ndarray) -> int:
    """A 32-bit checksum of a draw (ranks compare theirs with one all-reduce)."""
    return zlib.crc32(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
