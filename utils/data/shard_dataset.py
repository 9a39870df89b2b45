"""YoloDataset over indexed tar shards: the same samples and augmentations, images read from shard members.

Where pixels come from is the dataset's ``source`` (a ShardSource, image_source.py); what differs here is only
where mosaic and mixup partners come from: the sample's window of the epoch's ShardPlan order, so a rank reads
around where it already is instead of anywhere in the set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from utils.data.dataset import YoloDataset
from utils.data.samplers import ShardPlan
from utils.data.webshards import ShardLabelSet

DEFAULT_WINDOW = 1000  # samples shuffled together: partners and order mix over about this many


class ShardDataset(YoloDataset):
    """A YoloDataset whose ``label_set`` is a ShardLabelSet; ``plan`` gives the windows partners come from."""

    def __init__(self, *args: Any, label_set: ShardLabelSet, plan: ShardPlan | None = None, **kwargs: Any) -> None:
        self.plan = plan
        super().__init__(None, *args, label_set=label_set, **kwargs)

    def partners(self, epoch: int, index: int, k: int, rng: np.random.Generator) -> list[int]:
        if self.plan is None or self.plan.resampled:
            return super().partners(epoch, index, k, rng)
        pool = self.plan.partners(epoch, index)
        return pool[rng.integers(0, len(pool), k)].tolist()
