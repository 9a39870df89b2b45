"""The seam between training and experiment trackers, and what one tracker implements.

``RunLogger`` is what the training engine calls, on global rank 0 (the other ranks get ``NullLogger``). Every
call returns at once: each tracker runs in its own thread behind a bounded queue (``background.py``), so a slow
or unreachable tracker never slows training, and a failing one is dropped with one warning. results.csv stays
the run's record; trackers mirror it.

``Tracker`` is one tracker's side (TensorBoard, MLflow, W&B): plain blocking calls, made in its thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# The statuses a tracker run ends with (``RunLogger.close``).
FINISHED, FAILED, KILLED = "finished", "failed", "killed"


class RunLogger(Protocol):
    """What training calls; every call returns without waiting for a tracker."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's options and hyper-parameters (``run_params``), once per start of the process."""

    def log_epoch(self, epoch: int, values: Mapping[str, float]) -> None:
        """One epoch's scalars under results.csv's column names (losses, metrics, learning rates)."""

    def log_batch(self, images: Any, step: int) -> None:
        """A training batch (uint8 tensor, b x 3 x h x w) as one mosaic image; copied before this returns."""

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        """The mean precision-recall curve (IoU 0.5) of a validation."""

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        """Image files (validation plots, training mosaics) as they are at ``step``."""

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """Files kept with the tracker run: weights (``*.pt``), results.csv."""

    def state(self) -> dict[str, dict[str, str]]:
        """Each tracker's run ids, for the checkpoint (``TrackerRun.saved`` of a resumed run)."""

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every tracker to finish what it was given; True when all did."""

    def close(self, status: str = FINISHED) -> None:
        """Complete the trackers from results.csv, end their runs with ``status``; waits a bounded time."""


class NullLogger:
    """The logger of ranks other than global rank 0, and of runs without trackers: does nothing."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_epoch(self, epoch: int, values: Mapping[str, float]) -> None:
        pass

    def log_batch(self, images: Any, step: int) -> None:
        pass

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        pass

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        pass

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        pass

    def state(self) -> dict[str, dict[str, str]]:
        return {}

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, status: str = FINISHED) -> None:
        pass


@dataclass(frozen=True)
class TrackerRun:
    """What the trackers of one training run are told when they open.

    ``resumed``: the run continues (``--resume``, a launcher restart); its trackers continue their own runs,
    found in the run folder's ``trackers.yaml`` or else in ``saved`` (``RunLogger.state()`` as the checkpoint
    kept it). A run that is not resumed starts new tracker runs, even in a folder that held another run.
    """

    run_dir: Path  # the run folder: trackers.yaml, results.csv, TensorBoard's files, W&B's folder
    names: tuple[str, ...] = ("tensorboard",)
    experiment: str = ""  # MLflow experiment and W&B project; default: the name of the run folder's parent
    run_name: str = ""  # default: the run folder's name
    resumed: bool = False
    saved: Mapping[str, Mapping[str, str]] | None = None

    @property
    def experiment_name(self) -> str:
        return self.experiment or Path(self.run_dir).resolve().parent.name or "default"

    @property
    def name(self) -> str:
        return self.run_name or Path(self.run_dir).name

    @property
    def results_csv(self) -> Path:
        return Path(self.run_dir) / "results.csv"


class Tracker:
    """One tracker's calls, all blocking, made from its own thread. The defaults do nothing.

    ``open`` starts or continues the tracker run and returns its ids (written to trackers.yaml and the
    checkpoint); ``held`` then says which epochs the tracker run already holds, per metric name, so that an
    epoch is never logged twice. Any exception drops the tracker for the rest of the run (one warning).
    """

    name = ""  # as in --loggers
    title = ""  # in messages
    package = ""  # the optional package it needs

    def planned_ids(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        """Ids the tracker chooses itself, known before it opens (kept at once, even if opening takes long)."""
        return {}

    def open(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        raise NotImplementedError

    def held(self) -> dict[str, set[int]]:
        return {}

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, epoch: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_batch(self, images: Any, step: int) -> None:
        pass

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        pass

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        pass

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        pass

    def close(self, status: str) -> None:
        pass

    def abandon(self) -> None:
        """Release what it holds after a failure (its run is not ended where that needs what just failed)."""
        self.close(FAILED)
