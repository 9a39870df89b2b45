"""Experiment trackers: several at once, never in training's way, one tracker run per training across kills.

Here with stand-in trackers and TensorBoard; a real training killed twice, with a real MLflow server and W&B
offline, is test_train.py's launcher-restart test (tracker_servers.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from utils.errors import UserError
from utils.log import LOGGER
from utils.results_log import append_results_row, result_columns, truncate_results
from utils.trackers import NullLogger, Tracker, TrackerRun, Trackers, open_trackers, read_ids

COLUMNS = result_columns(("box", "obj", "cls"))


class Lines:
    """The project logger's messages while in use."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self) -> Lines:
        LOGGER.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        LOGGER.removeHandler(self.handler)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


class Recording(Tracker):
    """A tracker that records what reaches it; ``held`` pretends its run already holds those epochs."""

    name, title = "recording", "Recording"

    def __init__(
        self, held: dict[str, set[int]] | None = None, gate: threading.Event | None = None, fail_at: int | None = None
    ):
        self.logged: list[tuple[int, tuple[str, ...]]] = []
        self._held, self.gate, self.fail_at = held or {}, gate, fail_at
        self.closed_with = ""

    def open(self, run, saved):
        return {"run_id": (saved or {}).get("run_id", "r1")}

    def held(self):
        return self._held

    def log_metrics(self, epoch, values):
        if self.gate is not None:
            self.gate.wait()  # a server that answers only after minutes of retries
        if epoch == self.fail_at:
            raise OSError(28, "No space left on device")
        self.logged.append((epoch, tuple(values)))

    def close(self, status):
        self.closed_with = status


def write_rows(csv_file: Path, epochs) -> None:
    for epoch in epochs:
        append_results_row(csv_file, [epoch, *values_of(epoch)], COLUMNS)


def values_of(epoch: int) -> list[float]:
    """An epoch's results.csv values (5 significant digits, as results.csv holds them)."""
    return [round(0.1 + 0.01 * epoch + 0.001 * i, 5) for i in range(len(COLUMNS) - 1)]


def test_a_tracker_that_hangs_or_fails_never_holds_training_up(tmp_path) -> None:
    gate = threading.Event()
    hanging, failing = Recording(gate=gate), Recording(fail_at=2)
    hanging.title, failing.title = "Hanging", "Failing"
    with Lines() as log:
        stuck = Trackers(TrackerRun(tmp_path / "a"), [hanging], max_pending=4, close_timeout=0.5)
        start = time.perf_counter()
        for epoch in range(200):
            stuck.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
        elapsed = time.perf_counter() - start
        stuck.close()
        broken = Trackers(TrackerRun(tmp_path / "b"), [failing])  # a disk that fills up at epoch 2
        for epoch in range(5):
            broken.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
            assert broken.flush(10)
        broken.close()
    gate.set()  # let the hanging thread end
    # A tracker waiting on a server would hold every call forever; here 200 calls do not wait for it.
    assert elapsed < 2.0, elapsed
    assert [e for e, _ in failing.logged] == [0, 1] and failing.closed_with == "failed"
    assert log.lines == [
        "WARNING Hanging is 4 records behind: new records are discarded until it catches up (results.csv keeps "
        "them; the tracker run is completed from it at the end)",
        "WARNING Hanging did not finish within 0.5 s; its last records may be missing (results.csv holds them)",
        "WARNING Failing stopped for the rest of this run (OSError: [Errno 28] No space left on device); "
        "training goes on and results.csv keeps the record",
    ]


def test_reconciling_with_results_csv_logs_each_epoch_once(tmp_path) -> None:
    csv_file = tmp_path / "results.csv"
    write_rows(csv_file, range(4))
    tracker = Recording(held={c: {0, 1} for c in COLUMNS[1:]})  # its run holds epochs 0 and 1 already
    trackers = Trackers(
        TrackerRun(tmp_path, resumed=True, saved={"recording": {"run_id": "from-checkpoint"}}), [tracker]
    )
    trackers.log_epoch(3, dict(zip(COLUMNS[1:], values_of(3))))  # held now: the reconciliation logged it
    trackers.log_epoch(4, dict(zip(COLUMNS[1:], values_of(4))))
    write_rows(csv_file, [4, 5])  # epoch 5: a record the tracker never got (a full queue discarded it)
    assert trackers.flush(10)
    assert trackers.state() == {"recording": {"run_id": "from-checkpoint"}}
    assert read_ids(tmp_path) == trackers.state()  # trackers.yaml, written when the tracker run opened
    trackers.close()
    assert [e for e, _ in tracker.logged] == [2, 3, 4, 5]
    assert all(keys == COLUMNS[1:] for _, keys in tracker.logged)
    # A resumed run prefers the run folder's ids to the checkpoint's; a new run in the folder starts anew.
    resumed = Trackers(TrackerRun(tmp_path, resumed=True, saved={"recording": {"run_id": "older"}}), [Recording()])
    fresh = Trackers(TrackerRun(tmp_path), [Recording()])
    assert resumed.flush(10) and fresh.flush(10)
    assert resumed.state()["recording"]["run_id"] == "from-checkpoint"
    assert fresh.state()["recording"]["run_id"] == "r1"
    resumed.close()
    fresh.close()


def test_tracker_names_packages_and_ranks(tmp_path, monkeypatch) -> None:
    with pytest.raises(UserError, match=r"^--loggers comet: not a tracker \(choose from tensorboard, mlflow, wandb\)$"):
        open_trackers(TrackerRun(tmp_path, names=("comet",)), is_main=True)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError, match=r"^--loggers mlflow needs the mlflow package \(pip install mlflow\)$"):
        open_trackers(TrackerRun(tmp_path, names=("tensorboard", "mlflow")), is_main=True)
    with pytest.raises(UserError, match="needs the mlflow package"):  # on every rank: all stop at once
        open_trackers(TrackerRun(tmp_path, names=("mlflow",)), is_main=False)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert isinstance(open_trackers(TrackerRun(tmp_path, names=("mlflow", "wandb")), is_main=False), NullLogger)
    assert isinstance(open_trackers(TrackerRun(tmp_path, names=()), is_main=True), NullLogger)
    assert not list(tmp_path.iterdir())
    # Importing the trackers imports none of the trackers' packages (nor torch).
    code = (
        "import sys, utils.trackers; "
        "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_in_a_resumed_folder_shows_every_epoch_once(tmp_path) -> None:
    import cv2
    import tensorboard  # noqa: F401  (a requirement: missing, the test fails rather than skips)

    first = open_trackers(TrackerRun(tmp_path), is_main=True)
    for epoch in range(3):
        write_rows(tmp_path / "results.csv", [epoch])
        first.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
    first.log_pr_curve(np.linspace(1, 0, 101), np.linspace(0, 1, 101), 2)
    first.close()
    truncate_results(tmp_path / "results.csv", keep_below_epoch=2)  # resumed from epoch 1's checkpoint
    cv2.imwrite(str(tmp_path / "confusion_matrix.png"), np.full((24, 32, 3), 200, np.uint8))
    second = open_trackers(TrackerRun(tmp_path, resumed=True), is_main=True)
    for epoch in (2, 3):
        write_rows(tmp_path / "results.csv", [epoch])
        second.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
    second.log_images([tmp_path / "confusion_matrix.png"], 3)
    second.close()
    acc = _events(tmp_path)
    for i, tag in enumerate(COLUMNS[1:]):
        scalars = acc.Scalars(tag)
        assert [e.step for e in scalars] == [0, 1, 2, 3], tag
        np.testing.assert_allclose([e.value for e in scalars], [values_of(e)[i] for e in range(4)], rtol=1e-6)
    assert acc.Tags()["images"] == ["plots/confusion_matrix"]
    assert [e.step for e in acc.Tensors("val/PR_curve")] == [2]


def test_tensorboard_stores_images_at_most_800_px_on_a_side_and_small_ones_as_they_are(tmp_path) -> None:
    """A run folder's 1920 px mosaics are scaled down in the event file (encoding them whole held the end of a run
    for seconds); a small chart keeps its size and its pixels; the training batch's grid is fitted too."""
    import cv2
    import tensorboard  # noqa: F401  (a requirement: missing, the test fails rather than skips)
    import torch

    from utils.trackers.tensorboard import TensorBoardTracker

    rng = np.random.default_rng(0)
    cv2.imwrite(str(tmp_path / "val_batch0_pred.jpg"), rng.integers(0, 255, (1280, 1920, 3), np.uint8))
    small = rng.integers(0, 255, (24, 32, 3), np.uint8)
    cv2.imwrite(str(tmp_path / "chart.png"), small)
    tracker = TensorBoardTracker()
    tracker.open(TrackerRun(tmp_path / "tb"), None)
    tracker.log_images([tmp_path / "val_batch0_pred.jpg", tmp_path / "chart.png"], 0)
    tracker.log_batch(torch.randint(0, 255, (64, 3, 640, 640), dtype=torch.uint8), 0)
    tracker.close("FINISHED")
    acc = _events(tmp_path / "tb")
    sizes = {tag: (acc.Images(tag)[0].width, acc.Images(tag)[0].height) for tag in acc.Tags()["images"]}
    assert sizes == {"plots/val_batch0_pred": (800, 533), "plots/chart": (32, 24), "train/batch_mosaic": (800, 800)}
    stored = cv2.imdecode(np.frombuffer(acc.Images("plots/chart")[0].encoded_image_string, np.uint8), cv2.IMREAD_COLOR)
    assert np.array_equal(stored, small)


def test_a_resumed_results_csv_with_a_float_epoch_or_a_non_utf8_byte_is_cleaned_not_fatal(tmp_path) -> None:
    from utils.plots import read_results_csv

    csv_file = tmp_path / "results.csv"
    for epoch in range(4):
        append_results_row(csv_file, [epoch, *values_of(epoch)], COLUMNS)
    lines = csv_file.read_bytes().splitlines(keepends=True)
    lines[1] = b"1.0" + lines[1].lstrip()[1:]  # epoch 0 written as `1.0` by hand: epoch 1
    lines[2] = lines[2][:-8] + b"\xff" + lines[2][-7:]  # a byte that is not UTF-8: the row is dropped
    csv_file.write_bytes(b"".join(lines))
    truncate_results(csv_file, keep_below_epoch=3)
    header, values = read_results_csv(csv_file)  # the reader results.png uses: every row numbers again
    assert header == list(COLUMNS) and values[:, 0].tolist() == [1, 2]
    assert all(row.split(",")[0].strip().isdecimal() for row in csv_file.read_text().splitlines()[1:])


def test_trackers_read_a_damaged_results_csv_or_wandb_record_without_a_traceback(tmp_path, caplog) -> None:
    """What reconciliation reads back: results.csv rows of other than numbers or with an epoch that is not whole
    are skipped, a file that is not UTF-8 (or a folder) is one warning naming it; W&B records whose epoch or step
    is text, NaN or a boolean are not epochs."""
    from utils.trackers import read_results
    from utils.trackers.wandb_records import WandbRunFiles

    csv_file = tmp_path / "results.csv"
    for epoch in range(3):
        append_results_row(csv_file, [epoch, *values_of(epoch)], COLUMNS)
    lines = csv_file.read_text().splitlines()
    lines[2] = "1.5" + lines[2].lstrip()[1:]  # not an epoch
    lines[3] = "inf" + lines[3].lstrip()[1:]
    lines.append("3," + ",".join(["x"] * (len(COLUMNS) - 1)))
    csv_file.write_text("\n".join(lines) + "\n")
    rows = read_results(csv_file)
    assert list(rows) == [0] and rows[0][COLUMNS[1]] == pytest.approx(values_of(0)[0])
    LOGGER.addHandler(caplog.handler)
    try:
        csv_file.write_bytes(b"epoch,a\n0,\xff\n")
        assert read_results(csv_file) == {} and read_results(tmp_path) == {}
    finally:
        LOGGER.removeHandler(caplog.handler)
    assert f"{csv_file}: unreadable (UnicodeDecodeError" in caplog.text and f"{tmp_path}: unreadable" in caplog.text
    history = [{"epoch": 0, "a": 1}, {"epoch": "1", "a": 1}, {"epoch": float("nan"), "a": 1}, {"epoch": True, "a": 1}]
    history += [{"epoch": 2.0, "a": 1, "_step": 5}, {"_step": "9"}, {"_step": float("inf")}]
    records = WandbRunFiles(history=history)
    assert records.epochs() == {"a": {0, 2}} and records.last_step() == 5
