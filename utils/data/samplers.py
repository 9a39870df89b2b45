"""One sampler for one process or many: shuffles by (seed, epoch), shards by rank, yields (epoch, index).

The epoch travels with every index, so persistent DataLoader workers draw each sample's augmentation
from ``(seed, epoch, index)`` without being told about epochs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


class ShardedSampler(Sampler[tuple[int, int]]):
    """Indices of this rank's shard for the current epoch, as ``(epoch, index)`` pairs.

    Indices are grouped in blocks of ``block`` consecutive indices (1 for shuffled training; the batch
    size for rectangular batches, so that a batch never mixes two batch shapes). Blocks are shuffled by
    a torch.Generator seeded from (seed, epoch) when ``shuffle``, then dealt to ranks:

    * ``pad=True`` (training): the block list is padded by repeating from its start until every rank
      gets the same number of blocks; blocks are dealt round-robin.
    * ``pad=False`` (validation): each rank gets a contiguous run of blocks; the shards are disjoint and
      together hold every index exactly once (some ranks may get fewer, even none).
    """

    def __init__(
        self,
        n: int,
        world_size: int = 1,
        rank: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        pad: bool = True,
        block: int = 1,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not valid for world size {world_size}")
        self.n, self.world_size, self.rank = n, world_size, rank
        self.shuffle, self.seed, self.pad, self.block = shuffle, seed, pad, max(1, block)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order (and augmentation draws) the next iteration yields."""
        self.epoch = int(epoch)

    def _blocks(self, epoch: int) -> list[list[int]]:
        blocks = [list(range(i, min(i + self.block, self.n))) for i in range(0, self.n, self.block)]
        if self.shuffle and blocks:
            g = torch.Generator()
            # SeedSequence mixes (seed, epoch) so that e.g. (0, 1) and (1, 0) give unrelated orders.
            g.manual_seed(int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, np.uint64)[0] >> 1))
            blocks = [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]
        return blocks

    def shard(self, epoch: int | None = None) -> list[int]:
        """This rank's indices for ``epoch`` (default: the current epoch)."""
        blocks = self._blocks(self.epoch if epoch is None else int(epoch))
        if not blocks:
            return []
        per_rank = math.ceil(len(blocks) / self.world_size)
        if self.pad:
            total = per_rank * self.world_size
            padded = (blocks * math.ceil(total / len(blocks)))[:total]
            mine = padded[self.rank :: self.world_size]
        else:
            mine = blocks[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [i for b in mine for i in b]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return iter([(epoch, i) for i in self.shard()])

    def __len__(self) -> int:
        return len(self.shard()) if self.block > 1 or not self.pad else math.ceil(self.n / self.world_size)


def epoch_batches(
    sampler: ShardedSampler | ShardPlanSampler, batch_size: int, epoch: int
) -> list[list[tuple[int, int]]]:
    """One epoch of ``sampler``'s shard cut into batches; only the last one may be short."""
    pairs = [(epoch, i) for i in sampler.shard(epoch)]
    return [pairs[i : i + batch_size] for i in range(0, len(pairs), batch_size)]


class EpochStreamBatchSampler:
    """Batches of ``(epoch, index)`` pairs for epoch ``start_epoch``, then the next epoch, and so on forever.

    Used as a DataLoader ``batch_sampler`` so that its workers keep working across epoch ends. Batches are
    cut per epoch, so none mixes two epochs; each epoch's batches equal ``epoch_batches`` for that epoch.
    ``start_epoch`` and ``start_batch`` (where a resumed epoch goes on) are read when an iteration starts.
    """

    def __init__(self, sampler: ShardedSampler | ShardPlanSampler, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be at least 1")
        self.sampler, self.batch_size, self.start_epoch, self.start_batch = sampler, batch_size, 0, 0

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return self._stream(self.start_epoch, self.start_batch)

    def _stream(self, epoch: int, skip: int) -> Iterator[list[tuple[int, int]]]:
        while batches := epoch_batches(self.sampler, self.batch_size, epoch):
            yield from batches[skip:]
            epoch, skip = epoch + 1, 0


class WeightedShardedSampler(ShardedSampler):
    """``ShardedSampler`` for --image-weights: each epoch's global index list is a weighted draw.

    The draw (``utils.data.image_weights.weighted_draw``) depends only on (seed, epoch, weights), so every rank
    makes the same list and is dealt its disjoint, equally long part of it, as ``ShardedSampler`` deals a
    shuffled order. Without weights (``set_weights(None)``) it is a plain shuffling ``ShardedSampler``.
    """

    def __init__(self, n: int, world_size: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(n, world_size=world_size, rank=rank, shuffle=True, seed=seed, pad=True, block=1)
        self.weights: np.ndarray | None = None

    def set_weights(self, weights: np.ndarray | None) -> bool:
        """Use ``weights`` (one per index) from the next draw on; True when they differ from the current ones."""
        new = None if weights is None else np.asarray(weights, dtype=np.float64).copy()
        if new is not None and len(new) != self.n:
            raise ValueError(f"{len(new)} image weights for {self.n} images")
        changed = (new is None) != (self.weights is None) or (
            new is not None and self.weights is not None and not np.array_equal(new, self.weights)
        )
        self.weights = new
        return changed

    def global_draw(self, epoch: int) -> list[int]:
        """Every rank's indices of ``epoch`` together, before dealing."""
        return [i for b in self._blocks(epoch) for i in b]

    def _blocks(self, epoch: int) -> list[list[int]]:
        if self.weights is None:
            return super()._blocks(epoch)
        from utils.data.image_weights import weighted_draw

        return [[int(i)] for i in weighted_draw(self.weights, self.seed, epoch)]


# ---- shards: exact epochs with mostly sequential reads ------------------------------------------------------


class ShardPlan:
    """Which samples of a shard set each rank reads in an epoch, and in which order.

    Samples are numbered shard after shard (shard ``s`` holds ``counts[s]`` consecutive ids). An epoch's global
    order shuffles the shard order, then the samples inside consecutive windows of ``window`` samples, with a
    generator seeded from (seed, epoch) only: it is the same for every world size and number of workers.
    Reads stay sequential at the scale of a shard while samples still mix across about ``window`` of them.

    Exact mode (default): the order is padded from its start, as DistributedSampler pads, to a multiple of the
    world size (fewer than ``world_size`` extra samples), and rank ``r`` takes the ``r``-th contiguous slice,
    so every sample is used once per epoch and every rank has the same number of samples by construction.

    Resampled mode (``resampled=True``): each rank draws shards with replacement from (seed, epoch, rank) until
    it has its share; an approximate epoch (some samples twice, some not at all), as WebDataset's
    ``resampled=True`` + ``with_epoch`` gives, but still with equal lengths per rank.
    """

    def __init__(
        self,
        counts: list[int] | np.ndarray,
        seed: int = 0,
        window: int = 1000,
        shuffle: bool = True,
        resampled: bool = False,
    ):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)))[:-1]
        self.n = int(self.counts.sum())
        self.seed, self.window, self.shuffle, self.resampled = seed, max(1, int(window)), shuffle, resampled
        self._cached: tuple[int, np.ndarray] | None = None
        self._positions: tuple[int, np.ndarray] | None = None  # (epoch, where each sample sits in the order)

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *keys])

    def _windowed(self, shard_order: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        parts = [np.arange(self.starts[s], self.starts[s] + self.counts[s]) for s in shard_order]
        order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.shuffle:
            for w in range(0, len(order), self.window):
                order[w : w + self.window] = rng.permutation(order[w : w + self.window])
        return order

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's global order of sample ids (every id once; exact mode)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = self._rng(int(epoch))
        shard_order = rng.permutation(len(self.counts)) if self.shuffle else np.arange(len(self.counts))
        order = self._windowed(shard_order, rng)
        self._cached = (int(epoch), order)
        return order

    def per_rank(self, world_size: int) -> int:
        return math.ceil(self.n / world_size) if self.n else 0

    def rank_samples(self, epoch: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Sample ids rank ``rank`` reads in ``epoch``: the same length on every rank."""
        k = self.per_rank(world_size)
        if self.resampled:
            return self._resampled(epoch, rank, k)
        order = self.order(epoch)
        if not len(order):
            return order
        padded = np.resize(order, k * world_size)  # np.resize repeats from the start: DistributedSampler's padding
        return padded[rank * k : (rank + 1) * k]

    def _resampled(self, epoch: int, rank: int, k: int) -> np.ndarray:
        rng = self._rng(int(epoch), 1 << 20, int(rank))  # a stream of its own per rank
        nonempty = np.nonzero(self.counts)[0]
        out: list[np.ndarray] = []
        have = 0
        while have < k:
            shards = rng.choice(nonempty, size=max(1, math.ceil(len(nonempty) / 4)))
            chunk = self._windowed(shards, rng)
            out.append(chunk)
            have += len(chunk)
        return np.concatenate(out)[:k] if out else np.zeros(0, np.int64)

    def partners(self, epoch: int, sample: int) -> np.ndarray:
        """The window of the epoch's order that ``sample`` sits in: where its mosaic and mixup partners come from."""
        order = self.order(epoch)
        if self._positions is None or self._positions[0] != epoch:
            positions = np.empty(self.n, np.int64)
            positions[order] = np.arange(len(order))
            self._positions = (int(epoch), positions)
        w0 = int(self._positions[1][sample]) // self.window * self.window
        return order[w0 : w0 + self.window]


class ShardPlanSampler(Sampler[tuple[int, int]]):
    """This rank's ``(epoch, sample)`` pairs of a ShardPlan: a drop-in for ShardedSampler in training loaders."""

    def __init__(self, plan: ShardPlan, world_size: int = 1, rank: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not valid for world size {world_size}")
        self.plan, self.world_size, self.rank, self.epoch = plan, world_size, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def shard(self, epoch: int | None = None) -> list[int]:
        e = self.epoch if epoch is None else int(epoch)
        return self.plan.rank_samples(e, self.rank, self.world_size).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return iter([(epoch, i) for i in self.shard()])

    def __len__(self) -> int:
        return self.plan.per_rank(self.world_size)
