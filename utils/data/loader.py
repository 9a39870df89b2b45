"""Build the DataLoader of one split for one rank (torch DataLoader + ShardedSampler).

Training loaders stream epoch after epoch through one DataLoader iterator, so the workers prefetch the next
epoch's first batches while the current epoch ends instead of idling at every epoch boundary.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import cv2
import torch
from torch.utils.data import DataLoader

from utils.data.batch_ring import BatchRing, RingSlot, shared_memory_fits
from utils.data.dataset import YoloDataset
from utils.log import LOGGER
from utils.data.samplers import EpochStreamBatchSampler, ShardedSampler, epoch_batches


PREFETCH_BATCHES = 2  # per worker (DataLoader's prefetch_factor); BatchRing's slot count follows from it


def _worker_init(_: int) -> None:
    # Each worker is one process: cv2's own thread pool there only oversubscribes the cores.
    cv2.setNumThreads(0)


class EpochStreamLoader:
    """One epoch of batches per iteration, drawn from a DataLoader that streams epoch after epoch.

    ``sampler`` is the ShardedSampler: ``sampler.set_epoch(e)`` picks the epoch the next iteration yields.
    When the stream already stands at the start of that epoch (the previous iteration ran to its end and
    ``e`` is the next epoch) the prefetched batches are used; otherwise (first use, resume, a skipped or
    repeated epoch, an iteration left early) the stream restarts at ``e``. Either way an iteration yields
    exactly what a plain DataLoader over ``sampler`` would for that epoch.
    """

    def __init__(self, loader: DataLoader, batch_sampler: EpochStreamBatchSampler, ring: BatchRing | None = None):
        self.loader, self.batch_sampler, self.ring = loader, batch_sampler, ring
        self.sampler: ShardedSampler = batch_sampler.sampler
        self.dataset = loader.dataset
        self._batches: Iterator[Any] | None = None
        self._next_epoch: int | None = None  # the epoch the stream starts next; None: mid-epoch or not started

    def __len__(self) -> int:
        """Batches in the current epoch."""
        return len(epoch_batches(self.sampler, self.batch_sampler.batch_size, self.sampler.epoch))

    def __iter__(self) -> Iterator[Any]:
        epoch = self.sampler.epoch
        if self._batches is None or self._next_epoch != epoch:
            self.batch_sampler.start_epoch = epoch
            self._batches = iter(self.loader)  # persistent workers: drops what was in flight, then restarts
        self._next_epoch = None
        for _ in range(len(self)):
            batch = next(self._batches)
            if isinstance(batch[0], RingSlot):  # copied out before the next batch is asked for: see BatchRing
                images = self.ring.take(batch[0], pin_memory=self.loader.pin_memory).permute(0, 3, 1, 2)
                batch = (images, *batch[1:])
            yield batch
        self._next_epoch = epoch + 1


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
) -> tuple[DataLoader | EpochStreamLoader, YoloDataset]:
    """A loader over this rank's shard and the dataset; ``batch_size`` is per rank.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch: it picks the epoch's order and its
    augmentation draws. Training loaders (``shuffle``) pad shards to equal length and are an
    EpochStreamLoader; others give each sample to exactly one rank and are a plain DataLoader.
    ``local_rank`` orders the label-cache build (-1 when not distributed).
    """
    if rect and shuffle:
        LOGGER.warning(f"{prefix}WARNING rect batches are incompatible with shuffle: shuffle disabled")
        shuffle = False
    cpus = os.cpu_count() or 1
    loader_workers = max(0, min(workers, cpus, batch_size))
    # Without worker processes the mosaic tiles are decoded in threads of this process, sharing its cores.
    decode_threads = 1 if loader_workers else max(1, min(4, cpus // max(1, world_size)))
    dataset = YoloDataset(path, imgsz, batch_size, augment=augment, hyp=hyp, rect=rect, cache=cache,
                          single_cls=single_cls, stride=stride, pad=pad, nc=nc, seed=seed,
                          close_mosaic_epoch=close_mosaic_epoch, local_rank=local_rank, workers=workers,
                          decode_threads=decode_threads, prefix=prefix)
    batch_size = min(batch_size, len(dataset))
    sampler = ShardedSampler(len(dataset), world_size=world_size, rank=global_rank, shuffle=shuffle, seed=seed,
                             pad=shuffle or augment, block=batch_size if rect else 1)
    loader_workers = min(loader_workers, batch_size)
    common: dict[str, Any] = dict(num_workers=loader_workers, pin_memory=torch.cuda.is_available(),
                                  collate_fn=YoloDataset.collate_fn, persistent_workers=loader_workers > 0,
                                  worker_init_fn=_worker_init if loader_workers > 0 else None)
    if not shuffle:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False, **common), dataset
    stream = EpochStreamBatchSampler(sampler, batch_size)
    ring = None
    if loader_workers > 0:
        common["prefetch_factor"] = PREFETCH_BATCHES
        # Training samples are all imgsz x imgsz (mosaic or letterbox; rect training never comes here).
        shape_hwc = (imgsz, imgsz, 3)
        slots = PREFETCH_BATCHES + 1  # one more than a worker can have in flight: see BatchRing
        if shared_memory_fits(BatchRing.nbytes(loader_workers, slots, batch_size, shape_hwc)):
            ring = BatchRing(loader_workers, slots, batch_size, shape_hwc)
            common["collate_fn"] = partial(YoloDataset.collate_fn, ring=ring)
    return EpochStreamLoader(DataLoader(dataset, batch_sampler=stream, **common), stream, ring), dataset
