"""Exponential moving average of the model's weights: what validation and the saved checkpoints use."""
from __future__ import annotations

import math
from copy import deepcopy

import torch
import torch.nn as nn

from utils.distributed import de_parallel


class ModelEMA:
    """Exponential moving average of a model's state; the decay ramps up over the first updates."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0, updates: int = 0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay_max = decay
        self.tau = tau
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def decay(self) -> float:
        return self.decay_max * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay()
        model_state = de_parallel(model).state_dict()
        for name, value in self.ema.state_dict().items():
            if value.dtype.is_floating_point:
                value.mul_(d).add_(model_state[name].detach(), alpha=1 - d)

    def update_attributes(self, model: nn.Module, names: tuple[str, ...] = ("nc", "names", "hyp")) -> None:
        src = de_parallel(model)
        for name in names:
            if hasattr(src, name):
                setattr(self.ema, name, getattr(src, name))
