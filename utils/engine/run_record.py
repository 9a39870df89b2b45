"""The record a training run keeps in its folder: results.csv, weights/last.pt and best.pt, run.json, early
stopping.

``RunRecord.end_epoch`` is everything that happens after an epoch's validation; ``save_mid_epoch`` writes
last.pt inside an epoch. A checkpoint is taken as a host snapshot (checkpoint.py: ``host_snapshot``, one copy
of every tensor) and written by ``CheckpointWriter``'s background thread, so training never waits for the disk:
see docs/design.md, "The checkpoint writer".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from utils.checkpoint import (
    RUN_STATE,
    checkpoint_label,
    copy_checkpoint,
    host_snapshot,
    load_checkpoint,
    run_state,
    save_checkpoint,
    weights_are_finite,
    write_run_state,
)
from utils.engine.phases import PhaseClock
from utils.engine.run_upload import RunUpload
from utils.log import LOGGER
from utils.metrics import fitness
from utils.results_log import append_results_row, extend_results_columns, truncate_results

EXIT_WAIT_S = 60.0  # how long a run leaving on an error waits for the checkpoint being written


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint held in host memory until it is written."""

    state: dict[str, Any]  # from host_snapshot: nothing in it changes while training goes on
    label: str  # where it stands: "epoch 3", "epoch 4 batch 120"
    serial: int  # the order of submission: the larger, the newer


@dataclass(frozen=True)
class Written:
    """A checkpoint file complete on disk."""

    path: Path
    label: str
    serial: int
    seconds: float  # how long writing it took


@dataclass
class _Queue:
    """The writer's shared state (under ``lock``)."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[Path, Snapshot] = field(default_factory=dict)  # per file, the newest snapshot not yet written
    busy: bool = False  # the thread is writing
    thread: threading.Thread | None = None
    error: BaseException | None = None


class CheckpointWriter:
    """Writes checkpoints from host snapshots in one background thread; ``submit`` never waits for the disk.

    Each file has at most one snapshot waiting: a newer one for the same file replaces it (a slow disk skips
    checkpoints, never training), so held memory stays bounded by the files. A snapshot for several files
    (last.pt and best.pt) is serialised once and copied. Files appear atomically (utils/files.py). Each file
    written is passed to every ``on_written`` callback, in the writer's thread: where the run record and, later,
    uploads to object storage plug in.
    """

    def __init__(self, clock: PhaseClock | None = None) -> None:
        self._q = _Queue()
        self._serials = count()
        self.clock = clock or PhaseClock()
        self.on_written: list[Callable[[Written], None]] = []
        self.newest_complete: Written | None = None  # the newest snapshot written in full to a file
        self._ended: list[threading.Thread] = []  # writer threads started, joined once they have nothing left

    def submit(self, state: dict[str, Any], paths: list[Path], label: str = "") -> None:
        """Queue ``state`` (a host snapshot, not touched again by the caller) for ``paths``; returns at once.
        An error of an earlier write is raised here."""
        self._raise_error()
        snapshot = Snapshot(state, label or checkpoint_label(state), next(self._serials))
        q = self._q
        with q.lock:
            for path in paths:
                q.pending[Path(path)] = snapshot
            if q.thread is None:
                q.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
                q.thread.start()
                self._ended.append(q.thread)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) until every snapshot is written; True when
        they are. An error of a write is raised here."""
        q = self._q
        with q.lock:
            done = q.lock.wait_for(lambda: not q.pending and not q.busy, timeout)
            ended = [t for t in self._ended if t is not q.thread] if done else []
        # A thread with nothing left is on its way out: joined, so that none is still ending when the process
        # exits (a thread that used torch, torn down during the interpreter's exit, can abort the process).
        for thread in ended:
            thread.join()
            self._ended.remove(thread)
        self._raise_error()
        return done

    def flush(self) -> None:
        self.wait()

    def _raise_error(self) -> None:
        q = self._q
        with q.lock:
            error, q.error = q.error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        """The thread: write what is pending, oldest snapshot first, until nothing is; then end."""
        q = self._q
        while True:
            with q.lock:
                if not q.pending:
                    q.busy, q.thread = False, None
                    q.lock.notify_all()
                    return
                batch, q.pending, q.busy = q.pending, {}, True
            groups: dict[int, tuple[Snapshot, list[Path]]] = {}
            for path, snapshot in batch.items():
                groups.setdefault(snapshot.serial, (snapshot, []))[1].append(path)
            for serial in sorted(groups):
                try:
                    self._write(*groups[serial])
                except BaseException as e:  # raised again in the training thread by submit() or wait()
                    with q.lock:
                        q.error = e

    def _write(self, snapshot: Snapshot, paths: list[Path]) -> None:
        if not weights_are_finite(snapshot.state):
            LOGGER.warning(f"WARNING weights are not finite: {', '.join(p.name for p in paths)} not overwritten")
            return
        t0 = time.monotonic()
        first, *others = paths
        save_checkpoint(snapshot.state, first)
        for path in others:
            copy_checkpoint(first, path)
        seconds = time.monotonic() - t0
        names = ", ".join(p.name for p in paths)
        self.clock.stamp(f"checkpoint {names} ({snapshot.label}) written", seconds)
        for path in paths:
            written = Written(path, snapshot.label, snapshot.serial, seconds)
            if self.newest_complete is None or written.serial > self.newest_complete.serial:
                self.newest_complete = written
            for callback in self.on_written:
                callback(written)


class RunRecord:
    """Keeps best/last checkpoints, the results rows and the early-stopping count of one run folder."""

    def __init__(
        self,
        save_dir: Path,
        columns: tuple[str, ...],
        *,
        patience: int,
        noval: bool,
        nosave: bool,
        save_period: int,
        best_fitness: float = 0.0,
        best_epoch: int = -1,
        start_epoch: int = 0,
        clock: PhaseClock | None = None,
    ):
        self.save_dir = save_dir
        self.upload: RunUpload | None = None  # a run folder on object storage (``upload_to``)
        self.columns = columns  # results.csv's (utils/results_log.py)
        self.weights_dir = save_dir / "weights"
        self.last, self.best = self.weights_dir / "last.pt", self.weights_dir / "best.pt"
        # 0 turns early stopping off (YOLOv5's reading); so does --noval: without validation nothing improves.
        self.patience = patience if patience > 0 and not noval else None
        self.nosave, self.save_period = nosave, save_period
        self.best_fitness, self.best_epoch = best_fitness, best_epoch
        # A resumed run keeps counting toward --patience from its best epoch.
        self.since_best = start_epoch - 1 - best_epoch if best_epoch >= 0 else 0
        self.writer = CheckpointWriter(clock)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        truncate_results(save_dir / "results.csv", keep_below_epoch=start_epoch)  # rows past the checkpoint go
        extend_results_columns(save_dir / "results.csv", columns)  # a run written before the columns appended last
        self.stop = False
        # run.json: "running" until the run ends its epochs (what --resume without a path looks for), and the
        # newest complete checkpoint, updated by the writer's thread as each is written.
        self._state_lock = threading.Lock()
        before = run_state(save_dir) or {}  # a resumed run's newest checkpoint stays named until a newer one
        self.state: dict[str, Any] = {
            "status": "running",
            "newest_checkpoint": before.get("newest_checkpoint"),
            "checkpoint": before.get("checkpoint"),
        }
        self._write_state()
        self.writer.on_written.append(self._written)

    def upload_to(self, upload: RunUpload) -> None:
        """The run folder is at a URL: ``save_dir`` is the local staging folder that ``upload`` sends there. From
        here on each checkpoint is uploaded once written, and run.json (uploaded now) names the newest in the bucket
        and beats with ``upload``'s thread."""
        self.upload = upload
        upload.beat = self.beat
        self._write_state()

    def end_epoch(
        self,
        epoch: int,
        train_losses: np.ndarray,
        results: tuple[float, ...] | None,
        lrs: list[float],
        ckpt: dict[str, Any],
        final: bool,
        extra: Sequence[float] = (),
    ) -> list[float]:
        """Record an epoch: results row, last.pt, best.pt when it improved; returns the row (``should_stop`` says
        whether early stopping ends the run).

        ``results`` is None for an epoch that was not validated (--noval): it cannot be best, and its row
        holds zeros for the metrics. ``extra``: the values of the columns after the learning rates (the time
        split). ``ckpt`` holds this epoch's training state; it is snapshotted here.
        """
        n_results = len(self.columns) - 1 - len(train_losses) - len(lrs) - len(extra)  # metrics, validation losses
        row = results if results is not None else (0.0,) * n_results
        improved = False
        if results is not None:
            current = float(fitness(np.array(results[:4])))
            improved = current > self.best_fitness or self.best_epoch < 0
            if improved:
                self.best_fitness, self.best_epoch = current, epoch
        ckpt.update(best_fitness=self.best_fitness, best_epoch=self.best_epoch)
        self.since_best = 0 if improved else self.since_best + 1
        values = [epoch, *train_losses.tolist(), *row, *lrs, *extra]
        append_results_row(self.save_dir / "results.csv", values, self.columns)

        if not self.nosave or final:
            paths = [self.last] + ([self.best] if improved else [])
            if self.save_period > 0 and (epoch + 1) % self.save_period == 0:
                paths.append(self.weights_dir / f"epoch{epoch}.pt")
            self._submit(ckpt, paths)
        if self.patience is not None and self.since_best >= self.patience:
            LOGGER.info(
                f"Stopping early: no improvement in the last {self.patience} epochs (best: epoch {self.best_epoch})"
            )
            self.stop = True
        return values

    def should_stop(self) -> bool:
        """Whether early stopping (--patience) ends the run after the epoch recorded last."""
        return self.stop

    def best_checkpoint(self) -> dict[str, Any] | None:
        """The best epoch's checkpoint so far (weights/best.pt, once the writer has written it), or None where no
        epoch was validated or none was saved (--nosave)."""
        if self.best_epoch < 0:
            return None
        self.writer.wait()
        return load_checkpoint(self.best) if self.best.exists() else None

    def save_mid_epoch(self, ckpt: dict[str, Any]) -> None:
        self._submit(ckpt, [self.last])

    def _submit(self, ckpt: dict[str, Any], paths: list[Path]) -> None:
        self.writer.submit(host_snapshot(ckpt), paths)

    def _written(self, written: Written) -> None:
        """The writer's thread: a file is complete; last.pt's newest becomes the run's newest checkpoint (on object
        storage once it is uploaded: the record names the newest checkpoint complete in the bucket)."""
        if self.upload is not None and not self.upload.upload(written.path.relative_to(self.save_dir).as_posix()):
            return
        if written.path == self.last:
            self._write_state(newest_checkpoint=str(written.path.relative_to(self.save_dir)), checkpoint=written.label)

    def _write_state(self, **changes: Any) -> None:
        with self._state_lock:  # the training thread and the writer's both update it
            self.state.update(changes, updated=time.time())
            write_run_state(self.save_dir, self.state)
            if self.upload is not None:
                self.upload.upload(RUN_STATE)

    def beat(self) -> None:
        """The record's heartbeat (``updated``), so that a resume elsewhere never takes a run that is alive."""
        self._write_state()

    def mark_finished(self) -> None:
        """The run trained all its epochs (or stopped early, or its time budget ended it): nothing to resume."""
        self._write_state(status="finished")

    def close(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until done) for the checkpoints being written, then name the newest
        complete one; True when nothing is left to write."""
        done = self.writer.wait(timeout)
        newest = self.writer.newest_complete
        if not done:
            LOGGER.warning(f"WARNING a checkpoint is still being written after {timeout:.0f} s; not waiting longer")
        if self.upload is not None and self.state.get("newest_checkpoint"):
            where = self.upload.storage.full(self.state["newest_checkpoint"])
            LOGGER.info(f"newest complete checkpoint: {where} ({self.state.get('checkpoint')})")
        elif newest is not None:
            LOGGER.info(f"newest complete checkpoint: {newest.path} ({newest.label})")
        return done

    @contextlib.contextmanager
    def kept_on_error(self) -> Iterator[None]:
        """An error leaving the block (a diverged run, Ctrl-C, a lost rank) first waits (up to ``EXIT_WAIT_S``) for
        the checkpoint being written: the writer is a daemon thread, and the process would end it mid-write, losing
        the last epoch."""
        try:
            yield
        except BaseException:
            try:
                self.close(EXIT_WAIT_S)
            except Exception as e:  # the error on its way out is the one to report
                LOGGER.warning(f"WARNING the last checkpoint was not written: {e}")
            raise
