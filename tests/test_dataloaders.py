"""create_dataloader's training stream: one epoch per iteration, prefetch across epochs, same content as a plain loader."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

import utils.data.loader as dataloaders
from models.families import YOLOV5
from utils.data.batch_ring import BatchRing
from utils.data.dataset import YoloDataset
from utils.data.loader import EpochStreamLoader, create_dataloader
from utils.data.shapes import generate_shapes

BATCH = 4
IMGSZ = 64
HYP = YOLOV5.read_hyp(YOLOV5.default_hyp_path)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    root = generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=10, n_val=2, imgsz=IMGSZ, seed=1)
    return str(root / "images" / "train")


def _loader(images: str, workers: int) -> EpochStreamLoader:
    loader, _ = create_dataloader(
        images, IMGSZ, BATCH, 32, hyp=HYP, augment=True, shuffle=True, seed=2, nc=5, workers=workers
    )
    assert isinstance(loader, EpochStreamLoader)
    return loader


def _plain_epoch(loader: EpochStreamLoader, epoch: int) -> list[tuple]:
    """What a plain DataLoader over the same sampler yields for ``epoch`` (the loader before streaming)."""
    loader.sampler.set_epoch(epoch)
    plain = DataLoader(loader.dataset, batch_size=BATCH, sampler=loader.sampler, collate_fn=YoloDataset.collate_fn)
    return list(plain)


def _same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] for x, y in zip(a, b)
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_matches_plain_loader_through_epoch_ends_and_jumps(images: str, workers: int) -> None:
    loader = _loader(images, workers)
    epochs = [0, 1, 3, 3, 2]  # run on, skip an epoch, repeat one, go back (e.g. a resume)
    got = {}
    for k, epoch in enumerate(epochs):
        loader.sampler.set_epoch(epoch)
        assert len(loader) == 3  # 10 images, batches of 4: the short last batch stays in its own epoch
        got[k] = list(loader)
        assert [len(b[0]) for b in got[k]] == [4, 4, 2]
    loader.sampler.set_epoch(4)
    first = next(iter(loader))  # leave epoch 4 early: the next iteration restarts cleanly
    loader.sampler.set_epoch(4)
    again = list(loader)
    assert _same([first], again[:1])
    reference = _loader(images, 0)
    for k, epoch in enumerate(epochs):
        assert _same(got[k], _plain_epoch(reference, epoch)), f"epoch {epoch} (pass {k}) differs"
    assert not _same(got[0], got[1])


def test_stream_reuses_prefetched_batches_only_for_the_next_epoch(images: str) -> None:
    loader = _loader(images, 0)
    starts = []
    original_iter = loader.loader.__iter__

    class Spy(DataLoader):
        def __iter__(self):
            starts.append(loader.batch_sampler.start_epoch)
            return original_iter()

    loader.loader.__class__ = Spy
    for epoch in (0, 1, 2, 5, 6, 6):
        loader.sampler.set_epoch(epoch)
        for _ in loader:
            pass
    assert starts == [0, 5, 6]  # one stream for 0-2, a restart for the jump to 5 and for the repeat of 6


def test_a_stream_started_at_set_up_is_the_one_the_first_epoch_takes(images: str) -> None:
    loader = _loader(images, 0)
    starts = []
    original_iter = loader.loader.__iter__

    class Spy(DataLoader):
        def __iter__(self):
            starts.append((loader.batch_sampler.start_epoch, loader.batch_sampler.start_batch))
            return original_iter()

    loader.loader.__class__ = Spy
    loader.start(3, 1)  # a resumed run: batch 1 of epoch 3, started before its first step
    assert starts == [(3, 1)]
    loader.set_epoch(3, 1)
    got = list(loader)
    assert starts == [(3, 1)]  # no second start: the batches made during set-up are used
    assert _same(got, _plain_epoch(_loader(images, 0), 3)[1:])


def test_validation_loader_stays_plain(images: str) -> None:
    loader, _ = create_dataloader(images, IMGSZ, BATCH, 32, rect=True, pad=0.5, nc=5, workers=0)
    assert isinstance(loader, DataLoader) and len(loader) == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_channels_last_and_hold_each_sample(images: str, workers: int) -> None:
    loader = _loader(images, workers)
    loader.sampler.set_epoch(1)
    imgs, targets, paths, _ = next(iter(loader))
    assert imgs.dtype == torch.uint8 and imgs.shape == (BATCH, 3, IMGSZ, IMGSZ)
    assert imgs.is_contiguous(memory_format=torch.channels_last)  # the model's layout: no conversion later
    indices = list(loader.sampler)[:BATCH]
    for k, (epoch, index) in enumerate(indices):
        img, tgt, path, _ = loader.dataset[(epoch, index)]
        assert torch.equal(imgs[k], img) and path == paths[k]
        assert torch.equal(targets[targets[:, 0] == k][:, 1:], tgt[:, 1:])


@pytest.mark.slow
def test_ring_batches_stay_intact_when_the_main_process_is_slow(images: str, monkeypatch) -> None:
    # Workers race ahead while the main process dawdles before copying each batch out of its ring slot: a slot
    # refilled too early would show up as another batch's pixels.
    take = BatchRing.take

    def slow_take(self, where, pin_memory=False):
        time.sleep(0.15)
        return take(self, where, pin_memory)

    monkeypatch.setattr(BatchRing, "take", slow_take)
    loader = _loader(images, 2)
    assert loader.ring is not None
    for epoch in (0, 1, 2):
        loader.sampler.set_epoch(epoch)
        indices = list(loader.sampler)
        for b, (imgs, _targets, paths, _) in enumerate(loader):
            for k, pair in enumerate(indices[b * BATCH : (b + 1) * BATCH]):
                img, tgt, path, _ = loader.dataset[pair]
                assert torch.equal(imgs[k], img) and path == paths[k], (epoch, b, k)


@pytest.mark.slow
def test_ring_batches_leave_in_a_thread_of_their_own_intact_and_the_stream_ends_with_its_workers(
    images: str, monkeypatch
) -> None:
    # Where CUDA trains, a hand-off thread copies batches out of the ring one ahead of the step; here it is turned
    # on for the CPU. The step (this loop) is slow, the copy runs on the hand-off thread, an epoch is left early.
    take, threads = BatchRing.take, set()

    def recorded_take(self, where, pin_memory=False):
        threads.add(threading.current_thread().name)
        return take(self, where, pin_memory)

    monkeypatch.setattr(BatchRing, "take", recorded_take)
    loader = _loader(images, 2)
    loader.copy_in_thread = True
    loader.set_epoch(0)
    next(iter(loader))  # left after one batch: the thread stops before the stream restarts
    reference = _loader(images, 0)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        got = []
        for batch in loader:
            time.sleep(0.05)
            got.append(batch)
        assert _same(got, _plain_epoch(reference, epoch)), epoch
    assert threads == {"batch-hand-off"}
    # After the last epoch the stream ends: its workers (running on into epoch 2) stop; a later epoch starts anew.
    workers = list(loader._batches._workers)
    assert workers and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers)
    loader.set_epoch(2)
    assert _same(list(loader), _plain_epoch(reference, 2))


def test_ring_only_where_workers_and_shared_memory_allow(images: str, monkeypatch) -> None:
    assert _loader(images, 0).ring is None  # no workers: nothing to ship between processes
    monkeypatch.setattr(dataloaders, "shared_memory_fits", lambda nbytes: False)
    loader = _loader(images, 2)
    assert loader.ring is None
    loader.sampler.set_epoch(0)
    assert [len(b[0]) for b in loader] == [4, 4, 2]


def test_ring_put_refuses_what_does_not_fit() -> None:
    ring = BatchRing(1, 2, 2, (4, 4, 3))
    image = torch.zeros(4, 4, 3, dtype=torch.uint8)
    assert ring.put([image]) is None  # not in a worker process
    assert ring.nbytes(1, 2, 2, (4, 4, 3)) == ring.buffer.numel()
