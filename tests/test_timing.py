"""Where a training step's time goes (utils/engine/timing.py): planted delays land in their columns of
results.csv, the log says it per epoch and at the end, with advice when data loading is the bottleneck;
--profile writes a Chrome trace. Tiny in-process runs (yolov5n at 64 px, 16 images)."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from utils.engine.timing import DATA_BOUND_SHARE, PHASES, TIME_COLUMNS, EpochTime, RunProgress, RunTime, data_advice
from utils.results_log import result_columns

DATA_DELAY = 0.06  # seconds per image loaded in epoch 0: 16 images, 0.96 s
OPTIMIZER_DELAY = 1.0  # seconds per optimizer step in epoch 1: two steps (batch 8; a short run steps every batch)


def rows_of(csv_file) -> list[dict[str, float]]:
    with open(csv_file, newline="") as f:
        return [{k.strip(): float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def phase_seconds(row: dict[str, float], images: int) -> dict[str, float]:
    """Seconds per phase from a results.csv row: shares of the step time, which is images / (images per second)."""
    total = images / row["time/images_per_s"]
    return {p: row[f"time/{p}"] * total for p in PHASES}


def test_a_slow_data_source_and_a_slow_optimizer_step_land_in_their_columns(
    train_here, rectangles_yaml, tmp_path, monkeypatch, capsys
) -> None:
    """Epoch 0 loads its images slowly, epoch 1 steps its optimizer slowly; each epoch is the other's control."""
    from utils.data.dataset import YoloDataset

    load = YoloDataset.__getitem__

    def slow_load(self, item):
        if isinstance(item, tuple) and item[0] == 0:
            time.sleep(DATA_DELAY)
        return load(self, item)

    steps = []

    def slow_step(*_) -> None:
        steps.append(1)
        if len(steps) > 2:
            time.sleep(OPTIMIZER_DELAY)

    monkeypatch.setattr(YoloDataset, "__getitem__", slow_load)
    hook = register_optimizer_step_pre_hook(slow_step)
    try:
        status, log = train_here(
            "--data", rectangles_yaml, "--project", tmp_path, "--name", "exp", "--epochs", "2", "--noval"
        )
    finally:
        hook.remove()
    assert status == 0, log[-3000:]
    assert "a step every batch (4 steps)" in log and len(steps) == 4
    with open(tmp_path / "exp/results.csv") as f:
        header = [c.strip() for c in f.readline().split(",")]
    # The time columns come after the columns results.csv had before them, so readers of those are unchanged.
    assert header == [*result_columns(("box", "obj", "cls")), *TIME_COLUMNS]
    rows = rows_of(tmp_path / "exp/results.csv")
    first, second = (phase_seconds(r, 16) for r in rows)
    data_planted, optimizer_planted = 16 * DATA_DELAY, 2 * OPTIMIZER_DELAY
    assert first["data"] >= data_planted and second["optimizer"] >= optimizer_planted, (first, second)
    # Each delay is in its column only: against the other epoch, only that column grew by it.
    assert first["data"] - second["data"] > data_planted / 2, (first, second)
    assert second["optimizer"] - first["optimizer"] > optimizer_planted / 2, (first, second)
    assert all(r["time/slowest_rank"] == 0 for r in rows)
    assert all(sum(r[f"time/{p}"] for p in PHASES) <= 1.0 + 1e-4 for r in rows)
    # The log: each epoch's split, and the run's at the end.
    for epoch, row in enumerate(rows):
        assert f"epoch {epoch}: {row['time/images_per_s']:.1f} images/s; step time: data " in log, log[-3000:]
    assert "Time over 2 epochs: " in log
    # The progress line ends with the whole run's remaining time: after epoch 0's last batch, epoch 1 is left (at
    # epoch 0's pace, at least its 0.96 s of planted delay); after epoch 1's, nothing.
    lines = re.split(r"[\r\n]", capsys.readouterr().err)
    left = {
        epoch: [
            int(h) * 3600 + int(m) * 60 + int(s)
            for line in lines
            for h, m, s in re.findall(rf"^\s*{epoch}/1\s.* 2/2 \[.*run (\d+):(\d\d):(\d\d) left", line)
        ]
        for epoch in (0, 1)
    }
    assert left[0] and left[1] and min(left[0]) >= 1 and max(left[1]) == 0, left
    # No loader workers: this process waited for the slow images; the advice follows the run's data share.
    data_share = (first["data"] + second["data"]) / sum(16 / r["time/images_per_s"] for r in rows)
    advice = [line for line in log.splitlines() if line.startswith("data loading is the bottleneck")]
    if abs(data_share - DATA_BOUND_SHARE) > 0.01:  # near the threshold results.csv's rounding cannot tell
        assert len(advice) == (data_share > DATA_BOUND_SHARE), (data_share, advice)
    assert all("with 0 loader workers per rank" in line for line in advice)


def test_a_balanced_run_gets_no_advice_and_profile_writes_a_chrome_trace(
    train_here, rectangles96_yaml, tmp_path
) -> None:
    # 96 images in 12 batches, a step each: --profile 1 skips one step, warms up on one, records the third.
    status, log = train_here(
        "--data",
        rectangles96_yaml,
        "--project",
        tmp_path,
        "--name",
        "exp",
        "--epochs",
        "1",
        "--noval",
        "--workers",
        "2",
        "--profile",
        "1",
    )
    assert status == 0, log[-3000:]
    assert "Time over 1 epoch: " in log
    (row,) = rows_of(tmp_path / "exp/results.csv")
    assert row["time/data"] < 0.3, row  # two loader workers keep up with this model
    assert "data loading is the bottleneck" not in log, log[-3000:]
    trace = json.loads((tmp_path / "exp/profile.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "ProfilerStep#2" in names and any(n.startswith("aten::conv") for n in names)
    assert f"profile: 1 steps written to {tmp_path / 'exp/profile.json'}" in log


def test_a_run_starved_by_heavy_augmentation_without_workers_gets_the_advice(train_here, tmp_path) -> None:
    """--workers 0, no image cache, mosaic and mixup on every sample (8 decodes of a 1024 px PNG each) for a model at
    32 px: most of the step waits for data, and the run's summary says so with the worker count that would help."""
    import cv2
    import numpy as np
    import yaml

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        (tmp_path / "set/images" / split).mkdir(parents=True)
        (tmp_path / "set/labels" / split).mkdir(parents=True)
        for i in range(12 if split == "train" else 1):  # PNG: decoding cannot skip pixels, as JPEG's can
            cv2.imwrite(str(tmp_path / f"set/images/{split}/{i}.png"), rng.integers(0, 255, (1024, 1024, 3), np.uint8))
            (tmp_path / f"set/labels/{split}/{i}.txt").write_text("0 0.5 0.5 0.25 0.25\n")
    data = tmp_path / "set.yaml"
    data.write_text(
        yaml.safe_dump(
            {"path": str(tmp_path / "set"), "train": "images/train", "val": "images/val", "names": ["noise"]}
        )
    )
    hyp = yaml.safe_load((Path(__file__).parents[1] / "data/hyps/hyp.scratch-low.yaml").read_text())
    hyp.update(mosaic=1.0, mixup=1.0, degrees=10.0, shear=5.0, perspective=0.0005)
    (tmp_path / "heavy.yaml").write_text(yaml.safe_dump(hyp))
    status, log = train_here(
        "--data",
        data,
        "--project",
        tmp_path,
        "--name",
        "exp",
        "--epochs",
        "1",
        "--noval",
        "--cache",
        "off",
        "--hyp",
        tmp_path / "heavy.yaml",
        "--close-mosaic",
        "0",
        "--imgsz",
        "32",
    )
    assert status == 0, log[-3000:]
    (row,) = rows_of(tmp_path / "exp/results.csv")
    assert row["time/data"] > DATA_BOUND_SHARE, row  # measured, not planted: the augmentations themselves
    advice = [line for line in log.splitlines() if line.startswith("data loading is the bottleneck")]
    assert len(advice) == 1 and "with 0 loader workers per rank" in advice[0], log[-3000:]
    assert re.search(r"--workers \d+ would keep up|keeping up would take about \d+ workers", advice[0]), advice


def test_the_advice_says_how_many_workers_would_keep_up() -> None:
    starved = {"data": 0.6, "forward": 0.2, "backward": 0.15, "optimizer": 0.05, "sync": 0.0, "other": 0.0}
    # 0 workers: this process spends 60% building batches; 40% busy -> 2 workers (0.6 / 0.4, rounded up).
    assert data_advice(starved, 0, 8) == (
        "data loading is the bottleneck: 60% of the step time waits for data with 0 loader workers per rank; "
        "--workers 2 would keep up (about 2 per rank; 8 cores per rank here)"
    )
    # 2 starved workers: each batch takes them 2 step times -> 2 / 0.4 = 5 workers.
    assert "--workers 5 would keep up" in data_advice(starved, 2, 8)
    assert "more than the 4 cores per rank here: cache the images (--cache ram)" in data_advice(starved, 2, 4)
    balanced = {**starved, "data": 0.1, "forward": 0.7}
    assert data_advice(balanced, 0, 8) is None


def test_the_run_summary_weighs_epochs_by_time_and_the_progress_counts_the_whole_run() -> None:
    fast = EpochTime({"data": 1.0, "forward": 3.0}, images_per_s=40.0, slowest_rank=1, world_size=2, images=160)
    slow = EpochTime({"data": 3.0, "forward": 3.0}, images_per_s=20.0, slowest_rank=1, world_size=2, images=160)
    run = RunTime()
    run.add(fast)
    run.add(slow)
    summary = run.summary()
    assert summary.seconds == {"data": 4.0, "forward": 6.0}
    assert summary.images_per_s == pytest.approx(320 / (4 + 8))  # images over the slowest rank's time
    assert summary.slowest_rank == 1
    assert "per rank at the slowest (rank 1)" in summary.describe()
    assert summary.shares()["data"] == pytest.approx(0.4)
    progress = RunProgress(epochs=5, epoch_seconds=[12.0, 14.0])
    # Epoch 2, 10 of 40 batches in 5 s: 30 more at 0.5 s, then epochs 3 and 4 at 13 s each.
    assert progress.left(2, 10, 40, 5.0) == pytest.approx(15 + 26)
    assert progress.left(2, 0, 40, 0.0) is None


class FakeGpu:
    """A stream whose work finishes when the test says: events are recorded at a host time and pass once the
    GPU's clock reaches it; a wait on one that has not passed (``synchronize``) is counted."""

    def __init__(self) -> None:
        self.host, self.done_until, self.waits = 0.0, 0.0, 0

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = self.gpu.host

    def query(self) -> bool:
        return self.at <= self.gpu.done_until

    def synchronize(self) -> None:
        self.gpu.waits += not self.query()
        self.gpu.done_until = max(self.gpu.done_until, self.at)

    def elapsed_time(self, later: FakeEvent) -> float:
        assert self.query() and later.query(), "elapsed_time of an event that has not passed"
        return (later.at - self.at) * 1000


def test_device_marks_never_wait_for_the_gpu_inside_an_epoch_and_count_every_phase() -> None:
    from utils.engine.timing import DeviceMarks

    gpu = FakeGpu()
    marks = DeviceMarks(new_event=gpu.new_event, max_pending=4)
    marks.start()
    for _step in range(20):  # each step: 1 s data, 2 s forward, 3 s backward, 0.5 s optimizer (GPU time)
        for phase, seconds in (("data", 1.0), ("forward", 2.0), ("backward", 3.0), ("optimizer", 0.5)):
            gpu.host += seconds
            marks.mark(phase)
        gpu.done_until = gpu.host - 6.5  # the GPU runs a step behind the host
    assert gpu.waits == 0  # marks read back only events that have passed
    assert len(marks.pending) <= 4 + 4 + 1  # and do not pile up over an epoch
    assert marks.collect() == {"data": 20.0, "forward": 40.0, "backward": 60.0, "optimizer": 10.0}
    assert gpu.waits > 0  # at the end of the epoch, for the step still running


def test_the_progress_line_shows_dashes_until_the_epochs_first_read_back() -> None:
    """The losses reach the host every --log-interval steps: before the epoch's first read-back the loss columns
    hold a dash (a new user took the 0 they showed for a broken loss), then the means read back."""
    import numpy as np
    import torch

    from utils.engine.epoch import EpochHooks, progress_line
    from utils.engine.step import SavePolicy

    hooks = EpochHooks(epochs=3, batch_size=2, loss_names=("box", "cls"), save_policy=SavePolicy(0, 0))
    window = [(0, (torch.zeros(2, 3, 64, 48), torch.zeros(5, 6)))]
    before = progress_line(1, hooks, torch.device("cpu"), None, window)
    after = progress_line(1, hooks, torch.device("cpu"), np.array([0.5, 1.25]), window)
    assert before.split() == ["1/2", "0G", "-", "-", "5", "48"], before
    assert after.split() == ["1/2", "0G", "0.5", "1.25", "5", "48"], after
    assert len(before) == len(after)  # the columns stay where the header put them
