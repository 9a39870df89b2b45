"""Learning-rate schedule: a warmup of learning rate and momentum, then linear or cosine decay to lr0 * lrf."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch


def decay_factor(epochs: int, lrf: float, cosine: bool = False) -> Callable[[int], float]:
    """Multiplier of lr0 at a given epoch: 1 at epoch 0, ``lrf`` at the last epoch."""
    if cosine:
        return lambda epoch: ((1 - math.cos(epoch * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda epoch: (1 - epoch / epochs) * (1.0 - lrf) + lrf


def warmup_iterations(warmup_epochs: float, batches_per_epoch: int) -> int:
    """Optimizer warmup length in batches: at least 100, so short epochs still warm up."""
    return max(round(warmup_epochs * batches_per_epoch), 100) if warmup_epochs > 0 else 0


def apply_warmup(optimizer: torch.optim.Optimizer, iteration: int, n_warmup: int, epoch_factor: float,
                 hyp: dict) -> None:
    """Ramp every group's lr (biases, group 0, down from warmup_bias_lr) and the momentum during warmup."""
    ramp = [0, n_warmup]
    for j, group in enumerate(optimizer.param_groups):
        start = hyp["warmup_bias_lr"] if j == 0 else 0.0
        group["lr"] = float(np.interp(iteration, ramp, [start, group["initial_lr"] * epoch_factor]))
        if "momentum" in group:
            group["momentum"] = float(np.interp(iteration, ramp, [hyp["warmup_momentum"], hyp["momentum"]]))
        elif "betas" in group:
            beta1 = float(np.interp(iteration, ramp, [hyp["warmup_momentum"], hyp["momentum"]]))
            group["betas"] = (beta1, group["betas"][1])
