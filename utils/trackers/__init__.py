"""Experiment trackers: TensorBoard, MLflow and W&B behind one seam, ``RunLogger``, several at once.

The engine opens them once per process with ``open_trackers(TrackerRun(...), is_main)`` and calls the
``RunLogger`` methods; see base.py for the seam, composite.py for opening, continuity and reconciliation with
results.csv, background.py for why no call ever waits for a tracker. Each tracker's package is imported only
when it opens (``--loggers`` names it), in its own thread.
"""

from utils.trackers.base import FAILED, FINISHED, KILLED, NullLogger, RunLogger, Tracker, TrackerRun
from utils.trackers.composite import (
    DEFAULT_TRACKERS,
    IDS_FILE,
    TRACKER_NAMES,
    Trackers,
    check_trackers,
    open_trackers,
    plot_files,
    preload,
    read_ids,
    read_results,
    run_params,
)

__all__ = [
    "DEFAULT_TRACKERS",
    "FAILED",
    "FINISHED",
    "IDS_FILE",
    "KILLED",
    "TRACKER_NAMES",
    "NullLogger",
    "RunLogger",
    "Tracker",
    "TrackerRun",
    "Trackers",
    "check_trackers",
    "open_trackers",
    "plot_files",
    "preload",
    "read_ids",
    "read_results",
    "run_params",
]
