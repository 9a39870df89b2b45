"""Build the DataLoader of one split for one rank (plain torch DataLoader + ShardedSampler)."""
from __future__ import annotations

import os
from typing import Any

import cv2
import torch
from torch.utils.data import DataLoader

from utils.dataset import YoloDataset
from utils.log import LOGGER
from utils.samplers import ShardedSampler


def _worker_init(_: int) -> None:
    # Each worker is one process: cv2's own thread pool there only oversubscribes the cores.
    cv2.setNumThreads(0)


def create_dataloader(
    path: str | list[str],
    imgsz: int,
    batch_size: int,
    stride: int,
    *,
    hyp: dict[str, Any] | None = None,
    augment: bool = False,
    cache: str | None = None,
    pad: float = 0.0,
    rect: bool = False,
    local_rank: int = -1,
    world_size: int = 1,
    global_rank: int = 0,
    workers: int = 8,
    shuffle: bool = False,
    seed: int = 0,
    single_cls: bool = False,
    nc: int | None = None,
    close_mosaic_epoch: int | None = None,
    prefix: str = "",
) -> tuple[DataLoader, YoloDataset]:
    """A DataLoader over this rank's shard and the dataset; ``batch_size`` is per rank.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch: it picks the epoch's order and its
    augmentation draws. Training loaders (``shuffle``) pad shards to equal length; others give each
    sample to exactly one rank. ``local_rank`` orders the label-cache build (-1 when not distributed).
    """
    if rect and shuffle:
        LOGGER.warning(f"{prefix}WARNING rect batches are incompatible with shuffle: shuffle disabled")
        shuffle = False
    dataset = YoloDataset(path, imgsz, batch_size, augment=augment, hyp=hyp, rect=rect, cache=cache,
                          single_cls=single_cls, stride=stride, pad=pad, nc=nc, seed=seed,
                          close_mosaic_epoch=close_mosaic_epoch, local_rank=local_rank, workers=workers,
                          prefix=prefix)
    batch_size = min(batch_size, len(dataset))
    sampler = ShardedSampler(len(dataset), world_size=world_size, rank=global_rank, shuffle=shuffle, seed=seed,
                             pad=shuffle or augment, block=batch_size if rect else 1)
    workers = max(0, min(workers, os.cpu_count() or 1, batch_size))
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=YoloDataset.collate_fn,
        persistent_workers=workers > 0,
        worker_init_fn=_worker_init if workers > 0 else None,
        drop_last=False,
    )
    return loader, dataset
