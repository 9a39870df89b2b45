"""Build the DataLoader of one split for one rank (torch DataLoader + ShardedSampler).

Training loaders stream epoch after epoch through one DataLoader iterator, so the workers prefetch the next
epoch's first batches while the current epoch ends instead of idling at every epoch boundary.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

from utils.data.batch_ring import BatchRing, RingSlot, shared_memory_fits
from utils.data.dataset import DatasetOptions, YoloDataset
from utils.data.label_table import LabelTable
from utils.data.labels import Split, load_labels
from utils.data.quad import QuadCollate
from utils.data.samplers import (
    EpochStreamBatchSampler,
    ShardedSampler,
    ShardPlan,
    ShardPlanSampler,
    WeightedShardedSampler,
    epoch_batches,
)
from utils.data.shard_dataset import DEFAULT_WINDOW, ShardDataset
from utils.data.webshards import ShardLabelSet
from utils.log import LOGGER

PREFETCH_BATCHES = 2  # per worker (DataLoader's prefetch_factor); BatchRing's slot count follows from it
HANDOFF_AHEAD = 1  # batches copied out of the ring ahead of the step (each is a copy held in memory)


def _worker_init(_: int) -> None:
    # Each worker is one process: cv2's own thread pool there only oversubscribes the cores.
    cv2.setNumThreads(0)


class EpochStreamLoader:
    """One epoch of batches per iteration, drawn from a DataLoader that streams epoch after epoch.

    ``set_epoch(e, start_batch)`` picks the epoch the next iteration yields and the batch it starts at (0, or
    where a checkpoint written inside the epoch left off). When the stream already stands at the start of that
    epoch (the previous iteration ran to its end and ``e`` is the next epoch) the prefetched batches are used;
    otherwise (first use, resume, a skipped or repeated epoch, an iteration left early) the stream restarts at
    ``e``. Either way an iteration yields exactly what a plain DataLoader over ``sampler`` would for that epoch,
    from ``start_batch`` on.
    """

    def __init__(
        self,
        dataset: YoloDataset,
        batch_sampler: EpochStreamBatchSampler,
        options: dict[str, Any],
        ring: BatchRing | None = None,
    ):
        self.dataset, self.batch_sampler, self.options, self.ring = dataset, batch_sampler, options, ring
        self.loader = DataLoader(dataset, batch_sampler=batch_sampler, **options)
        self.sampler: ShardedSampler | ShardPlanSampler = batch_sampler.sampler
        self._batches: Iterator[Any] | None = None
        self._stream_at: tuple[int, int] | None = None  # (epoch, batch) the stream yields next; None: unknown
        self.start_batch = 0
        # Where CUDA trains (pinned memory), batches leave the ring in a thread of their own (``_handed_off``);
        # on the CPU the copy is cheap beside the step and the thread would only take a core from it.
        self.copy_in_thread = bool(options.get("pin_memory"))

    def start(self, epoch: int, start_batch: int = 0) -> None:
        """Start the workers now on the batches of ``epoch`` from ``start_batch``, which the next iteration over
        that epoch takes: a run's set-up goes on while the first batches are made."""
        self.sampler.set_epoch(epoch)
        self._restart(epoch, start_batch)

    def close(self) -> None:
        """End the stream and its workers (after the last epoch: no batches of an epoch that will not run). The
        loader stays usable: a later iteration starts new workers."""
        batches, self._batches, self._stream_at = self._batches, None, None
        if self.loader.num_workers > 0:
            shutdown = getattr(batches, "_shutdown_workers", None)  # torch's; dropping the iterator does it later
            if shutdown is not None:
                shutdown()
            self.loader = DataLoader(self.dataset, batch_sampler=self.batch_sampler, **self.options)

    def _restart(self, epoch: int, start_batch: int) -> None:
        self.batch_sampler.start_epoch, self.batch_sampler.start_batch = epoch, start_batch
        self._batches = iter(self.loader)  # persistent workers: drops what was in flight, then restarts
        self._stream_at = (epoch, start_batch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start_batch = start_batch
        if isinstance(self.sampler, ShardPlanSampler):
            # This epoch's samples, in the order this rank reads them: remote shards download while it trains.
            upcoming = self.sampler.shard(epoch)[start_batch * self.batch_sampler.batch_size :]
            self.dataset.source.prefetch(upcoming)

    def set_image_weights(self, weights: np.ndarray | None) -> None:
        """--image-weights: the per-image weights of the next epochs' draws (a WeightedShardedSampler only).

        Batches the stream prefetched were drawn with the old weights, so new weights restart it.
        """
        if not isinstance(self.sampler, WeightedShardedSampler):
            raise TypeError("image weights need a loader made with image_weights=True")
        if self.sampler.set_weights(weights):
            self._batches = None

    def update_dataset(self, **attributes: Any) -> None:
        """Set dataset attributes (such as ``close_mosaic_epoch``) for the batches not made yet.

        Persistent workers hold copies of the dataset made when they started, so they are replaced.
        """
        for name, value in attributes.items():
            setattr(self.dataset, name, value)
        if self.loader.num_workers > 0:
            self._batches, self._stream_at = None, None
            self.loader = DataLoader(self.dataset, batch_sampler=self.batch_sampler, **self.options)

    def __len__(self) -> int:
        """Batches in the current epoch (all of them, wherever the next iteration starts)."""
        return len(epoch_batches(self.sampler, self.batch_sampler.batch_size, self.sampler.epoch))

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.sampler.epoch, self.start_batch
        if self._batches is None or self._stream_at != (epoch, start):
            self._restart(epoch, start)
        self._stream_at, self.start_batch = None, 0
        n = len(self) - start
        yield from self._handed_off(n) if self.ring is not None and self.copy_in_thread else self._taken(n)
        self._stream_at = (epoch + 1, 0)

    def _taken(self, n: int) -> Iterator[Any]:
        assert self._batches is not None  # started by __iter__
        for _ in range(n):
            yield self._unring(next(self._batches))

    def _unring(self, batch: Any) -> Any:
        """A batch with its images copied out of their ring slot (pinned where CUDA takes them), before the next
        batch is asked for: see BatchRing."""
        if isinstance(batch[0], RingSlot):
            assert self.ring is not None  # slots come only from workers given the ring
            images = self.ring.take(batch[0], pin_memory=self.loader.pin_memory).permute(0, 3, 1, 2)
            batch = (images, *batch[1:])
        return batch

    def _handed_off(self, n: int) -> Iterator[Any]:
        """``n`` batches copied out of the ring by a thread of their own, one batch ahead of the training step, so
        that the copy (tens of MB per batch at 640) overlaps the step instead of preceding it."""
        ready: queue.Queue = queue.Queue(maxsize=HANDOFF_AHEAD)
        stop = threading.Event()

        batches = self._batches
        assert batches is not None  # started by __iter__

        def hand_off() -> None:
            try:
                for _ in range(n):
                    if not _offer(ready, self._unring(next(batches)), stop):
                        return
            except BaseException as e:  # raised again in the training thread, where the batch was wanted
                _offer(ready, _Failed(e), stop)

        thread = threading.Thread(target=hand_off, name="batch-hand-off", daemon=True)
        thread.start()
        try:
            for _ in range(n):
                batch = ready.get()
                if isinstance(batch, _Failed):
                    raise batch.error
                yield batch
        finally:  # also when the epoch is left early: the stream may restart only once the thread has stopped
            stop.set()
            thread.join()


def end_workers(loader: DataLoader | EpochStreamLoader | None) -> None:
    """End a loader's worker processes now (a persistent DataLoader keeps them until it is garbage collected, which
    may be at the interpreter's exit, where torch leaves them to be terminated one by one)."""
    if isinstance(loader, EpochStreamLoader):
        loader.close()
        return
    iterator = getattr(loader, "_iterator", None)  # torch's persistent-workers iterator
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        loader._iterator = None  # type: ignore[union-attr]  # a fresh iteration starts new workers


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def _offer(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` once there is room; False when ``stop`` was set first (nobody takes batches any more)."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def build_dataset(
    label_set: LabelTable, imgsz: int, batch_size: int, options: DatasetOptions, plan: ShardPlan | None = None
) -> YoloDataset:
    """The dataset of a verified split: a ShardDataset for shards, else a YoloDataset."""
    if isinstance(label_set, ShardLabelSet):
        return ShardDataset(imgsz, batch_size, options, plan=plan, label_set=label_set)
    return YoloDataset(None, imgsz, batch_size, options, label_set=label_set)


@dataclass(frozen=True)
class LoaderOptions(DatasetOptions):
    """``create_dataloader``'s options besides the split, the image size, the batch size and the stride: how samples
    are made (the dataset's own options, which the dataset reads from this object) and how they are shared out.

    ``workers`` caps both the loader's worker processes (also by the cores and the batch) and the dataset's threads
    that read labels and fill caches; ``stride`` and ``decode_threads`` are set by ``create_dataloader``."""

    world_size: int = 1
    global_rank: int = 0
    shuffle: bool = False  # an epoch's order and its augmentation draws are functions of (seed, epoch)
    image_weights: bool = False  # training: each epoch a weighted draw (``EpochStreamLoader.set_image_weights``)
    quad: bool = False  # training, not rect: batches of four merged samples at twice the size (quad.py)
    shard_window: int = DEFAULT_WINDOW  # shards: samples shuffled within a window of this many
    resampled: bool = False  # shards: WebDataset-style approximate epochs


def create_dataloader(
    path: Split | None,
    imgsz: int,
    batch_size: int,
    stride: int,
    options: LoaderOptions | None = None,
    *,
    label_set: LabelTable | None = None,
    **fields: Any,
) -> tuple[DataLoader | EpochStreamLoader, YoloDataset]:
    """A loader over this rank's shard and the dataset; ``batch_size`` is per rank; the options are one
    :class:`LoaderOptions`, or its fields given as keywords.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch: it picks the epoch's order and its
    augmentation draws. Training loaders (``augment``) pad shards to equal length and are an
    EpochStreamLoader; others give each sample to exactly one rank and are a plain DataLoader.
    ``label_set`` (already loaded labels) replaces reading them from ``path``.

    Shards (``path`` a ShardSet, or ``label_set`` a ShardLabelSet): training follows a ShardPlan (exact epochs,
    shard order and a window of ``shard_window`` samples shuffled; ``resampled`` for WebDataset-style approximate
    epochs); validation gives each rank a disjoint part, as for files.
    """
    o = options if options is not None else LoaderOptions(**fields)
    if o.rect and o.shuffle:
        LOGGER.warning(f"{o.prefix}WARNING rect batches are incompatible with shuffle: shuffle disabled")
        o = dataclasses.replace(o, shuffle=False)
    cpus = os.cpu_count() or 1
    loader_workers = max(0, min(o.workers, cpus, batch_size))
    # Without worker processes the mosaic tiles are decoded in threads of this process, sharing its cores.
    decode_threads = 1 if loader_workers else max(1, min(4, cpus // max(1, o.world_size)))
    if label_set is None:
        assert path is not None, "a loader needs a split or its labels"
        label_set = load_labels(path, nc=o.nc, workers=o.workers, prefix=o.prefix)
    plan = None
    if isinstance(label_set, ShardLabelSet) and o.augment and not o.rect:
        plan = ShardPlan(
            label_set.shard_counts, seed=o.seed, window=o.shard_window, shuffle=o.shuffle, resampled=o.resampled
        )
    # The dataset reads its own fields of the options; what only the loader knows is set here.
    dataset = build_dataset(
        label_set, imgsz, batch_size, dataclasses.replace(o, stride=stride, decode_threads=decode_threads), plan=plan
    )
    batch_size = min(batch_size, len(dataset))
    sampler = _sampler(len(dataset), plan, batch_size, o)
    loader_workers = min(loader_workers, batch_size)
    common: dict[str, Any] = {
        "num_workers": loader_workers,
        "pin_memory": torch.cuda.is_available(),
        "collate_fn": YoloDataset.collate_fn,
        "persistent_workers": loader_workers > 0,
        "worker_init_fn": _worker_init if loader_workers > 0 else None,
    }
    if not o.augment:  # validation: one pass, each sample once
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False, **common), dataset
    return _training_loader(dataset, sampler, (batch_size, imgsz), common, o), dataset


def _sampler(n: int, plan: ShardPlan | None, batch_size: int, o: LoaderOptions) -> ShardedSampler | ShardPlanSampler:
    """Which samples this rank reads, epoch by epoch: a shard plan's, a weighted draw's or a plain sharding."""
    if plan is not None:
        if o.image_weights:
            raise ValueError("--image-weights draws images by index and is not available for tar shards")
        return ShardPlanSampler(plan, world_size=o.world_size, rank=o.global_rank)
    if o.image_weights and o.augment and not o.rect:
        return WeightedShardedSampler(n, world_size=o.world_size, rank=o.global_rank, seed=o.seed)
    return ShardedSampler(
        n,
        world_size=o.world_size,
        rank=o.global_rank,
        shuffle=o.shuffle,
        seed=o.seed,
        pad=o.shuffle or o.augment,
        block=batch_size if o.rect else 1,
    )


def _training_loader(
    dataset: YoloDataset,
    sampler: ShardedSampler | ShardPlanSampler,
    batch_imgsz: tuple[int, int],
    common: dict[str, Any],
    o: LoaderOptions,
) -> EpochStreamLoader:
    """The stream of training batches: quad batches, or batches handed over in shared-memory slots by workers."""
    batch_size, imgsz = batch_imgsz
    loader_workers = common["num_workers"]
    stream = EpochStreamBatchSampler(sampler, batch_size)
    ring = None
    if loader_workers > 0:
        common["prefetch_factor"] = PREFETCH_BATCHES
    if o.quad and not o.rect:
        common["collate_fn"] = QuadCollate(o.seed)  # images change size: no BatchRing
    elif loader_workers > 0 and not o.rect:
        # Training samples are all imgsz x imgsz here (mosaic or letterbox; rect batches vary).
        shape_hwc = (imgsz, imgsz, 3)
        slots = PREFETCH_BATCHES + 1  # one more than a worker can have in flight: see BatchRing
        if shared_memory_fits(BatchRing.nbytes(loader_workers, slots, batch_size, shape_hwc)):
            ring = BatchRing(loader_workers, slots, batch_size, shape_hwc)
            common["collate_fn"] = partial(YoloDataset.collate_fn, ring=ring)
    return EpochStreamLoader(dataset, stream, common, ring)
