"""The label cache: a split's LabelTable (label_table.py) stored once, reused while its sources are unchanged.

Every form of labels (YOLO text files, COCO JSON, VOC XML, the tar-shard index) is cached here the same way.
A reader gives a digest of what its table was read from (file paths, sizes and modification times; the JSON's;
the options that decide validity) and a function that builds the table; the cache is reused only when its
format version and digest match and it reads back whole, else the table is built again and stored.

The cache is an ``.npz`` of plain arrays (never pickled objects, so reading one cannot run code), written
atomically beside the data, or under the user's cache folder when the data's folder is read-only.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np

from utils.data.image_checks import probe_key
from utils.data.label_table import LabelTable
from utils.files import atomic_output
from utils.log import LOGGER

CACHE_VERSION = 2
CACHE_SUFFIX = ".yolo-train.cache"
FALLBACK_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "yolo-train" / "labels"


def stat_digest(header: str, paths: Iterable[str]) -> str:
    """Hash of ``header`` and the paths with their sizes and modification times (a missing file hashes too)."""
    h = hashlib.sha256(f"v{CACHE_VERSION} {probe_key()} {header}\n".encode())  # probe_key: what was verified
    for path in paths:
        try:
            st = os.stat(path)
            h.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{path}\t-\n".encode())
    return h.hexdigest()


def fallback_cache_path(primary: Path) -> Path:
    """A user-writable place for the cache of a read-only dataset, keyed by the primary location."""
    key = hashlib.sha256(str(primary.resolve()).encode()).hexdigest()[:16]
    return FALLBACK_CACHE_DIR / f"{primary.name.split('.')[0]}-{key}{CACHE_SUFFIX}"


def write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an .npz atomically: a temp file in the same folder, then os.replace (raises OSError)."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **cast("dict[str, Any]", arrays))  # numpy's stubs take a keyword named like its own flags


def read_cache(path: Path, expected_hash: str) -> dict[str, np.ndarray] | None:
    """The cache's arrays when it is ours, complete, of this version and for these sources; else None."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:  # allow_pickle=False: a pickle payload is refused, not run
            arrays = {k: z[k] for k in z.files}
        if int(arrays["version"]) != CACHE_VERSION or str(arrays["hash"]) != expected_hash:
            LOGGER.info(f"{path}: label cache is stale, rebuilding")
            return None
        return arrays
    except Exception as e:  # any damage (truncated zip, foreign format, missing keys) means rebuild
        LOGGER.info(f"{path}: label cache unreadable ({type(e).__name__}), rebuilding")
        return None


def _read_table(path: Path, digest: str) -> LabelTable | None:
    arrays = read_cache(path, digest)
    if arrays is None:
        return None
    try:
        return LabelTable.from_arrays(arrays)
    except Exception as e:  # a cache of our version and digest but missing arrays: damaged, rebuild
        LOGGER.info(f"{path}: label cache incomplete ({type(e).__name__}), rebuilding")
        return None


def _store(arrays: dict[str, np.ndarray], primary: Path) -> Path | None:
    for path in (primary, fallback_cache_path(primary)):
        try:
            write_cache(path, arrays)
            return path
        except OSError as e:
            LOGGER.warning(f"{path}: cannot write label cache ({e})")
    return None


def cached_table(primary: Path, digest: str, build: Callable[[], LabelTable]) -> tuple[LabelTable, bool]:
    """The table cached at ``primary`` (or its fallback) for ``digest``, else ``build()`` stored there.

    Returns the table (its ``cache_file`` set, '' when it could not be stored) and whether it came from the cache.
    In a distributed run call it on local rank 0 first, so that one process per machine builds the cache.
    """
    for path in (primary, fallback_cache_path(primary)):
        table = _read_table(path, digest)
        if table is not None:
            table.cache_file = str(path)
            return table, True
    table = build()
    arrays = {"version": np.array(CACHE_VERSION), "hash": np.array(digest), **table.to_arrays()}
    stored = _store(arrays, primary)
    table.cache_file = str(stored or "")
    return table, False
