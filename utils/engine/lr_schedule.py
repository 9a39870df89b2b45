"""Learning-rate schedules: YOLO's (a warmup of learning rate and momentum, then linear or cosine decay to lr0 * lrf,
per epoch) and the DETR recipes' flat-cosine, set at every step (``FlatCosine``)."""

from __future__ import annotations

import math

import numpy as np
import torch

from utils.hyp import OptimisationHyp, StepScheduleHyp


class LrSchedule:
    """lr0's multiplier per epoch: linear (or cosine) segments ``[start_epoch, end_epoch, start, end]``.

    A run starts with one segment from 1 at epoch 0 to ``lrf`` at its last epoch. When ``--resume --epochs N``
    changes the length of a run at epoch e, the schedule continues from the multiplier it has at e and goes to
    ``lrf`` at the new last epoch (``extended``): no jump, and the run still ends at lr0 * lrf. A finished run is
    already at ``lrf`` and continues at that rate.
    """

    def __init__(self, segments: list[list[float]], cosine: bool = False):
        self.segments = [list(map(float, seg)) for seg in segments]
        self.cosine = cosine

    @classmethod
    def for_run(cls, epochs: int, lrf: float, cosine: bool = False) -> LrSchedule:
        return cls([[0, epochs, 1.0, lrf]], cosine)

    def __call__(self, epoch: float) -> float:
        seg = next((s for s in self.segments if epoch < s[1]), self.segments[-1])
        start, end, f0, f1 = seg
        t = min(max((epoch - start) / (end - start), 0.0), 1.0) if end > start else 1.0
        ramp = (1 - math.cos(t * math.pi)) / 2 if self.cosine else t
        return f0 + (f1 - f0) * ramp

    def extended(self, at_epoch: int, epochs: int, lrf: float) -> LrSchedule:
        """The schedule of a run whose length changes to ``epochs`` at ``at_epoch``."""
        now = self(at_epoch)
        kept = [[s[0], min(s[1], at_epoch), s[2], self(min(s[1], at_epoch))] for s in self.segments if s[0] < at_epoch]
        return LrSchedule([*kept, [at_epoch, max(epochs, at_epoch + 1), now, lrf]], self.cosine)


def warmup_iterations(warmup_epochs: float, batches_per_epoch: int) -> int:
    """Optimizer warmup length in batches: at least 100, so short epochs still warm up."""
    return max(round(warmup_epochs * batches_per_epoch), 100) if warmup_epochs > 0 else 0


def apply_warmup(
    optimizer: torch.optim.Optimizer,
    iteration: int,
    n_warmup: int,
    epoch_factor: float,
    hyp: OptimisationHyp,
    momentum: float,
) -> None:
    """Ramp every group's lr (biases, group 0, down from warmup_bias_lr) and the momentum (from warmup_momentum to
    ``momentum``, the optimizer's own) during warmup."""
    ramp = [0, n_warmup]
    for j, group in enumerate(optimizer.param_groups):
        start = hyp.warmup_bias_lr if j == 0 else 0.0
        group["lr"] = float(np.interp(iteration, ramp, [start, group["initial_lr"] * epoch_factor]))
        if "momentum" in group:
            group["momentum"] = float(np.interp(iteration, ramp, [hyp.warmup_momentum, momentum]))
        elif "betas" in group:
            beta1 = float(np.interp(iteration, ramp, [hyp.warmup_momentum, momentum]))
            group["betas"] = (beta1, group["betas"][1])


class FlatCosine:
    """The DETR recipes' learning rate, set at every step: a warmup from 0, a flat stretch at lr0, a cosine down to
    lr0 * ``lrf`` ending where the no-augmentation stage begins, and ``lrf`` through the stage (DEIM's
    flat-cosine; with ``flat_share`` 1, D-FINE's and RT-DETRv2's warmup then constant rate).

    The multiplier is a function of the step (batch index over the run) and the run's shape alone, so a resumed
    run, inside an epoch or at its start, gets the rates the uninterrupted run had.
    """

    def __init__(self, hyp: StepScheduleHyp, lrf: float, epochs: int, batches_per_epoch: int, stage: int | None):
        self.hyp, self.lrf, self.batches_per_epoch = hyp, lrf, max(batches_per_epoch, 1)
        self.refit(epochs, stage)

    def refit(self, epochs: int, stage: int | None) -> None:
        """Another run length (a time budget) or stage epoch."""
        self.epochs, self.stage = epochs, stage
        self.decay_end = (stage if stage is not None else epochs) * self.batches_per_epoch
        warm = self.hyp.warmup_steps
        self.flat_end = warm + self.hyp.flat_share * max(self.decay_end - warm, 0.0)

    def __call__(self, step: float) -> float:
        """lr0's multiplier at ``step`` (0 is the run's first batch)."""
        warm = self.hyp.warmup_steps
        if step < warm:
            return min(1.0, (step + 1) / warm) ** self.hyp.warmup_power
        if step < self.flat_end:
            return 1.0
        if step >= self.decay_end:
            return self.lrf
        t = (step - self.flat_end) / (self.decay_end - self.flat_end)
        return self.lrf + (1.0 - self.lrf) * 0.5 * (1.0 + math.cos(math.pi * t))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Every group at its own rate (``initial_lr``: the backbone's multiple of lr0 included) times the
        multiplier of ``step``."""
        factor = self(step)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
