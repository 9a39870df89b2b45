"""What a data YAML's split names, beyond a folder or list of images (a str or list of str) and tar shards
(shard_names.ShardSet): a COCO JSON, Pascal VOC folders, or a fraction of another split. Plain records, made by
config.py and read by the readers behind labels.py; and ``user_path``, how a path written in such a file is
checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import UserError


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


NAME_MAX, PATH_MAX = 255, 4096  # bytes: a longer file name or path cannot exist (Linux's limits)


def user_path(text: str, where: str) -> Path:
    """A path a user's file wrote, ``~`` expanded; a one-line UserError naming ``where`` (the file and key) when no
    such path can exist: an unknown ``~user``, a NUL byte, a name or path longer than the system allows."""
    if "\0" in text:
        raise UserError(f"{where}: path {text[:80]!r} holds a NUL byte")
    try:
        path = Path(text).expanduser()
    except RuntimeError as e:  # ~nosuchuser: no home directory to expand to
        raise UserError(f"{where}: path {text[:80]!r}: {e}") from e
    encoded = [os.fsencode(part) for part in path.parts]
    if any(len(part) > NAME_MAX for part in encoded) or len(os.fsencode(str(path))) > PATH_MAX:
        raise UserError(f"{where}: path {text[:80]!r} is longer than a path may be ({NAME_MAX} bytes a name)")
    return path
