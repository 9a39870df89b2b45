"""Several trackers at once (``--loggers tensorboard mlflow wandb``), their run ids kept in the run folder.

``open_trackers`` gives global rank 0 a ``Trackers`` over the trackers named, each in its own thread
(``background.py``), and every other rank a ``NullLogger``. When a tracker run starts, its ids go to
``<run folder>/trackers.yaml`` (and ``state()`` hands them to the checkpoint), so that a resumed run, a launcher
restart or a resume inside an epoch continues the same tracker run. Opening reconciles each tracker with
results.csv: epochs results.csv holds and the tracker run does not are logged, epochs it holds are not logged
again; closing does the same once more, so records discarded on the way are completed from results.csv.
"""

from __future__ import annotations

import importlib.util
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from utils.errors import UserError, describe
from utils.files import atomic_output
from utils.log import LOGGER
from utils.trackers.background import MAX_PENDING, BackgroundTracker
from utils.trackers.base import FINISHED, NullLogger, RunLogger, Tracker, TrackerRun

TRACKER_NAMES = ("tensorboard", "mlflow", "wandb")
DEFAULT_TRACKERS = ("tensorboard",)  # as before trackers: never more because a package happens to be installed
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
IDS_FILE = "trackers.yaml"
CLOSE_TIMEOUT = 60.0  # seconds the end of a run waits for its trackers (MLflow's retries can take minutes)
MAX_BATCH_IMAGES = 16  # of a training batch handed to log_batch


def check_trackers(names: Sequence[str]) -> tuple[str, ...]:
    """The tracker names, checked before anything starts: an unknown name or a missing package (MLflow, W&B)
    is a one-line error. A missing tensorboard is not: it is the default, and the run says so in one line."""
    for name in names:
        if name not in TRACKER_NAMES:
            raise UserError(f"--loggers {name}: not a tracker (choose from {', '.join(TRACKER_NAMES)})")
        if name != "tensorboard" and importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"--loggers {name} needs the {PACKAGES[name]} package (pip install {PACKAGES[name]})")
    return tuple(dict.fromkeys(names))


PRELOADED = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow.tracking", "wandb": "wandb"}


def preload(names: Sequence[str]) -> None:
    """Import the trackers' packages in a background thread now, while the run builds its data and model: MLflow's
    takes seconds, which its tracker would otherwise spend before its first call. Nothing waits for it; the
    trackers import what they need themselves (an import under way elsewhere is waited for, not repeated)."""
    modules = [PRELOADED[n] for n in dict.fromkeys(names) if n in PRELOADED]
    if modules:
        threading.Thread(target=_import_quietly, args=(modules,), name="tracker-preload", daemon=True).start()


def _import_quietly(modules: list[str]) -> None:
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # the tracker says so when it opens
            LOGGER.debug(f"preloading {module} failed ({e.__class__.__name__}: {e})")


def make_tracker(name: str) -> Tracker:
    """The tracker of that name; its package is imported only when the tracker opens, in its own thread."""
    if name == "tensorboard":
        from utils.trackers.tensorboard import TensorBoardTracker

        return TensorBoardTracker()
    if name == "mlflow":
        from utils.trackers.mlflow import MLflowTracker

        return MLflowTracker()
    if name == "wandb":
        from utils.trackers.wandb import WandbTracker

        return WandbTracker()
    raise UserError(f"--loggers {name}: not a tracker (choose from {', '.join(TRACKER_NAMES)})")


def open_trackers(
    run: TrackerRun, is_main: bool, *, max_pending: int = MAX_PENDING, close_timeout: float = CLOSE_TIMEOUT
) -> RunLogger:
    """The logger of this process: the trackers of ``run.names`` on global rank 0, a ``NullLogger`` elsewhere.

    Call it once results.csv holds only the epochs before the one training starts at (``RunRecord`` trims it).
    """
    names = check_trackers(run.names)
    if not is_main or not names:
        return NullLogger()
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        LOGGER.info("TensorBoard: not installed (pip install tensorboard); no event files")
        names = tuple(n for n in names if n != "tensorboard")
        if not names:
            return NullLogger()
    return Trackers(run, [make_tracker(n) for n in names], max_pending=max_pending, close_timeout=close_timeout)


def read_results(csv_file: Path) -> dict[int, dict[str, float]]:
    """results.csv as {epoch: {column: value}}; a later row of an epoch replaces an earlier one. An empty value
    (``nan``: a column added after the row was written) is left out; a row that is not all numbers, or whose epoch
    is not a whole number of at least 0, is skipped. An unreadable file is one warning naming it, and no rows."""
    try:
        text = Path(csv_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        LOGGER.warning(f"WARNING {csv_file}: unreadable ({describe(e)}); trackers are not reconciled with it")
        return {}
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    columns = [c.strip() for c in lines[0].split(",")]
    rows: dict[int, dict[str, float]] = {}
    for line in lines[1:]:
        values = line.split(",")
        if len(values) != len(columns):  # a row cut short by a kill: results.csv's writer rewrites it
            continue
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            continue
        epoch = numbers[0]
        if math.isfinite(epoch) and epoch.is_integer() and 0 <= epoch < 2**31:  # `1.0` is epoch 1, as resume reads it
            rows[int(epoch)] = {c: x for c, x in zip(columns[1:], numbers[1:]) if not math.isnan(x)}
    return rows


def read_ids(run_dir: Path) -> dict[str, dict[str, str]]:
    """trackers.yaml of a run folder: {tracker name: its run ids}; {} when there is none (or it is unreadable)."""
    path = Path(run_dir) / IDS_FILE
    try:
        ids = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        LOGGER.warning(f"WARNING {path}: unreadable ({e.__class__.__name__}); trackers start new runs")
        return {}
    return (
        {str(k): {str(a): str(b) for a, b in v.items()} for k, v in ids.items() if isinstance(v, dict)}
        if isinstance(ids, dict)
        else {}
    )


def run_params(opt: Mapping[str, Any], hyp: Mapping[str, float]) -> dict[str, Any]:
    """The parameters a tracker run records: the options under their names, the hyper-parameters as hyp/<name>."""
    plain = {k: (str(v) if isinstance(v, Path) else v) for k, v in opt.items()}
    return {**plain, **{f"hyp/{k}": v for k, v in hyp.items()}}


def plot_files(run_dir: Path) -> list[Path]:
    """The images in a run folder (validation plots, training mosaics, label statistics), for ``log_images``."""
    return sorted(p for p in Path(run_dir).iterdir() if p.suffix.lower() in (".png", ".jpg") and p.is_file())


class Trackers:
    """Several trackers behind one ``RunLogger``, each in its own thread."""

    def __init__(
        self,
        run: TrackerRun,
        trackers: list[Tracker],
        *,
        max_pending: int = MAX_PENDING,
        close_timeout: float = CLOSE_TIMEOUT,
    ):
        self.run = run
        self.close_timeout = close_timeout
        self._lock = threading.Lock()
        self._ids: dict[str, dict[str, str]] = {}
        self._ids_warned = False
        self.wants_batches = any(t.name == "tensorboard" for t in trackers)
        known = {**(run.saved or {}), **read_ids(run.run_dir)} if run.resumed else {}
        self._known = known  # a new run's trackers.yaml forgets the folder's earlier runs
        self._closed = False
        self.workers = [BackgroundTracker(t, run, known.get(t.name), self._record_ids, max_pending) for t in trackers]
        self._submit("reconcile", read_results(run.results_csv))

    def _record_ids(self, name: str, ids: dict[str, str]) -> None:
        """A tracker run's ids (planned, or known once it opened): they go to trackers.yaml at once."""
        if not ids:
            return
        with self._lock:
            self._ids[name] = dict(ids)
            known = {**self._known, **self._ids}
            try:
                with atomic_output(Path(self.run.run_dir) / IDS_FILE) as tmp:
                    tmp.write_text(yaml.safe_dump(known, sort_keys=True), encoding="utf-8")
            except OSError as e:
                if not self._ids_warned:
                    LOGGER.warning(
                        f"WARNING {self.run.run_dir / IDS_FILE} not written ({e.__class__.__name__}); "
                        f"the checkpoint still keeps the tracker runs' ids"
                    )
                self._ids_warned = True

    def _submit(self, method: str, *args: Any) -> None:
        if self._closed:  # after close: nothing would take it
            return
        for worker in self.workers:
            worker.submit(method, *args)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._submit("params", dict(params))

    def log_epoch(self, epoch: int, values: Mapping[str, float]) -> None:
        self._submit("epoch", int(epoch), {k: float(v) for k, v in values.items()})

    def log_batch(self, images: Any, step: int) -> None:
        if self.wants_batches:  # a copy: the batch's memory is reused for the next one
            self._submit("batch", images[:MAX_BATCH_IMAGES].detach().cpu().clone(), int(step))
            self.wants_batches = False  # TensorBoard shows one mosaic per process

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        self._submit("pr_curve", np.array(precision, dtype=np.float64), np.array(recall, dtype=np.float64), int(step))

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        self._submit("images", [Path(p) for p in paths], int(step))

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        self._submit("artifacts", [Path(p) for p in paths if Path(p).is_file()])

    def state(self) -> dict[str, dict[str, str]]:
        with self._lock:
            return {k: dict(v) for k, v in {**self._known, **self._ids}.items()}

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.flush(max(0.0, deadline - time.monotonic())) for w in self.workers)

    def close(self, status: str = FINISHED) -> None:
        """Complete every tracker from results.csv, end its run, and wait at most ``close_timeout`` in all."""
        if self._closed:
            return
        self._submit("reconcile", read_results(self.run.results_csv))
        self._closed = True
        deadline = time.monotonic() + self.close_timeout
        for worker in self.workers:
            if not worker.stop(status, max(0.0, deadline - time.monotonic())) and not worker.failed:
                LOGGER.warning(
                    f"WARNING {worker.tracker.title} did not finish within {self.close_timeout:g} s; "
                    f"its last records may be missing (results.csv holds them)"
                )
