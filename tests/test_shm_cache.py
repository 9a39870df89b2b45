"""The per-node shared-memory image cache: filled once, unlinked at once, nothing left when a process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from utils.data.shm_cache import PREFIX, SHM_DIR, build_node_cache, segment_path
from utils.distributed import DistInfo

ROOT = Path(__file__).resolve().parents[1]
ONE = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)  # no group: the waits return at once


def test_cache_is_filled_and_its_name_is_already_gone(monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}")
    shapes = [(4, 6), (5, 3), (2, 2)]

    def fill(i: int, out: np.ndarray) -> None:
        out[:] = i + 1

    cache = build_node_cache(ONE, "k", shapes, fill, threads=2)
    assert cache is not None and cache.nbytes == sum(h * w * 3 for h, w in shapes)
    assert [v.shape for v in cache.views] == [(h, w, 3) for h, w in shapes]
    assert all((v == i + 1).all() for i, v in enumerate(cache.views))
    assert not segment_path(ONE, "k").exists()  # unlinked: freed with the last process that maps it
    assert str(cache.path) in Path("/proc/self/maps").read_text()
    pid = os.fork()
    if pid == 0:  # a forked DataLoader worker maps the same pages: what it writes, the parent sees
        cache.views[2][0, 0, 0] = 9
        os._exit(0)
    os.waitpid(pid, 0)
    assert cache.views[2][0, 0, 0] == 9


KILLED = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from utils.data.shm_cache import build_node_cache
from utils.distributed import DistInfo
cache = build_node_cache(DistInfo(0, 0, 1, 1), "killed", [(64, 64)] * 4, lambda i, out: out.fill(7), 1)
print(cache.path, flush=True)
time.sleep(60)
"""


def test_nothing_is_left_in_dev_shm_when_the_process_is_killed(tmp_path) -> None:
    env = dict(os.environ, TORCHELASTIC_RUN_ID=f"killed-{os.getpid()}")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(ROOT)], stdout=subprocess.PIPE, text=True, env=env)
    path = Path(proc.stdout.readline().strip())
    assert path.name.startswith(PREFIX) and path.parent == SHM_DIR
    assert not path.exists()  # already unlinked while the process holds it
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    time.sleep(0.1)
    assert not path.exists() and not list(SHM_DIR.glob(f"{path.name}*"))
