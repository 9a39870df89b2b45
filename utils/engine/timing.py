"""Where a training step's time goes: waiting for data, forward pass and loss, backward, optimizer step, and
the synchronisation between ranks that backward did not hide; images per second; the run's remaining time.

The step code calls ``mark(phase)`` when a phase ends; the time since the previous mark is that phase's. On the
CPU work runs when it is called, so marks on the host clock (``HostMarks``) time it. On CUDA work is queued: the
marks are CUDA events recorded on the stream (``DeviceMarks``), read back once they have passed (``query``,
which does not wait), and the rest once per epoch; no mark makes the host wait for the GPU. There a phase's time
is the GPU's, and "data" is the time the GPU had nothing to do until the next batch's work was queued.

Phases, in the order a step marks them (an optimizer step over ``accumulate`` micro-batches):

- ``data``: the loader's next batches (waiting for workers, or building them in this process with no workers);
- ``forward``: putting them on the device, the loss's target preparation, forward passes and losses;
- ``sync``: the step's all-reduce of the loss's counts (and, for a family whose forward pass takes a TrainBatch,
  of the most labels of one image), and the gradient all-reduce left after backward's own
  computation (DDP overlaps the rest with it); time spent waiting for a slower rank lands here too;
- ``backward``: backward's computation;
- ``optimizer``: unscaling, clipping, the optimizer's step and the EMA;
- ``other``: the rest (progress bar, checkpoints written inside the epoch); not a column, part of the whole.

A family's loss may time parts of its call as phases of their own (``DetectionLoss.timed_phases``, the DETRs'
``matcher``): it marks ``forward`` where such a part begins and the part's name where it ends, so the part's time
leaves ``forward``. Those phases follow ``forward`` in the split and in results.csv (``step_phases``); a loss that
names none leaves the split, its columns and its marks as they are.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from utils.distributed import DistInfo, all_reduce_sum
from utils.log import LOGGER

PHASES = ("data", "forward", "backward", "optimizer", "sync")
OTHER = "other"


def step_phases(timed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The split's phases: PHASES with the parts the loss times on its own (``timed``) after ``forward``."""
    at = PHASES.index("forward") + 1
    return (*PHASES[:at], *timed, *PHASES[at:])


def time_columns(phases: tuple[str, ...] = PHASES) -> tuple[str, ...]:
    """results.csv's time columns of a split over ``phases``."""
    return (*(f"time/{p}" for p in phases), "time/images_per_s", "time/slowest_rank")


TIME_COLUMNS = time_columns()
DATA_BOUND_SHARE = 0.3  # from this share of step time waiting for data on, data loading is called the bottleneck
MAX_PENDING_EVENTS = 256  # CUDA marks kept before those that have passed are read back


class HostMarks:
    """Phase times on the host clock."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = {}
        self.last = clock()

    def start(self) -> None:
        """Time from here on (an epoch's first step)."""
        self.totals, self.last = {}, self.clock()

    def mark(self, phase: str) -> None:
        now = self.clock()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now

    def collect(self) -> dict[str, float]:
        """The seconds per phase since ``start``."""
        return dict(self.totals)


class DeviceMarks:
    """Phase times between CUDA events recorded on the current stream; no host synchronisation per mark."""

    def __init__(self, new_event: Callable[[], Any] | None = None, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self.new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.max_pending = max_pending
        self.totals: dict[str, float] = {}
        self.pending: deque = deque()  # (phase ended by the event, event); the first is where timing stands

    def _record(self, phase: str | None) -> None:
        event = self.new_event()
        event.record()
        self.pending.append((phase, event))

    def start(self) -> None:
        self.totals, self.pending = {}, deque()
        self._record(None)

    def mark(self, phase: str) -> None:
        self._record(phase)
        if len(self.pending) > self.max_pending:
            self._read(wait=False)

    def _read(self, wait: bool) -> None:
        """Add the time between consecutive events that have passed (all of them with ``wait``)."""
        while len(self.pending) >= 2:
            (_, before), (phase, after) = self.pending[0], self.pending[1]
            if wait:
                after.synchronize()
            elif not (before.query() and after.query()):
                return
            self.totals[phase] = self.totals.get(phase, 0.0) + before.elapsed_time(after) / 1000  # ms
            self.pending.popleft()

    def collect(self) -> dict[str, float]:
        """The seconds per phase since ``start``: waits for the last mark (once per epoch)."""
        self._read(wait=True)
        return dict(self.totals)


def new_marks(device: torch.device) -> HostMarks | DeviceMarks:
    return DeviceMarks() if device.type == "cuda" else HostMarks()


@dataclass
class EpochTime:
    """An epoch's step time: seconds per phase (the mean over ranks) and the slowest rank's images per second."""

    seconds: dict[str, float]
    images_per_s: float
    slowest_rank: int
    world_size: int = 1
    images: int = 0  # per rank
    phases: tuple[str, ...] = PHASES  # step_phases of the run's loss

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        """Each phase's share of the step time (``phases``, then ``other``)."""
        total = self.total or 1.0
        return {p: self.seconds.get(p, 0.0) / total for p in (*self.phases, OTHER)}

    def row(self) -> list[float]:
        """results.csv's time columns (``time_columns(phases)``)."""
        shares = self.shares()
        return [*(shares[p] for p in self.phases), self.images_per_s, float(self.slowest_rank)]

    def describe(self) -> str:
        shares = self.shares()
        parts = ", ".join(f"{LABELS.get(p, p)} {100 * shares[p]:.0f}%" for p in (*self.phases, OTHER))
        speed = f"{self.images_per_s:.1f} images/s"
        if self.world_size > 1:
            speed += f" per rank at the slowest (rank {self.slowest_rank})"
        return f"{speed}; step time: {parts}"


LABELS = {  # a phase a loss times on its own is labelled by its name
    "data": "data",
    "forward": "forward+loss",
    "backward": "backward",
    "optimizer": "optimizer",
    "sync": "sync",
    OTHER: "other",
}


def gather_epoch_time(
    seconds: dict[str, float], images: int, info: DistInfo, device: torch.device, phases: tuple[str, ...] = PHASES
) -> EpochTime:
    """Every rank's phase times and images per second, combined (one all-reduce in a distributed run)."""
    names = (*phases, OTHER)
    world, rank = info.world_size, max(info.rank, 0)
    own = [seconds.get(p, 0.0) for p in names]
    speeds = [0.0] * world
    speeds[rank] = images / max(sum(own), 1e-9)
    values = torch.tensor([*own, *speeds], dtype=torch.float64)
    if info.is_distributed:
        values = all_reduce_sum(values.to(device)).cpu()
    per_rank = values[len(names) :].tolist()
    slowest = min(range(world), key=lambda r: per_rank[r])
    mean = {p: float(v) / world for p, v in zip(names, values[: len(names)].tolist())}
    return EpochTime(mean, per_rank[slowest], slowest, world, images, phases)


@dataclass
class RunTime:
    """The step time of the epochs this process trained, for the end of the run."""

    epochs: list[EpochTime] = field(default_factory=list)

    def add(self, epoch: EpochTime) -> None:
        self.epochs.append(epoch)

    def summary(self) -> EpochTime | None:
        """The epochs as one: phase times summed; the images per second of the slowest rank of each epoch, over
        their time together; as the slowest rank, the one that was slowest in most epochs."""
        if not self.epochs:
            return None
        seconds: dict[str, float] = {}
        for epoch in self.epochs:
            for phase, value in epoch.seconds.items():
                seconds[phase] = seconds.get(phase, 0.0) + value
        images = sum(e.images for e in self.epochs)
        slow_time = sum(e.images / e.images_per_s for e in self.epochs if e.images_per_s > 0)
        ranks = [e.slowest_rank for e in self.epochs]
        slowest = max(set(ranks), key=ranks.count)
        last = self.epochs[-1]
        return EpochTime(
            seconds, images / slow_time if slow_time else 0.0, slowest, last.world_size, images, last.phases
        )


def data_advice(shares: dict[str, float], workers: int, cores: int) -> str | None:
    """One line when data loading is the bottleneck: how many loader workers per rank would keep up."""
    data = shares["data"]
    if data < DATA_BOUND_SHARE:
        return None
    busy = max(1.0 - data, 0.05)
    # With W workers starved, one batch takes them W x (step time) each; keeping up means a batch per busy time.
    # Without workers this process builds the batches: the waiting is the building, spread over new workers.
    needed = math.ceil((workers if workers else data) / busy)
    needed = max(needed, workers + 1)
    what = (
        f"{100 * data:.0f}% of the step time waits for data with {workers} loader worker{'s' * (workers != 1)} per rank"
    )
    if needed <= cores:
        return (
            f"data loading is the bottleneck: {what}; --workers {needed} would keep up (about {needed} per rank; "
            f"{cores} cores per rank here)"
        )
    return (
        f"data loading is the bottleneck: {what}; keeping up would take about {needed} workers per rank, more "
        f"than the {cores} cores per rank here: cache the images (--cache ram), lighten the augmentation, or "
        f"train on a machine with more cores per GPU"
    )


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


@dataclass
class RunProgress:
    """The run's remaining time for the progress line: this epoch's rest at its pace, then the epochs left at the
    pace of the whole epochs (training and validation) this process finished."""

    epochs: int
    epoch_seconds: list[float] = field(default_factory=list)

    def left(self, epoch: int, done: int, total: int, elapsed: float) -> float | None:
        """Seconds left after ``done`` of ``total`` batches of ``epoch`` in ``elapsed`` seconds."""
        if done <= 0:
            return None
        per_batch = elapsed / done
        per_epoch = sum(self.epoch_seconds) / len(self.epoch_seconds) if self.epoch_seconds else per_batch * total
        return per_batch * (total - done) + max(self.epochs - epoch - 1, 0) * per_epoch


class StepProfiler:
    """--profile N: torch.profiler over N optimizer steps (after one to skip and one to warm up), written to
    ``path`` as a Chrome trace (chrome://tracing, Perfetto)."""

    def __init__(self, steps: int, path: Path, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.path, self.steps, self.done, self.written = path, steps, False, False
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._write,
        )
        self.profiler.start()
        self.step_count = 0

    def _write(self, profiler: Any) -> None:
        profiler.export_chrome_trace(str(self.path))
        self.written = True
        LOGGER.info(f"profile: {self.steps} steps written to {self.path} (open it in https://ui.perfetto.dev)")

    def step(self) -> None:
        if self.done:
            return
        self.profiler.step()
        self.step_count += 1
        if self.step_count >= 2 + self.steps:
            self.stop()

    def stop(self) -> None:
        if not self.done:
            self.done = True
            self.profiler.stop()
            if not self.written:
                LOGGER.warning(
                    f"WARNING --profile {self.steps}: the run ended after {self.step_count} optimizer "
                    f"steps, before the profile's {self.steps + 2} (one skipped, one to warm up): no trace"
                )
