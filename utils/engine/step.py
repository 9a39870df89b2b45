"""One optimizer step: a window of ``accumulate`` micro-batches, their forward and backward passes, the update;
and the read-back, which brings what the steps tallied on the device to the host.

The step does not assume a YOLO head: the forward pass is the family's ``forward_train(model, images, targets)``
and the loss its ``make_loss``, with as many terms as the family's ``loss_names``. The loss divides by global
counts, so a step does not depend on the number of ranks: the counts of the step's micro-batches are all-reduced
before the forward passes (for a loss that has any).

In steady state a step never makes the host wait for the device (docs/design.md, "Where the step may and may not
sync"): the losses, the count of finite micro-batches and of skipped updates are added up on the device, and
every ``log_interval`` steps (the read-back) they are all-reduced with each rank's wishes (rank 0's to save, any
rank's to stop) and copied to the host without blocking; the host reads that copy at the next read-back, one
interval later, when it has long arrived. Every rank reads the same values at the same step, so what they decide
(save, stop, a run of non-finite steps too long) happens at the same step everywhere. A save and the epoch's end
flush: they wait for everything tallied so far.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models.families import Family, TrainBatch
from models.loss import DetectionLoss, LossNorm
from utils.amp import Precision, autocast
from utils.distributed import DistInfo, all_reduce_sum, max_over_ranks
from utils.engine.optimization import Optimization
from utils.engine.tally import LossTally
from utils.engine.timing import HostMarks
from utils.errors import UserError
from utils.log import LOGGER

MAX_NONFINITE_STEPS = 25  # in a row: training has diverged (checked at each read-back)
WISHES = ("save", "stop")  # what a rank asks of all of them through the read-back, in this order


@dataclass(frozen=True)
class BatchOptions:
    """How a loaded batch becomes the model's input."""

    seed: int
    imgsz: int
    grid: int  # sizes are multiples of this (the largest stride, at least 32)
    multi_scale: bool
    quad: bool  # each image stands for 4 (--quad)


class DeviceTally:
    """What the steps add up on the device between read-backs: ``pending`` = [loss item sums, finite micro-batches]
    of this rank; ``skips`` = [updates skipped since the last read-back, the current run of skipped updates, the
    longest run since the last read-back] (the same on every rank: the gradients are all-reduced)."""

    def __init__(self, n_losses: int, device: torch.device) -> None:
        dtype = torch.float32 if device.type == "mps" else torch.float64  # sums of many float32 items
        self.pending = torch.zeros(n_losses + 1, dtype=dtype, device=device)
        self.skips = torch.zeros(3, dtype=dtype, device=device)

    def add_items(self, items: torch.Tensor) -> None:
        """A micro-batch's loss items, counted when all are finite (decided on the device)."""
        finite = torch.isfinite(items).all()
        self.pending += torch.where(finite, torch.cat((items, items.new_ones(1))), 0).to(self.pending.dtype)

    def add_update(self, finite: torch.Tensor) -> None:
        """An optimizer step: skipped when ``finite`` (a 0-d bool tensor) is False."""
        bad = (~finite).to(self.skips.dtype)
        run = (self.skips[1] + 1) * bad
        self.skips.copy_(torch.stack((self.skips[0] + bad, run, torch.maximum(self.skips[2], run))))

    def take(self) -> torch.Tensor:
        """What was tallied since the last call, and a fresh start (the current run of skipped updates goes on)."""
        values = torch.cat((self.pending, self.skips))
        self.pending.zero_()
        self.skips[:1].zero_()  # not ``= 0``: a host number is a copy from pageable memory on CUDA
        self.skips[2] = self.skips[1]
        return values


@dataclass
class Readout:
    """What the host read back: the decisions of every rank's wishes, the skipped updates it brought."""

    save: bool = False
    stop: bool = False
    skipped: int = 0

    def merge(self, other: Readout) -> Readout:
        return Readout(self.save or other.save, self.stop or other.stop, self.skipped + other.skipped)


@dataclass
class Stepper:
    """What every step uses, and the counts that run across epochs."""

    model: nn.Module  # DDP-wrapped in a distributed run
    family: Family
    loss: DetectionLoss
    optim: Optimization
    precision: Precision
    device: torch.device
    info: DistInfo
    batch: BatchOptions
    n_losses: int
    log_interval: int = 10  # optimizer steps between read-backs (--log-interval)
    steps_done: int = 0
    last_save: float = field(default_factory=time.monotonic)
    marks: Any = field(default_factory=HostMarks)  # times the phases of each step (timing.py: new_marks)
    tally: DeviceTally = field(init=False)  # made from n_losses and device
    in_flight: list = field(default_factory=list)  # read-backs sent, not yet read: (host tensor, CUDA event)
    stopped: str = ""  # a wish to stop was read back "inside" an epoch (its checkpoint written) or "after" it

    def __post_init__(self) -> None:
        self.tally = DeviceTally(self.n_losses, self.device)


Window = list  # of (batch index, batch) pairs


def accumulation_windows(batches: Iterable[tuple[int, Any]], accumulate: int, n_batches: int) -> Iterator[Window]:
    """Consecutive groups of ``(index, batch)`` that make one optimizer step each: ``accumulate`` batches, the
    last of an epoch possibly fewer. Windows start at multiples of ``accumulate``, so a resumed epoch lines up."""
    window = []
    for i, batch in batches:
        window.append((i, batch))
        if (i + 1) % accumulate == 0 or i == n_batches - 1:
            yield window
            window = []


def prepare_images(
    imgs: torch.Tensor, options: BatchOptions, device: torch.device, epoch: int, batch_index: int
) -> torch.Tensor:
    """uint8 batch -> float [0, 1] on the device, resized for --multi-scale by a (seed, epoch, batch) draw."""
    imgs = imgs.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last).float() / 255
    if options.multi_scale:
        grid = options.grid
        rng = np.random.default_rng([options.seed, epoch, batch_index, 1])
        size = int(rng.uniform(options.imgsz * 0.5, options.imgsz * 1.5 + grid)) // grid * grid
        factor = size / max(imgs.shape[2:])
        if factor != 1:
            new_shape = [math.ceil(x * factor / grid) * grid for x in imgs.shape[2:]]
            imgs = F.interpolate(imgs, size=new_shape, mode="bilinear", align_corners=False)
    return imgs


def gradient_sync(model: nn.Module, step_now: bool) -> contextlib.AbstractContextManager:
    """Under DDP, all-reduce gradients only on the micro-batch that ends an accumulation window."""
    return model.no_sync() if isinstance(model, DDP) and not step_now else contextlib.nullcontext()


def labels_per_image(targets: torch.Tensor, images: int) -> list[int]:
    """Each image's label rows in a batch's ``targets`` as the loader gave them, on the host (the anchor-free losses pad
    their targets to the most of one image, the DETRs make their denoising queries from them); counted here, before
    the copy, the device is never asked."""
    if not len(targets):
        return [0] * images
    return [int(n) for n in torch.bincount(targets[:, 0].long(), minlength=images).tolist()]


@dataclass
class MicroBatches:
    """A window's micro-batches on the device, with what the host knows of them."""

    micro: list  # (images, targets) on the device
    prepared: list  # the loss's preparation of each
    counts: torch.Tensor  # the loss's counts of each (to sum over ranks before the forward passes)
    per_image: list[list[int]]  # each one's label rows per image, counted on the host
    most: list[int]  # each one's most labels of one image (this rank's)


def micro_batches(stepper: Stepper, window: Window, epoch: int) -> MicroBatches:
    """The window's micro-batches on the device, the loss's preparation of each and its counts, and each one's labels
    per image (counted on the host)."""
    per_image = [labels_per_image(b[1], b[0].shape[0]) for _, b in window]
    most = [max(n, default=0) for n in per_image]
    micro = [
        (prepare_images(b[0], stepper.batch, stepper.device, epoch, i), b[1].to(stepper.device, non_blocking=True))
        for i, b in window
    ]
    prepared = [stepper.loss.prepare(targets, imgs.shape[2:]) for imgs, targets in micro]
    counts = torch.stack([stepper.loss.counts(p) for p in prepared])
    # A loss without counts gives empty ones, made on the host: made anew on the device, nothing is copied.
    counts = counts.to(stepper.device) if counts.numel() else torch.zeros(counts.shape, device=stepper.device)
    return MicroBatches(micro, prepared, counts, per_image, most)


def train_batches(stepper: Stepper, window: Window, epoch: int, micro: MicroBatches) -> list[TrainBatch | None]:
    """Each micro-batch's TrainBatch for a family whose forward pass reads it (else None): the most labels of one image
    over every rank's micro-batch comes from one all-reduce of host numbers for the window."""
    if not stepper.family.forward_takes_batch:
        return [None] * len(window)
    overall = max_over_ranks(micro.most)
    return [
        TrainBatch(stepper.batch.seed, epoch, tuple(map(str, b[2])), tuple(n), m)
        for (_, b), n, m in zip(window, micro.per_image, overall)
    ]


def forward_backward(
    stepper: Stepper, window: MicroBatches, counts: torch.Tensor, batches: list[TrainBatch | None]
) -> None:
    """The forward and backward passes of the window's micro-batches; their loss items go to the device tally."""
    world = stepper.info.world_size
    reduce = all_reduce_sum if stepper.info.is_distributed else None
    family = stepper.family
    for k, ((imgs, targets), positives, prep) in enumerate(zip(window.micro, counts, window.prepared)):
        with gradient_sync(stepper.model, k == len(window.micro) - 1), autocast(stepper.device, stepper.precision):
            if family.forward_takes_batch:
                outputs = family.forward_train(stepper.model, imgs, targets, batches[k])
            else:
                outputs = family.forward_train(stepper.model, imgs, targets)
            norm = LossNorm(positives, imgs.shape[0] * world, window.most[k])
            loss, items = stepper.loss(outputs, targets, norm, prepared=prep, reduce=reduce)
        if stepper.batch.quad:  # as YOLOv5: a quad image stands for 4 images of the batch the gradient scale is set for
            loss = loss * 4
        scaled = stepper.optim.scaler.scale(loss * world)  # DDP averages gradients over ranks; the loss sums over them
        stepper.marks.mark("forward")
        mark_when_computed(scaled, stepper.marks)
        scaled.backward()
        stepper.marks.mark("sync")  # what DDP's gradient all-reduce added after backward's own computation
        stepper.tally.add_items(items)


def mark_when_computed(loss: torch.Tensor, marks: Any) -> None:
    """``marks.mark("backward")`` once the backward pass from ``loss`` has computed every gradient, before DDP
    waits for its last all-reduce: both run as autograd callbacks at the end of the pass, and DDP queues its own
    once the last gradient bucket is ready, after this one (queued as the pass starts)."""
    if not loss.requires_grad:
        return

    def queue(grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: marks.mark("backward"))
        return grad

    loss.register_hook(queue)


def update(stepper: Stepper) -> None:
    """The optimizer update ending a step; one with non-finite gradients is skipped on the device and counted there
    (the read-back reports them, and stops the run after MAX_NONFINITE_STEPS in a row)."""
    finite = stepper.optim.step(stepper.model)
    if finite is not None:
        stepper.tally.add_update(finite)
    stepper.steps_done += 1


def train_step(
    stepper: Stepper, window: Window, epoch: int, n_batches: int, tally: LossTally, wishes: dict[str, bool]
) -> Readout | None:
    """One optimizer step over ``window``; at a read-back step (every ``log_interval`` steps) also the read-back,
    with this rank's ``wishes`` (``WISHES``), and what it read (None at other steps: nothing was read)."""
    micro = micro_batches(stepper, window, epoch)
    stepper.marks.mark("forward")
    counts = micro.counts
    if counts.numel() and stepper.info.is_distributed:
        counts = all_reduce_sum(counts)  # the global counts the loss divides by
    batches = train_batches(stepper, window, epoch, micro)
    stepper.marks.mark("sync")
    stepper.optim.warm_up(window[-1][0] + n_batches * epoch, epoch)
    forward_backward(stepper, micro, counts, batches)
    update(stepper)
    if stepper.steps_done % stepper.log_interval:
        return None
    send(stepper, wishes)
    return receive(stepper, tally, f"epoch {epoch} batch {window[-1][0]}", keep=1)


def send(stepper: Stepper, wishes: dict[str, bool]) -> None:
    """All-reduce what the device tallied since the last send with this rank's wishes, and start its copy to the
    host without waiting for it."""
    wish = torch.tensor([float(wishes.get(name, False)) for name in WISHES], dtype=stepper.tally.pending.dtype)
    values = all_reduce_sum(torch.cat((stepper.tally.take(), to_device(wish, stepper.device))))
    if values.device.type != "cuda":  # the host's own memory (or a device without events): read when asked
        stepper.in_flight.append((values.cpu(), None))
        return
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    stepper.in_flight.append((host, event))


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a blocking copy (one from pageable memory waits for the stream)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def receive(stepper: Stepper, tally: LossTally, where: str, keep: int = 0) -> Readout:
    """Read the read-backs in flight but the newest ``keep`` (waiting for them if they have not arrived): their
    losses into ``tally``, their skipped updates counted and reported, their wishes decided. Raises UserError
    after MAX_NONFINITE_STEPS skipped updates in a row."""
    readout = Readout()
    n, world = stepper.n_losses, stepper.info.world_size
    while len(stepper.in_flight) > keep:
        host, event = stepper.in_flight.pop(0)
        if event is not None:
            event.synchronize()
        values = host.numpy()
        tally.add(values[: n + 1], world)
        skipped, longest = int(values[n + 1] / world), int(values[n + 3] / world)
        wishes = dict(zip(WISHES, (bool(v > 0) for v in values[n + 4 :])))
        readout = readout.merge(Readout(wishes["save"], wishes["stop"], skipped))
        check_skipped(tally, skipped, longest, where)
    return readout


def flush(stepper: Stepper, tally: LossTally, wishes: dict[str, bool], where: str) -> Readout:
    """Everything tallied so far into ``tally``, waiting for it: before a checkpoint and at the epoch's end (every
    rank flushes at the same step)."""
    send(stepper, wishes)
    return receive(stepper, tally, where)


def check_skipped(tally: LossTally, skipped: int, longest: int, where: str) -> None:
    """Count and report the updates skipped for non-finite gradients; too many in a row stop the run."""
    if not skipped:
        return
    tally.skipped_steps += skipped
    LOGGER.warning(
        f"WARNING {where}: {skipped} optimizer steps skipped for non-finite gradients since the last read-back"
    )
    if longest >= MAX_NONFINITE_STEPS:
        raise UserError(
            f"{where}: {longest} optimizer steps in a row had non-finite gradients: "
            "training diverged (lower lr0, or check the data)"
        )


@dataclass(frozen=True)
class SavePolicy:
    """When a checkpoint is written inside an epoch (--save-steps, --save-minutes)."""

    every_steps: int
    every_minutes: float

    def due_by_steps(self, stepper: Stepper) -> bool:
        """After every ``every_steps`` steps: known on every rank at the same step, without asking the others."""
        return self.every_steps > 0 and stepper.steps_done > 0 and stepper.steps_done % self.every_steps == 0

    def wants_save(self, stepper: Stepper) -> bool:
        """Rank 0's wish, ``every_minutes`` after the last save: its clock, so it goes to the others through the
        read-back."""
        return self.every_minutes > 0 and time.monotonic() - stepper.last_save >= self.every_minutes * 60


SaveMidEpoch = Callable[[int, int, LossTally], None]  # (epoch, next batch, the epoch's losses so far), rank 0
