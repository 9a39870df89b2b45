"""One tracker behind a bounded queue, driven by its own thread: the training loop never waits for it.

MLflow's client retries a failed request for minutes; a disk fills up; a W&B service dies. None of it may stop
or slow training: a call only puts a record on the queue (or discards it when the queue is full), and an error
in the tracker's thread drops the tracker for the rest of the run with one warning. Epochs that the tracker
run already holds (``Tracker.held``) are never logged again, so a resumed run holds every epoch once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from utils.log import LOGGER
from utils.trackers.base import Tracker, TrackerRun

MAX_PENDING = 64  # records waiting per tracker; an epoch is one or two


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one short line (MLflow's carry the whole request and its retries)."""
    text = (str(error).strip().splitlines() or [""])[0]
    text = f"{error.__class__.__name__}: {text}" if text else error.__class__.__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BackgroundTracker:
    """Runs ``tracker``'s calls in order in a daemon thread; ``submit`` never blocks."""

    def __init__(
        self,
        tracker: Tracker,
        run: TrackerRun,
        saved: Mapping[str, str] | None,
        on_ids: Callable[[str, dict[str, str]], None],
        max_pending: int = MAX_PENDING,
    ):
        self.tracker = tracker
        self.failed = False
        self.discarded = 0
        self._held: dict[str, set[int]] = {}
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._on_ids = on_ids
        planned = tracker.planned_ids(run, saved)
        if planned:
            on_ids(tracker.name, planned)
        self._queue.put(("open", (run, saved)))
        self._thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    # ---- the caller's side ------------------------------------------------------------------------------

    def submit(self, method: str, *args: Any) -> None:
        """Queue ``method(*args)`` for the tracker's thread; discarded when the tracker failed or is behind."""
        if self.failed:
            return
        try:
            self._queue.put_nowait((method, args))
        except queue.Full:
            self.discarded += 1
            if self.discarded == 1:
                LOGGER.warning(
                    f"WARNING {self.tracker.title} is {self._queue.maxsize} records behind: new records "
                    f"are discarded until it catches up (results.csv keeps them; the tracker run is "
                    f"completed from it at the end)"
                )

    def flush(self, timeout: float) -> bool:
        """Wait until the thread has handled everything submitted before; False after ``timeout`` seconds."""
        if self.failed or not self._thread.is_alive():
            return True
        done = threading.Event()
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(("barrier", (done,)), timeout=max(timeout, 0.0))
        except queue.Full:
            return False
        return done.wait(max(0.0, deadline - time.monotonic())) or self.failed

    def stop(self, status: str, timeout: float) -> bool:
        """End the tracker run with ``status`` and the thread; False when it did not finish in ``timeout``."""
        if self.failed:  # nothing more to hand over; its thread ends on its own
            return True
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            try:
                self._queue.put(("close", (status,)), timeout=max(timeout, 0.0))
            except queue.Full:
                return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    # ---- the tracker's thread ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            method, args = self._queue.get()
            if method == "barrier":
                args[0].set()
                continue
            try:
                getattr(self, f"_{method}")(*args)
            except Exception as e:  # any failure of a tracker: dropped, training goes on
                self._fail(e)
                return
            if method == "close":
                return

    def _fail(self, error: Exception) -> None:
        self.failed = True
        LOGGER.warning(
            f"WARNING {self.tracker.title} stopped for the rest of this run ({one_line(error)}); "
            f"training goes on and results.csv keeps the record"
        )
        try:  # let it release what it holds (a W&B service, open files); it may fail again
            self.tracker.abandon()
        except Exception as e:
            LOGGER.debug(f"{self.tracker.title}: closing after the failure failed too ({one_line(e)})")
        while True:  # wake whoever waits on a barrier; nothing else will be handled
            try:
                method, args = self._queue.get_nowait()
            except queue.Empty:
                return
            if method == "barrier":
                args[0].set()

    def _open(self, run: TrackerRun, saved: Mapping[str, str] | None) -> None:
        ids = self.tracker.open(run, saved)
        self._held = {key: set(epochs) for key, epochs in self.tracker.held().items()}
        self._on_ids(self.tracker.name, ids)

    def _epoch(self, epoch: int, values: Mapping[str, float]) -> None:
        new = {k: v for k, v in values.items() if epoch not in self._held.get(k, ())}
        if new:
            self.tracker.log_metrics(epoch, new)
            for key in new:
                self._held.setdefault(key, set()).add(epoch)

    def _reconcile(self, rows: Mapping[int, Mapping[str, float]]) -> None:
        """Log the results.csv rows (epoch -> values) that the tracker run does not hold yet, in epoch order."""
        for epoch in sorted(rows):
            self._epoch(epoch, rows[epoch])

    def _params(self, params: Mapping[str, Any]) -> None:
        self.tracker.log_params(params)

    def _batch(self, images: Any, step: int) -> None:
        self.tracker.log_batch(images, step)

    def _pr_curve(self, precision: Any, recall: Any, step: int) -> None:
        self.tracker.log_pr_curve(precision, recall, step)

    def _images(self, paths: list, step: int) -> None:
        self.tracker.log_images(paths, step)

    def _artifacts(self, paths: list) -> None:
        self.tracker.log_artifacts(paths)

    def _close(self, status: str) -> None:
        self.tracker.close(status)
