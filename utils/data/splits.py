"""What a data YAML's split names, beyond a folder or list of images (a str or list of str) and tar shards
(shard_names.ShardSet): a COCO JSON, Pascal VOC folders, or a fraction of another split. Plain records, made by
config.py and read by the readers behind labels.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CocoSplit:
    """A COCO JSON and where its images are: ``images`` when the YAML names a folder, else looked up."""

    annotations: str
    images: str | None = None
    names: tuple[str, ...] | None = None  # the YAML's names (categories matched by name), else categories by id
    source: str = ""  # the YAML and key, for messages


@dataclass(frozen=True)
class VocSplit:
    """Pascal VOC folders (each with Annotations/, JPEGImages/, ImageSets/Main/) and the image set to read."""

    roots: tuple[str, ...]
    image_set: str
    names: tuple[str, ...] = ()
    source: str = ""


@dataclass(frozen=True)
class FractionSplit:
    """``part`` ('train' or 'val') of ``base`` split by a hash of each image's path relative to ``root``."""

    base: Any  # the split it is taken from (any split form)
    root: str
    fraction: float
    part: str
