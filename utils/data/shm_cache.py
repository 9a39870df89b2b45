"""One decoded-image cache per node: a shared-memory segment in /dev/shm that every local rank maps.

``--cache ram`` under DDP with several ranks on a machine would otherwise hold one copy per rank. Here local
rank 0 creates one segment of the right size, every local rank maps it, and then the name is unlinked at once:
the memory stays as long as some process maps it and is returned to the system when the last one exits,
whether the run ends or is killed, so nothing is ever left behind in /dev/shm. The ranks fill it in parallel
(rank k decodes images k, k + L, ...), wait for each other, and then read every image from it. DataLoader
workers forked later inherit the mapping, so they share it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from utils.distributed import DistInfo, node_barrier, node_decides, node_index
from utils.log import LOGGER

SHM_DIR = Path("/dev/shm")
PREFIX = "yolo-train-cache-"


def segment_path(info: DistInfo, key: str) -> Path:
    """A name every rank of the node derives alike: the launcher's job, restart round, node and dataset."""
    env = os.environ
    job = env.get("TORCHELASTIC_RUN_ID") or f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    digest = hashlib.sha256(f"{job}/{info.restart_count}/{node_index(info)}/{key}".encode()).hexdigest()[:20]
    return SHM_DIR / f"{PREFIX}{digest}"


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


class NodeImageCache:
    """Images of fixed (h, w, 3) uint8 shapes in one node-wide shared mapping; ``views[i]`` is image i."""

    def __init__(self, mapping: mmap.mmap, shapes_hw: list[tuple[int, int]], path: Path):
        self.mapping, self.path = mapping, path
        sizes = [h * w * 3 for h, w in shapes_hw]
        starts = np.concatenate(([0], np.cumsum(sizes)))[:-1].astype(np.int64)
        self.views = [
            np.frombuffer(mapping, np.uint8, count=n, offset=int(o)).reshape(h, w, 3)
            for (h, w), n, o in zip(shapes_hw, sizes, starts)
        ]
        self.nbytes = int(sum(sizes))


def _create(path: Path, nbytes: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a segment of a crashed run of the same job that never got to unlink it
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    finally:
        os.close(fd)


def _map(path: Path, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed


def build_node_cache(
    info: DistInfo,
    key: str,
    shapes_hw: list[tuple[int, int]],
    fill_one: Callable[[int, np.ndarray], None],
    threads: int,
    prefix: str = "",
) -> NodeImageCache | None:
    """Create (local rank 0), map (every local rank), unlink, fill in parallel; None where /dev/shm cannot hold it
    (every rank of the node then gets None and falls back to its own cache)."""
    from concurrent.futures import ThreadPoolExecutor

    nbytes = int(sum(h * w * 3 for h, w in shapes_hw))
    path = segment_path(info, key)
    decision = ""
    if info.local_rank == 0:
        if nbytes * 1.05 > shm_free_bytes():
            decision = f"{SHM_DIR} has {shm_free_bytes() / 2**30:.2f} GiB free, {nbytes / 2**30:.2f} GiB needed"
        else:
            try:
                _create(path, nbytes)
            except OSError as e:
                decision = f"cannot create {path} ({e})"
    decision = node_decides(info, "shm-create", decision)
    if decision:
        LOGGER.warning(f"{prefix}WARNING one image cache per node not possible: {decision}; each rank caches its own")
        return None
    mapping = _map(path, nbytes)
    node_barrier(info, "shm-mapped")
    if info.local_rank == 0:
        path.unlink()  # every local rank maps it now: the memory lives exactly as long as the processes
    cache = NodeImageCache(mapping, shapes_hw, path)
    mine = list(range(info.local_rank, len(shapes_hw), info.local_world_size))
    with ThreadPoolExecutor(max(1, threads)) as pool:  # cv2 decoding releases the GIL
        list(pool.map(lambda i: fill_one(i, cache.views[i]), mine))
    node_barrier(info, "shm-filled")
    return cache
