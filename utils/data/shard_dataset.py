"""YoloDataset over indexed tar shards: the same samples and augmentations, images read from shard members.

Only where pixels come from changes (``ShardReader``); mosaic and mixup partners come from the sample's window
of the epoch's ShardPlan order, so a rank reads around where it already is instead of anywhere in the set.
"""
from __future__ import annotations

import numpy as np

from utils.data.dataset import YoloDataset
from utils.data.image_io import decode_image, decode_image_region
from utils.data.samplers import ShardPlan
from utils.data.shard_cache import ShardCache
from utils.data.webshards import ShardLabelSet, ShardReader
from utils.log import LOGGER

DEFAULT_WINDOW = 1000  # samples shuffled together: partners and order mix over about this many


class ShardDataset(YoloDataset):
    """A YoloDataset whose ``label_set`` is a ShardLabelSet; ``plan`` gives the windows partners come from."""

    def __init__(self, *args, label_set: ShardLabelSet, cache: str | None = None, plan: ShardPlan | None = None,
                 shard_cache: ShardCache | None = None, **kwargs):
        if cache == "disk":  # .npy files beside the images: there is no folder beside a tar member
            LOGGER.warning(f"{kwargs.get('prefix', '')}WARNING --cache disk does not apply to shards: not caching")
            cache = None
        self.reader = ShardReader(label_set, shard_cache)
        if kwargs.get("rect"):  # YoloDataset sorts its lists by aspect ratio: the reader must follow
            self.reader.reorder(np.argsort(label_set.shapes[:, 1] / label_set.shapes[:, 0], kind="stable"))
        self.plan = plan
        super().__init__(None, *args, label_set=label_set, cache=cache, **kwargs)

    def _read_original(self, i: int) -> np.ndarray:
        data = self.reader.read(i)
        img = decode_image(data) if data is not None else None
        if img is None:  # verified when indexed, so the shard changed or broke since: keep training going
            LOGGER.warning(f"{self.prefix}WARNING {self.im_files[i]}: cannot decode image, using a grey image")
            w, h = (int(v) for v in self.shapes[i])
            img = np.full((h, w, 3), 114, np.uint8)
        return img

    def _decodes_from_file(self, i: int) -> bool:
        return self.ram_images[i] is None

    def _region(self, i: int, shape_hw: tuple[int, int], region: tuple[int, int, int, int],
                out: np.ndarray) -> np.ndarray | None:
        data = self.reader.read(i)
        return None if data is None else decode_image_region(data, shape_hw, region, out, self.jpeg_decoder)

    def partners(self, epoch: int, index: int, k: int, rng: np.random.Generator) -> list[int]:
        if self.plan is None or self.plan.resampled:
            return super().partners(epoch, index, k, rng)
        pool = self.plan.partners(epoch, index)
        return pool[rng.integers(0, len(pool), k)].tolist()
