"""One optimizer step: a window of ``accumulate`` micro-batches, their forward and backward passes, the update.

The step does not assume a YOLO head: the forward pass is the family's ``forward_train(model, images, targets)``
and the loss its ``make_loss``, with as many terms as the family's ``loss_names``. Before the forward
passes, one all-reduce per step carries the loss's counts of the step's micro-batches (the loss divides by
global counts, so a step does not depend on the number of ranks), the losses of the steps since the last one
and rank 0's wish to save a checkpoint.
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

from models.families import Family
from models.loss import DetectionLoss, LossNorm
from utils.amp import Precision, autocast
from utils.distributed import DistInfo, all_reduce_sum
from utils.engine.optimization import Optimization
from utils.engine.tally import LossTally
from utils.engine.timing import HostMarks
from utils.errors import UserError
from utils.log import LOGGER

MAX_NONFINITE_STEPS = 25  # in a row: training has diverged


@dataclass(frozen=True)
class BatchOptions:
    """How a loaded batch becomes the model's input."""

    seed: int
    imgsz: int
    grid: int  # sizes are multiples of this (the largest stride, at least 32)
    multi_scale: bool
    quad: bool  # each image stands for 4 (--quad)


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
    steps_done: int = 0
    skipped_in_row: int = 0  # optimizer steps skipped for non-finite gradients, across epochs
    last_save: float = field(default_factory=time.monotonic)
    marks: Any = field(default_factory=HostMarks)  # times the phases of each step (timing.py: new_marks)


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


def micro_batches(stepper: Stepper, window: Window, epoch: int) -> tuple[list, list, torch.Tensor]:
    """The window's (images, targets) on the device, the loss's preparation of each and its counts (to sum over
    ranks before the forward passes)."""
    micro = [
        (prepare_images(b[0], stepper.batch, stepper.device, epoch, i), b[1].to(stepper.device, non_blocking=True))
        for i, b in window
    ]
    prepared = [stepper.loss.prepare(targets, imgs.shape[2:]) for imgs, targets in micro]
    counts = torch.stack([stepper.loss.counts(p) for p in prepared]).to(stepper.device)
    return micro, prepared, counts


def sync(
    stepper: Stepper, counts: torch.Tensor, pending: torch.Tensor, save_now: bool, tally: LossTally
) -> tuple[torch.Tensor, bool]:
    """The step's one all-reduce: the counts of its micro-batches, the losses ``pending`` since the last sync
    (added to ``tally``, then cleared) and rank 0's wish to save; returns the global counts and that wish."""
    flag = torch.tensor([float(save_now)], device=stepper.device)
    synced = all_reduce_sum(torch.cat((counts.flatten(), pending, flag)))
    counts, done = synced[: counts.numel()].view_as(counts), synced[counts.numel() :]
    tally.add(done, stepper.info.world_size)
    pending.zero_()
    return counts, bool(done[stepper.n_losses + 1] > 0)


def forward_backward(
    stepper: Stepper, micro: list, counts: torch.Tensor, prepared: list, pending: torch.Tensor
) -> torch.Tensor:
    """The forward and backward passes of the window's micro-batches; returns the step's loss items on this rank
    and adds the finite ones (and their count) to ``pending``."""
    world = stepper.info.world_size
    step_items = torch.zeros(stepper.n_losses, device=stepper.device)
    reduce = all_reduce_sum if stepper.info.is_distributed else None
    for k, ((imgs, targets), positives, prep) in enumerate(zip(micro, counts, prepared)):
        with gradient_sync(stepper.model, k == len(micro) - 1), autocast(stepper.device, stepper.precision):
            outputs = stepper.family.forward_train(stepper.model, imgs, targets)
            loss, items = stepper.loss(
                outputs, targets, LossNorm(positives, imgs.shape[0] * world), prepared=prep, reduce=reduce
            )
        if stepper.batch.quad:  # as YOLOv5: a quad image stands for 4 images of the batch the gradient scale is set for
            loss = loss * 4
        scaled = stepper.optim.scaler.scale(loss * world)  # DDP averages gradients over ranks; the loss sums over them
        stepper.marks.mark("forward")
        mark_when_computed(scaled, stepper.marks)
        scaled.backward()
        stepper.marks.mark("sync")  # what DDP's gradient all-reduce added after backward's own computation
        step_items += items
        if torch.isfinite(items).all():
            pending += torch.cat((items, items.new_ones(1)))
    return step_items


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


def update(
    stepper: Stepper, tally: LossTally, where: str, step_items: torch.Tensor, loss_names: tuple[str, ...]
) -> None:
    """The optimizer update ending a step; a step with non-finite gradients is skipped and counted, and too many
    in a row stop the run."""
    if stepper.optim.step(stepper.model):
        stepper.skipped_in_row = 0
    else:
        tally.skipped_steps += 1
        stepper.skipped_in_row += 1
        LOGGER.warning(
            f"WARNING {where}: non-finite gradients (losses {', '.join(loss_names)} "
            f"{', '.join(f'{x:.4g}' for x in step_items.tolist())} on this rank): step skipped"
        )
        if stepper.skipped_in_row >= MAX_NONFINITE_STEPS:
            raise UserError(
                f"{where}: {stepper.skipped_in_row} optimizer steps in a row had non-finite gradients: "
                "training diverged (lower lr0, or check the data)"
            )
    stepper.steps_done += 1


@dataclass(frozen=True)
class SavePolicy:
    """When rank 0 wants a checkpoint inside an epoch (--save-steps, --save-minutes)."""

    every_steps: int
    every_minutes: float

    def wants_save(self, stepper: Stepper) -> bool:
        """Every ``every_steps`` steps, or ``every_minutes`` after the last save."""
        by_steps = self.every_steps > 0 and stepper.steps_done > 0 and stepper.steps_done % self.every_steps == 0
        by_time = self.every_minutes > 0 and time.monotonic() - stepper.last_save >= self.every_minutes * 60
        return by_steps or by_time


SaveMidEpoch = Callable[[int, int, LossTally], None]  # (epoch, next batch, the epoch's losses so far), rank 0
