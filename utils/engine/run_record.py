"""The record a training run keeps in its folder: results.csv, weights/last.pt and best.pt, early stopping.

``RunRecord.end_epoch`` is everything that happens after an epoch's validation; ``save_mid_epoch`` writes
last.pt inside an epoch. Checkpoints are written by one background thread from a snapshot (a copy of every
tensor), so training goes on while the file is written and never waits longer than the copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.checkpoint import copy_checkpoint, save_checkpoint, weights_are_finite
from utils.log import LOGGER
from utils.metrics import fitness
from utils.results_log import append_results_row, extend_results_columns, truncate_results


def snapshot(obj: Any) -> Any:
    """A deep copy of the tensors in nested dicts and lists (what a background write may hold while training)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints in a background thread, one at a time, in the order they were submitted."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, ckpt: dict[str, Any], paths: list[Path]) -> None:
        self.flush()
        self._thread = threading.Thread(target=self._write, args=(ckpt, paths), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, ckpt: dict[str, Any], paths: list[Path]) -> None:
        try:
            first, *others = paths
            save_checkpoint(ckpt, first)
            for path in others:
                copy_checkpoint(first, path)
        except BaseException as e:  # raised again in the training thread by flush()
            self._error = e

    def flush(self) -> None:
        """Wait for the write in flight; raise its error, if any, here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


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
    ):
        self.save_dir = save_dir
        self.columns = columns  # results.csv's (utils/results_log.py)
        self.weights_dir = save_dir / "weights"
        self.last, self.best = self.weights_dir / "last.pt", self.weights_dir / "best.pt"
        # 0 turns early stopping off (YOLOv5's reading); so does --noval: without validation nothing improves.
        self.patience = patience if patience > 0 and not noval else None
        self.nosave, self.save_period = nosave, save_period
        self.best_fitness, self.best_epoch = best_fitness, best_epoch
        # A resumed run keeps counting toward --patience from its best epoch.
        self.since_best = start_epoch - 1 - best_epoch if best_epoch >= 0 else 0
        self.writer = CheckpointWriter()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        truncate_results(save_dir / "results.csv", keep_below_epoch=start_epoch)  # rows past the checkpoint go
        extend_results_columns(save_dir / "results.csv", columns)  # a run written before the columns appended last
        self.stop = False

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

    def save_mid_epoch(self, ckpt: dict[str, Any]) -> None:
        self._submit(ckpt, [self.last])

    def _submit(self, ckpt: dict[str, Any], paths: list[Path]) -> None:
        if not weights_are_finite(ckpt):
            LOGGER.warning(f"WARNING weights are not finite: {', '.join(p.name for p in paths)} not overwritten")
            return
        self.writer.submit(snapshot(ckpt), paths)

    def close(self) -> None:
        """Wait for the checkpoint being written (before reading it back, and before the process ends)."""
        self.writer.flush()

    @contextlib.contextmanager
    def kept_on_error(self) -> Iterator[None]:
        """An error leaving the block (a diverged run, Ctrl-C, a lost rank) first waits for the checkpoint being
        written: the writer is a daemon thread, and the process would end it mid-write, losing the last epoch."""
        try:
            yield
        except BaseException:
            try:
                self.writer.flush()
            except Exception as e:  # the error on its way out is the one to report
                LOGGER.warning(f"WARNING the last checkpoint was not written: {e}")
            raise
