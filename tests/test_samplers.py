"""ShardedSampler: equal training shards, disjoint complete validation shards, per-epoch shuffles."""

from __future__ import annotations

import pytest

from utils.data.samplers import EpochStreamBatchSampler, ShardedSampler, epoch_batches


def _shards(n: int, world: int, **kwargs) -> list[list[tuple[int, int]]]:
    return [list(ShardedSampler(n, world_size=world, rank=r, **kwargs)) for r in range(world)]


@pytest.mark.parametrize("n, world, block", [(10, 1, 1), (10, 3, 1), (2, 4, 1), (23, 4, 4), (16, 2, 8), (0, 2, 1)])
def test_validation_shards_disjoint_and_complete(n: int, world: int, block: int) -> None:
    shards = _shards(n, world, shuffle=False, pad=False, block=block)
    flat = [i for shard in shards for _, i in shard]
    assert sorted(flat) == list(range(n)) and len(flat) == n
    for r, shard in enumerate(shards):
        assert len(ShardedSampler(n, world, r, pad=False, block=block)) == len(shard)
        idx = [i for _, i in shard]
        if idx:  # a contiguous run of whole blocks: rect batches never straddle two batch shapes
            assert idx == list(range(idx[0], idx[-1] + 1)) and idx[0] % block == 0


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (3, 4), (101, 8)])
def test_training_shards_equal_length_and_cover_everything(n: int, world: int) -> None:
    shards = _shards(n, world, shuffle=True, seed=3, pad=True)
    lengths = {len(s) for s in shards}
    assert lengths == {-(-n // world)}
    assert all(len(ShardedSampler(n, world, r, shuffle=True)) == len(s) for r, s in enumerate(shards))
    flat = [i for shard in shards for _, i in shard]
    assert set(flat) == set(range(n))
    assert len(flat) - len(set(flat)) == len(flat) - n  # only the padding repeats


def test_reshuffled_per_epoch_reproducible_and_epoch_travels() -> None:
    sampler = ShardedSampler(50, world_size=2, rank=1, shuffle=True, seed=7)
    first = list(sampler)
    assert {e for e, _ in first} == {0}
    sampler.set_epoch(1)
    second = list(sampler)
    assert {e for e, _ in second} == {1}
    assert [i for _, i in first] != [i for _, i in second]
    again = ShardedSampler(50, world_size=2, rank=1, shuffle=True, seed=7)
    again.set_epoch(1)
    assert list(again) == second  # same (seed, epoch) -> same order, e.g. after a resume
    other_seed = ShardedSampler(50, world_size=2, rank=1, shuffle=True, seed=8)
    other_seed.set_epoch(1)
    assert list(other_seed) != second


def test_unshuffled_order_and_bad_rank() -> None:
    assert [i for _, i in ShardedSampler(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        ShardedSampler(5, world_size=2, rank=2)


def test_epoch_stream_cuts_batches_per_epoch_and_runs_on() -> None:
    sampler = ShardedSampler(10, world_size=2, rank=1, shuffle=True, seed=4)
    stream = EpochStreamBatchSampler(sampler, 2)
    stream.start_epoch = 3
    it = iter(stream)
    for epoch in (3, 4, 5):
        sampler.set_epoch(epoch)
        expected = list(sampler)  # 5 pairs: two full batches and a short one, never part of the next epoch
        got = [next(it) for _ in range(3)]
        assert [len(b) for b in got] == [2, 2, 1] and [p for b in got for p in b] == expected
        assert epoch_batches(sampler, 2, epoch) == got
    with pytest.raises(ValueError):
        EpochStreamBatchSampler(sampler, 0)
    assert list(EpochStreamBatchSampler(ShardedSampler(0), 2)) == []  # nothing to sample: the stream ends
