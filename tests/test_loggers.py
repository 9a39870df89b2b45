"""TensorBoard logging from a training run: event files that TensorBoard's own reader understands, and runs
without tensorboard (the trackers themselves: tests/test_trackers.py; MLflow and W&B in training: tests/test_train.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_rectangles_dataset

from utils.engine.timing import TIME_COLUMNS
from utils.results_log import result_columns
from utils.trackers import NullLogger, TrackerRun, open_trackers

RESULT_COLUMNS = (*result_columns(("box", "obj", "cls")), *TIME_COLUMNS)  # the default model's, YOLOv5's


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.slow
def test_training_writes_scalars_for_every_epoch_a_mosaic_and_the_pr_curve(train_here, tmp_path) -> None:  # noqa: F811
    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4)
    status, log = train_here("--data", data, "--project", tmp_path / "runs", "--epochs", "2")
    assert status == 0, log
    acc = _events(tmp_path / "runs/exp")
    tags = acc.Tags()
    assert set(RESULT_COLUMNS[1:]) <= set(tags["scalars"])
    for tag in RESULT_COLUMNS[1:]:
        assert [e.step for e in acc.Scalars(tag)] == [0, 1], tag
    csv_rows = (tmp_path / "runs/exp/results.csv").read_text().splitlines()[1:]
    lr0 = [float(row.split(",")[RESULT_COLUMNS.index("x/lr0")]) for row in csv_rows]
    assert np.allclose([e.value for e in acc.Scalars("x/lr0")], lr0, rtol=1e-4)  # the same values as results.csv
    assert tags["images"] == ["train/batch_mosaic"]
    assert tags["tensors"] == ["params/text_summary", "val/PR_curve"]  # the options and hyp, the PR curve


def test_no_tensorboard_or_another_rank_means_a_silent_logger(tmp_path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    logger = open_trackers(TrackerRun(tmp_path), is_main=True)  # the default, TensorBoard, not installed
    assert isinstance(logger, NullLogger)
    logger.log_epoch(0, {"x": 1.0})
    logger.log_batch(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), 0)
    logger.close()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert isinstance(open_trackers(TrackerRun(tmp_path), is_main=False), NullLogger)
    assert not list(tmp_path.iterdir())


def test_setup_logging_is_idempotent_and_writes_to_the_stdout_of_now(monkeypatch, capsys) -> None:
    import io
    import logging
    import sys

    from utils.log import LOGGER, setup_logging

    first, second = io.StringIO(), io.StringIO()
    other = logging.NullHandler()  # someone else's handler stays
    LOGGER.addHandler(other)
    monkeypatch.setattr(sys, "stdout", first)
    setup_logging()
    monkeypatch.setattr(sys, "stdout", second)
    setup_logging()
    LOGGER.info("once")
    assert (first.getvalue(), second.getvalue()) == ("", "once\n")
    assert other in LOGGER.handlers and not LOGGER.propagate
    assert sum(isinstance(h, type(LOGGER.handlers[-1])) for h in LOGGER.handlers) == 1  # one console handler
