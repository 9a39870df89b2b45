"""Where a sample's pixels come from: one small object per kind of storage (loose image files, tar shards).

The dataset holds one ``ImageSource`` and asks it for image ``i`` whole (``read``) or for one region of it
(``read_region``: the partial JPEG decode of a mosaic tile). Its caches (RAM, one per node, ``.npy`` files) sit
in front of the source and ask it only for what they do not hold. A new kind of storage is one new class here
and one line in ``open_source``; the dataset, its caches and its augmentation stay as they are.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from utils.data.image_io import decode_image, decode_image_region, read_image, read_image_region
from utils.data.jpeg_region import JpegRegionDecoder
from utils.data.label_table import LabelTable, PathList
from utils.data.webshards import ShardLabelSet, ShardReader

Region = tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels of the image at its displayed size


class ImageSource(Protocol):
    kind: str  # what the images are, for messages ("shards")
    disk_cacheable: bool  # whether --cache disk can keep a .npy beside each image

    def read(self, i: int) -> np.ndarray | None:
        """Image ``i`` decoded whole (BGR uint8 HxWx3, EXIF orientation applied); None where it cannot be."""

    def read_region(self, i: int, shape_hw: tuple[int, int], region: Region, out: np.ndarray) -> bool:
        """Decode only ``region`` of image ``i`` (displayed size ``shape_hw``) into ``out``; False where that
        cannot be done (no decoder, not a JPEG, another size): the caller then decodes the whole image."""

    def prefetch(self, upcoming: list[int]) -> None:
        """Start making the images ``upcoming`` (in reading order) cheap to read; it must not block."""


class FileSource:
    """Images as files, one per sample."""

    kind = "image files"
    disk_cacheable = True

    def __init__(self, files: PathList, decoder: JpegRegionDecoder | None):
        self.files, self.decoder = files, decoder  # the table's path buffer: shared by workers, never copied

    def read(self, i: int) -> np.ndarray | None:
        return read_image(self.files[i])

    def read_region(self, i: int, shape_hw: tuple[int, int], region: Region, out: np.ndarray) -> bool:
        return read_image_region(self.files[i], shape_hw, region, out, self.decoder) is not None

    def prefetch(self, upcoming: list[int]) -> None:
        pass  # local files: the page cache does this better than we could


class ShardSource:
    """Images as members of indexed tar shards: one ``pread`` each (``ShardReader``)."""

    kind = "shards"
    disk_cacheable = False  # a .npy goes beside its image: there is no folder beside a tar member

    def __init__(self, label_set: ShardLabelSet, decoder: JpegRegionDecoder | None):
        self.reader, self.decoder = ShardReader(label_set), decoder

    def read(self, i: int) -> np.ndarray | None:
        data = self.reader.read(i)
        return None if data is None else decode_image(data)

    def read_region(self, i: int, shape_hw: tuple[int, int], region: Region, out: np.ndarray) -> bool:
        data = self.reader.read(i)
        return data is not None and decode_image_region(data, shape_hw, region, out, self.decoder) is not None

    def prefetch(self, upcoming: list[int]) -> None:
        # Remote shards of these samples, in the order they are read, downloaded in the background.
        self.reader.cache.prefetch(self.reader.shards_in_order(upcoming))


def open_source(label_set: LabelTable, decoder: JpegRegionDecoder | None) -> ImageSource:
    """The source of a verified split's images: its tar shards, or its files."""
    if isinstance(label_set, ShardLabelSet):
        return ShardSource(label_set, decoder)
    return FileSource(label_set.im_files, decoder)
