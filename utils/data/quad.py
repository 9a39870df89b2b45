"""--quad: merge every four training samples into one at twice the size (YOLOv5's collate_fn4 semantics).

Each group of four becomes, with probability 1/2, the first image upsampled 2x (bilinear) with its own labels,
otherwise a 2x2 tile: sample 0 top-left, 1 bottom-left, 2 top-right, 3 bottom-right, with the normalised
labels offset into their quarter and halved. The model sees a quarter of the images at twice the resolution.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

# Offsets (in image units, before halving) of each tile's labels: (x, y).
_TILE_OFFSETS = ((0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0))


def quad_collate(batch: Sequence[tuple], rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """``(imgs uint8 (b//4, 3, 2h, 2w), targets (n, 6) [image, cls, x, y, w, h], paths, shapes)`` of a batch of
    ``(img uint8 3xHxW, labels (n, 6), path, shapes)`` samples of one size; paths and shapes are the first
    sample's of each group. Samples past the last full group are dropped, except that a batch of fewer than
    four makes one upsampled image (an epoch's short last batch still trains).
    """
    imgs, labels, paths, shapes = zip(*batch)
    groups = max(len(imgs) // 4, 1)
    out_imgs, out_labels = [], []
    for g in range(groups):
        k = 4 * g
        if k + 3 >= len(imgs) or rng.random() < 0.5:
            big = F.interpolate(imgs[k][None].float(), scale_factor=2.0, mode="bilinear", align_corners=False)[0]
            out_imgs.append(big.round().clamp(0, 255).to(imgs[k].dtype))
            out_labels.append(labels[k].clone())
        else:
            left = torch.cat((imgs[k], imgs[k + 1]), 1)  # dim 1 is the height: 0 above 1
            right = torch.cat((imgs[k + 2], imgs[k + 3]), 1)
            out_imgs.append(torch.cat((left, right), 2))
            parts = []
            for j, (dx, dy) in enumerate(_TILE_OFFSETS):
                lb = labels[k + j].clone()
                lb[:, 2] = (lb[:, 2] + dx) * 0.5
                lb[:, 3] = (lb[:, 3] + dy) * 0.5
                lb[:, 4:6] *= 0.5
                parts.append(lb)
            out_labels.append(torch.cat(parts, 0))
    for i, lb in enumerate(out_labels):
        lb[:, 0] = i
    firsts = range(0, 4 * groups, 4)
    return (
        torch.stack(out_imgs, 0),
        torch.cat(out_labels, 0),
        tuple(paths[k] for k in firsts),
        tuple(shapes[k] for k in firsts),
    )


class QuadCollate:
    """``quad_collate`` as a DataLoader collate_fn (picklable for workers).

    Its draw comes from the seed and the batch itself (file names and augmented labels), so a batch collates
    the same way in any worker, on any rank, and again after a resume.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed

    def __call__(self, batch: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
        key = zlib.crc32("\n".join(str(b[2]) for b in batch).encode())
        key = zlib.crc32(b"".join(b[1].numpy().tobytes() for b in batch), key)
        return quad_collate(batch, np.random.default_rng([self.seed, key]))
