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
        self._pairs_of: nn.Module | None = None  # the model whose tensors _averaged/_current pair up
        self._averaged: list[torch.Tensor] = []
        self._current: list[torch.Tensor] = []

    def decay(self) -> float:
        return self.decay_max * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module, keep: torch.Tensor | None = None) -> None:
        """One step towards ``model``'s state; ``keep`` (a 0-d bool tensor on the device) False makes it no step,
        decided on the device: a step whose update was skipped there (non-finite gradients) leaves the EMA as it
        is, without the host reading the flag. The update count (the decay's ramp) counts such steps too."""
        self.updates += 1
        d = self.decay()
        source = de_parallel(model)
        if self._pairs_of is not source:  # the tensors are updated in place, so their pairing holds until then
            model_state = source.state_dict()
            pairs = [(v, model_state[k]) for k, v in self.ema.state_dict().items() if v.dtype.is_floating_point]
            self._averaged, self._current = [a for a, _ in pairs], [m for _, m in pairs]
            self._pairs_of = source
        # One call over all tensors instead of a Python loop of small ops per tensor.
        if keep is None:
            torch._foreach_lerp_(self._averaged, self._current, 1 - d)
        else:  # one weight tensor per pair (a lone 0-d tensor would be read on the host as a number)
            weight = keep.to(self._averaged[0].dtype) * (1 - d)
            torch._foreach_lerp_(self._averaged, self._current, [weight] * len(self._averaged))

    @torch.no_grad()
    def restart(self, model: nn.Module) -> None:
        """Start again from ``model``'s weights, the decay's ramp from its beginning (the DETR recipes do this where
        their no-augmentation stage begins without a best epoch of the first stage to go on from)."""
        current = de_parallel(model).state_dict()
        for key, averaged in self.ema.state_dict().items():
            averaged.copy_(current[key])
        self.updates = 0

    def update_attributes(self, model: nn.Module, names: tuple[str, ...] = ("nc", "names", "hyp")) -> None:
        src = de_parallel(model)
        for name in names:
            if hasattr(src, name):
                setattr(self.ema, name, getattr(src, name))
