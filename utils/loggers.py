"""The logger seam now lives in ``utils/trackers/``; this module keeps train.py's present calls working until
the engine opens the trackers itself (``open_trackers``) and this module goes."""
from __future__ import annotations

from pathlib import Path

from utils.trackers import NullLogger, RunLogger, TrackerRun, open_trackers

__all__ = ["NullLogger", "RunLogger", "make_logger"]


def make_logger(save_dir: Path, is_main: bool) -> RunLogger:
    """TensorBoard for global rank 0 (when the package is there), otherwise a logger that does nothing."""
    return open_trackers(TrackerRun(run_dir=Path(save_dir), names=("tensorboard",)), is_main)
