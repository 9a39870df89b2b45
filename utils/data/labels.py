"""Where a split's labels come from: one reader per form, each giving the same LabelTable (label_table.py).

    data YAML (config.py) -> split record -> reader (this dispatch) -> LabelTable (cached) -> dataset

Forms: a folder or list of images with YOLO label files (yolo_labels.py), a COCO JSON (coco_reader.py), Pascal
VOC folders (voc_reader.py), tar shards (webshards.py), and a fraction of another split (here). A new form is
one reader and one line in ``read_table``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from utils.data.coco_reader import read_coco_table
from utils.data.image_files import list_image_files
from utils.data.label_table import LabelRows, LabelTable, PathList, report, status_tally
from utils.data.shard_names import ShardSet
from utils.data.splits import CocoSplit, FractionSplit, VocSplit
from utils.data.voc_reader import read_voc_table
from utils.data.webshards import read_shard_table
from utils.data.yolo_labels import read_yolo_table
from utils.errors import UserError
from utils.log import LOGGER

Split = str | list[str] | ShardSet | CocoSplit | VocSplit | FractionSplit


def read_table(
    source: Split, nc: int | None = None, workers: int = 8, prefix: str = "", verbose: bool = True
) -> tuple[LabelTable, bool]:
    """Every sample a split lists (usable or not, see ``status``), and whether it all came from caches."""
    if isinstance(source, ShardSet):
        return read_shard_table(source, nc=nc, workers=workers)
    if isinstance(source, CocoSplit):
        return read_coco_table(source, workers=workers, prefix=prefix, verbose=verbose)
    if isinstance(source, VocSplit):
        parts = [read_voc_table(source, root, workers, prefix, verbose) for root in map(Path, source.roots)]
        return concat_tables([t for t, _ in parts]), all(r for _, r in parts)
    if isinstance(source, FractionSplit):
        table, reused = read_table(source.base, nc, workers, prefix, verbose)
        in_val = fraction_mask(table.im_files, source.root, source.fraction)
        part = table.take(np.nonzero(in_val if source.part == "val" else ~in_val)[0])
        part.counts = {**table.counts, **status_tally(part.status)}  # the reader's other counts are the whole split's
        if verbose:
            LOGGER.info(
                f"{prefix}{len(part)} of {len(table)} images taken as '{source.part}' "
                f"(val: {source.fraction:g} of the train split by a hash of each path)"
            )
        return part, reused
    return read_yolo_table(list_image_files(source), nc, workers, prefix, source=source, verbose=verbose)


def load_labels(
    source: Split, nc: int | None = None, workers: int = 8, prefix: str = "", verbose: bool = True
) -> LabelTable:
    """The usable samples of a split (corrupt ones dropped, problems logged); UserError when none is.

    In a distributed run call it on local rank 0 first (``torch_distributed_zero_first``), so that one process
    per machine builds the caches and the others read them.
    """
    table, reused = read_table(source, nc, workers, prefix, verbose)
    what = f"samples in {len(source.urls)} shards" if isinstance(source, ShardSet) else "images"
    report(table, prefix, verbose, reused, what)
    usable = table.usable()
    if not len(usable):
        raise UserError(f"{describe(source)}: no usable images among {len(table)} listed")
    return usable


def describe(source: Split) -> str:
    """The split for a message: the files, JSON or folders it names."""
    if isinstance(source, ShardSet):
        return source.source
    if isinstance(source, CocoSplit):
        return source.annotations
    if isinstance(source, VocSplit):
        return ", ".join(source.roots)
    if isinstance(source, FractionSplit):
        return f"{source.part} part of {describe(source.base)}"
    return ", ".join(source) if isinstance(source, list) else str(source)


def fraction_mask(paths: Sequence[str], root: str, fraction: float) -> np.ndarray:
    """(N,) True for the paths whose hash of their path relative to ``root`` falls below ``fraction``.

    A path's side depends on that path alone, so adding images or moving the dataset folder never moves an old
    image to the other side.
    """
    out = np.zeros(len(paths), dtype=bool)
    limit = int(fraction * (1 << 64))
    for i, path in enumerate(paths):
        rel = os.path.relpath(path, root) if os.path.isabs(path) else path
        digest = hashlib.blake2b(rel.replace(os.sep, "/").encode("utf-8"), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "big") < limit
    return out


def concat_tables(tables: list[LabelTable]) -> LabelTable:
    """Tables one after another (the parts of a split that names several sources)."""
    if len(tables) == 1:
        return tables[0]
    first = tables[0]
    rows = np.concatenate([t.labels.rows for t in tables], 0)
    counts = np.concatenate([t.labels.counts() for t in tables])
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    tally: dict[str, int] = {}
    for t in tables:
        for k, v in t.counts.items():
            tally[k] = tally.get(k, 0) + v
    paths = PathList.from_strings([p for t in tables for p in t.im_files])
    return replace(
        first,
        labels=LabelRows(rows, offsets),
        shapes=np.concatenate([t.shapes for t in tables]),
        im_files=paths,
        status=np.concatenate([t.status for t in tables]),
        counts=tally,
        messages=[m for t in tables for m in t.messages],
        extra={k: np.concatenate([t.extra[k] for t in tables]) for k in first.extra},
        cache_file=", ".join(t.cache_file for t in tables if t.cache_file),
    )
