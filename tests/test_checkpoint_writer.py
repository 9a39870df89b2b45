"""The checkpoint writer (utils/engine/run_record.py): training never waits for the disk; files follow the umask;
run.json says whether a run finished, and ``--resume`` without a path takes the newest interrupted one; the cuDNN
benchmark rule (utils/engine/phases.py). All without training: milliseconds each."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import utils.engine.run_record as run_record_module
from utils.checkpoint import latest_last_checkpoint, load_checkpoint, run_state, save_checkpoint
from utils.engine.config import TrainConfig
from utils.engine.phases import BENCHMARK_MIN_STEPS_PER_SHAPE, benchmark_choice
from utils.engine.run_record import RunRecord
from utils.engine.setup import input_shapes
from utils.errors import UserError
from utils.files import atomic_output
from utils.results_log import result_columns


def _record(folder: Path) -> RunRecord:
    return RunRecord(
        folder, result_columns(("box", "obj", "cls")), patience=0, noval=False, nosave=False, save_period=-1
    )


def _end_epoch(record: RunRecord, epoch: int, fit: float, weights: torch.Tensor) -> None:
    ckpt = {"model_cfg": {}, "model": {"w": weights}, "ema": None, "epoch": epoch, "mid_epoch": None}
    record.end_epoch(epoch, np.zeros(3), (0.0, 0.0, 0.0, fit, 0.0, 0.0, 0.0), [0.01] * 3, ckpt, final=False)


def test_a_blocked_writer_holds_up_no_epoch_and_writes_the_newest_snapshot_once_released(tmp_path, monkeypatch):
    release, entered, written = threading.Event(), threading.Event(), []
    original = run_record_module.save_checkpoint

    def blocked_save(ckpt, path):  # the first write waits for the test (a disk that stops answering)
        entered.set()
        assert release.wait(30)
        original(ckpt, path)
        written.append((Path(path).name, ckpt["epoch"]))

    monkeypatch.setattr(run_record_module, "save_checkpoint", blocked_save)
    record = _record(tmp_path)
    weights = torch.zeros(4)  # the live tensor training goes on changing in place
    t0 = time.monotonic()
    _end_epoch(record, 0, 0.1, weights)
    assert entered.wait(30)  # epoch 0's write has started and is stuck
    for epoch, fit in ((1, 0.3), (2, 0.2), (3, 0.1)):  # epoch 1 is the best; 2 and 3 are not
        weights.fill_(epoch)
        _end_epoch(record, epoch, fit, weights)
    weights.fill_(99.0)  # after the last submit: no snapshot may see this
    assert time.monotonic() - t0 < 10 and not release.is_set()  # every epoch ended while the disk was stuck
    assert written == [] and record.writer.newest_complete is None
    assert run_state(tmp_path)["newest_checkpoint"] is None

    release.set()
    assert record.close(timeout=30)
    # Epoch 0's write, then one write each for last.pt's newest snapshot (epoch 3, which replaced epoch 2's) and
    # best.pt's (epoch 1): none of epoch 2, which was replaced before it was written.
    assert written == [("last.pt", 0), ("best.pt", 1), ("last.pt", 3)]
    assert load_checkpoint(record.last)["epoch"] == 3 and torch.equal(
        load_checkpoint(record.last)["model"]["w"], torch.full((4,), 3.0)
    )
    best = load_checkpoint(record.best)
    assert best["epoch"] == 1 and torch.equal(best["model"]["w"], torch.ones(4))
    newest = record.writer.newest_complete
    assert (newest.path, newest.label) == (record.last, "epoch 3")
    assert (
        run_state(tmp_path)["newest_checkpoint"] == "weights/last.pt" and run_state(tmp_path)["checkpoint"] == "epoch 3"
    )
    assert not list(record.weights_dir.glob(".*.tmp"))


def test_a_bounded_wait_returns_while_a_write_is_stuck(tmp_path, monkeypatch):
    release, original = threading.Event(), run_record_module.save_checkpoint
    monkeypatch.setattr(
        run_record_module, "save_checkpoint", lambda ckpt, path: release.wait(30) and original(ckpt, path)
    )
    record = _record(tmp_path)
    _end_epoch(record, 0, 0.1, torch.zeros(1))
    t0 = time.monotonic()
    assert record.close(timeout=0.2) is False and time.monotonic() - t0 < 5
    release.set()
    assert record.close(timeout=30) and load_checkpoint(record.last)["epoch"] == 0


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_checkpoints_and_caches_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        save_checkpoint({"model_cfg": {}, "model": {}}, tmp_path / "last.pt")
        with atomic_output(tmp_path / "labels.cache") as tmp:
            tmp.write_bytes(b"cache")
    finally:
        os.umask(old)
    for name in ("last.pt", "labels.cache"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def _run(root: Path, name: str, when: float, status: str | None, ckpt: dict | None = None) -> Path:
    """A run folder whose last.pt was written at ``when``; ``status``: its run.json's (None: no run.json)."""
    last = root / name / "weights/last.pt"
    last.parent.mkdir(parents=True)
    if ckpt is None:
        last.write_bytes(b"")
    else:
        save_checkpoint(ckpt, last)
    if status is not None:
        record = _record(root / name)
        if status == "finished":
            record.mark_finished()
    os.utime(last, (when, when))
    return last


def test_resume_without_a_path_takes_the_newest_interrupted_run_not_the_newest_finished_one(tmp_path):
    old = _run(tmp_path, "exp", 100, "running")
    _run(tmp_path, "exp2", 300, "finished")  # the newest last.pt: finished, nothing to resume
    assert latest_last_checkpoint(tmp_path) == old
    # Runs written before run.json are judged by their last.pt.
    legacy_finished = {"model_cfg": {}, "model": {}, "epoch": 4, "mid_epoch": None, "config": {"epochs": 5}}
    _run(tmp_path, "exp3", 400, None, legacy_finished)
    assert latest_last_checkpoint(tmp_path) == old
    legacy_mid = {**legacy_finished, "mid_epoch": {"epoch": 5, "batch": 3}, "config": {"epochs": 6}}
    newest = _run(tmp_path, "exp4", 500, None, legacy_mid)
    assert latest_last_checkpoint(tmp_path) == newest


def test_resume_without_a_path_names_the_newest_run_when_every_run_finished(tmp_path):
    last = _run(tmp_path, "exp", 100, "finished")
    with pytest.raises(UserError, match=f"every run there finished .*--resume {last} --epochs N"):
        latest_last_checkpoint(tmp_path)


def test_cudnn_benchmark_only_where_its_autotuning_pays_back():
    long_run = BENCHMARK_MIN_STEPS_PER_SHAPE * 2
    assert benchmark_choice(long_run, 2, cuda=True, deterministic=False)[0] is True
    assert benchmark_choice(long_run, 3, cuda=True, deterministic=False)[0] is False  # too many shapes to tune
    assert benchmark_choice(BENCHMARK_MIN_STEPS_PER_SHAPE - 1, 1, cuda=True, deterministic=False)[0] is False
    assert benchmark_choice(long_run, 1, cuda=False, deterministic=False)[0] is False  # the CPU: not applicable
    assert benchmark_choice(long_run, 1, cuda=True, deterministic=True)[0] is False
    on, reason = benchmark_choice(5000, 2, cuda=True, deterministic=False)
    assert on and "5000 steps over 2 input shapes (2500 per shape" in reason


def test_the_training_shapes_the_benchmark_rule_counts():
    square = SimpleNamespace(dataset=SimpleNamespace(rect=False, batch_shapes=None))
    rect = SimpleNamespace(
        dataset=SimpleNamespace(rect=True, batch_shapes=np.array([[320, 640], [640, 640], [320, 640]]))
    )
    assert input_shapes(TrainConfig(imgsz=640), 32, square) == 1
    assert input_shapes(TrainConfig(imgsz=640), 32, rect) == 2
    assert input_shapes(TrainConfig(imgsz=640, multi_scale=True), 32, square) == 21  # 320, 352, ..., 960


def test_a_resumed_record_runs_again_and_keeps_naming_the_checkpoint_it_resumes_from(tmp_path):
    record = _record(tmp_path)
    _end_epoch(record, 0, 0.1, torch.zeros(1))
    record.close()
    record.mark_finished()
    resumed = _record(tmp_path)  # --resume PATH --epochs N on the finished run
    state = run_state(tmp_path)
    assert (state["status"], state["newest_checkpoint"], state["checkpoint"]) == (
        "running",
        "weights/last.pt",
        "epoch 0",
    )
    resumed.close()
