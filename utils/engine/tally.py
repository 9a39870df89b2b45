"""An epoch's training losses, summed over ranks as the steps go (what results.csv's train/ columns hold)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LossTally:
    """The sums of a loss's ``n`` terms over an epoch's micro-batches so far, over all ranks (see models/loss.py)."""

    n: int  # the family's number of loss terms
    sums: np.ndarray | None = None
    micro_batches: float = 0.0  # global micro-batches counted (whatever the number of ranks)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients

    def __post_init__(self) -> None:
        if self.sums is None:
            self.sums = np.zeros(self.n)

    def add(self, synced: np.ndarray, world_size: int) -> None:
        """Add the all-reduced [n loss item sums, finite micro-batches] of some steps, read back to the host."""
        self.sums += synced[: self.n]
        self.micro_batches += float(synced[self.n]) / world_size

    def means(self) -> np.ndarray:
        assert self.sums is not None, "no step added yet"
        return self.sums / max(self.micro_batches, 1.0)

    def state(self) -> dict:
        """What a checkpoint written inside an epoch keeps of it."""
        assert self.sums is not None, "no step added yet"
        return {"sums": self.sums.tolist(), "micro_batches": self.micro_batches, "skipped_steps": self.skipped_steps}
