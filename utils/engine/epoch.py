"""One epoch of optimizer steps (step.py), from a given batch on (a resumed epoch), with its progress and where its
time went (timing.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

from models.loss import UNMARKED
from utils.distributed import de_parallel
from utils.engine.interrupt import STOP
from utils.engine.step import (
    Readout,
    SaveMidEpoch,
    SavePolicy,
    Stepper,
    Window,
    accumulation_windows,
    flush,
    train_step,
)
from utils.engine.tally import LossTally
from utils.engine.timing import EpochTime, RunProgress, format_duration, gather_epoch_time, step_phases
from utils.log import LOGGER
from utils.trackers import NullLogger, RunLogger


@dataclass
class EpochHooks:
    """What an epoch reports to and saves through (rank 0's; the other ranks get no-ops)."""

    epochs: int  # the run's length now (the progress bar's "epoch/epochs")
    batch_size: int  # global, over all ranks (the epoch's images per second)
    loss_names: tuple[str, ...]
    save_policy: SavePolicy
    save_mid_epoch: SaveMidEpoch | None = None
    logger: RunLogger = field(default_factory=NullLogger)
    plots_dir: Path | None = None  # train_batch*.jpg of the epoch's first batches
    progress: RunProgress | None = None  # the run's remaining time on the progress line (rank 0)
    after_step: Callable[[], None] | None = None  # called after each optimizer step (--profile)


def train_one_epoch(
    stepper: Stepper, loader: Any, epoch: int, start_batch: int, tally: LossTally, hooks: EpochHooks
) -> tuple[LossTally, EpochTime]:
    """One epoch of optimizer steps, from ``start_batch`` on (step.py: ``train_step``); returns the epoch's losses and
    where its step time went. The losses reach ``tally`` at the read-backs and at the epoch's end.

    A checkpoint is written after a step, every --save-steps steps, or once the read-back brings rank 0's wish
    (--save-minutes) or any rank's wish to stop (Ctrl-C, SIGTERM: ``stepper.stopped`` is set and the epoch ends
    there). ``stepper.marks`` times the phases of each step (timing.py): data, forward, sync, backward, optimizer.
    """
    stepper.model.train()
    loader.set_epoch(epoch, start_batch)
    n_batches = len(loader)
    batches: Iterable[tuple[int, Any]] = enumerate(loader, start_batch)
    main = stepper.info.is_main
    if main:
        losses = "".join(f"{name + '_loss':>{width}}" for name, width in zip(hooks.loss_names, column_widths(hooks)))
        LOGGER.info(f"\n{'Epoch':>11}{'GPU_mem':>11}{losses}{'Instances':>11}{'Size':>11}")
        batches = tqdm(batches, total=n_batches, initial=start_batch, bar_format="{l_bar}{bar:10}{r_bar}")
    marks = stepper.marks
    marks.start()
    stepper.loss.marks = marks  # the parts of its call the loss times (timing.py); none in validation
    t0 = time.perf_counter()
    try:
        for window in accumulation_windows(batches, stepper.optim.accumulate, n_batches):
            marks.mark("data")
            _log_batch_files(stepper, epoch, window)
            last = window[-1][0]
            readout = train_step(stepper, window, epoch, n_batches, tally, wishes(stepper, hooks))
            marks.mark("optimizer")
            if last + 1 < n_batches and _saved_after_step(stepper, hooks, epoch, last + 1, tally, readout):
                marks.mark("other")
                break
            if hooks.after_step is not None:
                hooks.after_step()
            if main:
                left = (
                    hooks.progress.left(
                        epoch, last + 1 - start_batch, n_batches - start_batch, time.perf_counter() - t0
                    )
                    if hooks.progress is not None
                    else None
                )
                means = tally.means() if tally.micro_batches else None  # none read back yet this epoch
                _show_progress(batches, progress_line(epoch, hooks, stepper.device, means, window), left)
                _report_step(stepper, hooks, epoch, window)
            marks.mark("other")
        else:  # the epoch's end: every rank flushes, and a wish to stop ends the run after this epoch
            if flush(stepper, tally, wishes(stepper, hooks), f"epoch {epoch} end").stop:
                stepper.stopped = "after"
    finally:  # the loss's phase marks end with the epoch, also when it ends by an exception
        stepper.loss.marks = UNMARKED
    images = (n_batches - start_batch) * hooks.batch_size // stepper.info.world_size  # this rank's
    phases = step_phases(stepper.loss.timed_phases)
    timing = gather_epoch_time(marks.collect(), images, stepper.info, stepper.device, phases)
    _log_epoch_speed(stepper, epoch, timing, tally)
    return tally, timing


def wishes(stepper: Stepper, hooks: EpochHooks) -> dict[str, bool]:
    """This rank's wishes for the next read-back: rank 0's to save (--save-minutes), any rank's to stop."""
    return {"save": hooks.save_mid_epoch is not None and hooks.save_policy.wants_save(stepper), "stop": STOP.requested}


def _saved_after_step(
    stepper: Stepper, hooks: EpochHooks, epoch: int, next_batch: int, tally: LossTally, readout: Readout | None
) -> bool:
    """After a step inside the epoch: a checkpoint when --save-steps says so or the read-back brought a wish to save
    or to stop (every rank decides alike and flushes); True when the run is to stop here."""
    readout = readout or Readout()
    if not (hooks.save_policy.due_by_steps(stepper) or readout.save or readout.stop):
        return False
    readout = readout.merge(flush(stepper, tally, wishes(stepper, hooks), f"epoch {epoch} batch {next_batch - 1}"))
    if hooks.save_mid_epoch is not None:
        hooks.save_mid_epoch(epoch, next_batch, tally)
        stepper.last_save = time.monotonic()
    if readout.stop:
        stepper.stopped = "inside"
    return readout.stop


def _show_progress(batches: Any, line: str, left: float | None) -> None:
    """The progress line: the epoch's losses and, after the bar, the whole run's remaining time."""
    if left is not None:
        batches.set_postfix_str(f"run {format_duration(left)} left", refresh=False)
    batches.set_description(line)


def _log_batch_files(stepper: Stepper, epoch: int, window: Window) -> None:
    if LOGGER.isEnabledFor(logging.DEBUG):
        for i, b in window:
            LOGGER.debug(
                f"rank {max(stepper.info.rank, 0)} epoch {epoch} batch {i}: {' '.join(Path(f).name for f in b[2])}"
            )


def _report_step(stepper: Stepper, hooks: EpochHooks, epoch: int, window: Window) -> None:
    """Rank 0 after a step: the epoch's first images to the logger, its first batches as plots."""
    first = window[0][0]
    if first == 0:
        hooks.logger.log_batch(window[0][1][0], epoch)
    if hooks.plots_dir is not None and first < 3:
        from utils.plots import plot_images

        for i, b in window:
            if i < 3:
                plot_images(
                    b[0],
                    b[1],
                    b[2],
                    hooks.plots_dir / f"train_batch{i}.jpg",
                    cast("list[str]", de_parallel(stepper.model).names),
                )


def _log_epoch_speed(stepper: Stepper, epoch: int, timing: EpochTime, tally: LossTally) -> None:
    gpu = (
        f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        if stepper.device.type == "cuda"
        else ""
    )
    skipped = f", {tally.skipped_steps} steps skipped (non-finite gradients)" if tally.skipped_steps else ""
    LOGGER.info(f"epoch {epoch}: {timing.describe()}{gpu}{skipped}")


def column_widths(hooks: EpochHooks) -> list[int]:
    """The progress columns of the loss terms: 11 characters, wider for a long name."""
    return [max(11, len(name) + 6) for name in hooks.loss_names]


def progress_line(
    epoch: int, hooks: EpochHooks, device: torch.device, mean_loss: np.ndarray | None, window: Window
) -> str:
    """The epoch's losses as read back so far, and the last batch's labels and image size (the host's own). The
    losses reach the host every --log-interval steps (the step never waits for them): until the epoch's first
    read-back (``mean_loss`` None) their columns show a dash, not a loss of 0."""
    mem = f"{torch.cuda.memory_reserved() / 1e9:.3g}G" if device.type == "cuda" else "0G"
    widths = column_widths(hooks)
    if mean_loss is None:
        losses = "".join(f"{'-':>{width}}" for width in widths)
    else:
        losses = "".join(f"{x:>{width}.4g}" for x, width in zip(mean_loss.tolist(), widths))
    imgs, targets = window[-1][1][:2]
    return f"{f'{epoch}/{hooks.epochs - 1}':>11}{mem:>11}{losses}{targets.shape[0]:>11}{imgs.shape[-1]:>11}"
