"""--time: fitting a run's number of epochs to a time budget, from the measured length of its first epoch.

After the first epoch (of this process) the budget left, divided by that epoch's seconds, gives the number of
epochs; after the second, the steady speed, the run is fitted again to the budget then left; the learning-rate
schedule and close-mosaic follow each fit. After every epoch the run stops when
the next epoch would not end within the budget. A budget counts from the first epoch's start (``--time``), or
from the process start (``time_includes_startup``: start-up and data generation included; the built-in demo's),
and may cap the number of epochs it fits (``time_max_epochs``: a fast machine still trains the preset's epochs).
"""

from __future__ import annotations

from dataclasses import dataclass

from utils.engine.config import TrainConfig
from utils.log import LOGGER


@dataclass(frozen=True)
class TimeBudget:
    seconds: float
    started: float  # the monotonic clock when the budget began
    loop_started: float  # the monotonic clock when the first epoch of this process began
    max_epochs: int | None  # the most epochs it fits
    label: str  # how the log names it

    @property
    def for_epochs(self) -> float:
        """The seconds left for epochs when the first one began."""
        return self.seconds - (self.loop_started - self.started)


def time_budget(config: TrainConfig, process_started: float, loop_started: float) -> TimeBudget | None:
    """The run's budget, or None without one."""
    if config.time is None:
        return None
    seconds = config.time * 3600
    if config.time_includes_startup:
        label = f"time budget {seconds:.0f} s for the whole run (start-up and final validation included)"
        return TimeBudget(seconds, process_started, loop_started, config.time_max_epochs, label)
    return TimeBudget(seconds, loop_started, loop_started, config.time_max_epochs, f"--time {config.time} h")


def fit_to_time(
    budget: TimeBudget, epoch: int, start_epoch: int, now: float, epoch_seconds: float, config: TrainConfig
) -> dict:
    """After ``epoch`` (which took ``epoch_seconds``): ``{"stop": True}`` when the next epoch would overrun the
    budget, ``{"epochs": n}`` after the first epoch when the budget fits another number than ``config.epochs``,
    else nothing."""
    if now - budget.started + epoch_seconds > budget.seconds:
        LOGGER.info(f"{budget.label}: the budget is spent after epoch {epoch}")
        return {"stop": True}
    if epoch == start_epoch:
        fitted = max(epoch + 2, int(budget.for_epochs / epoch_seconds))
    elif epoch == start_epoch + 1:
        # The first epoch carries one-off costs (workers starting, images decoded into the cache, a busy machine's
        # start-up): the second is the steady speed, and the run is fitted again to what is left.
        left = budget.seconds - (now - budget.started)
        fitted = max(epoch + 2, epoch + 1 + int(left / epoch_seconds))
    else:
        return {}
    capped = budget.max_epochs is not None and fitted > budget.max_epochs
    epochs = budget.max_epochs if capped else fitted
    if epochs == config.epochs:  # nothing to refit
        fits = f"{fitted} epochs would fit; the run keeps its {epochs}" if capped else f"so {epochs} epochs, as set"
        LOGGER.info(f"{budget.label}: an epoch takes {epoch_seconds:.1f} s, {fits}")
        return {}
    LOGGER.info(
        f"{budget.label}: an epoch takes {epoch_seconds:.1f} s, so {epochs} epochs"
        f"{f' (at most {budget.max_epochs})' if budget.max_epochs is not None else ''}; the learning-rate "
        f"schedule and close-mosaic ({config.close_mosaic} last epochs) are fitted to that"
    )
    return {"epochs": epochs}
