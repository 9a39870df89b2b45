"""utils/process.py: freed memory reused without page faults; imports' objects frozen after a collection."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HUGE_PAGES = (64 << 20) // (2 << 20)  # the probe's buffer in 2 MiB pages

# Allocates, touches and frees 64 MiB, then does it again and prints the minor page faults of the second time.
PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
from utils.process import keep_freed_memory
message = keep_freed_memory() if {keep} else "not asked"
import numpy as np
def faults_of_one_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = np.ones(64 << 20, dtype=np.uint8)
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_buffer()
print(faults_of_one_buffer())
print(message)
"""

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)


def second_buffer_faults(keep: bool, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    env.update(extra_env or {})
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=str(ROOT), keep=keep)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return int(out[0]), out[1]


@glibc_only
def test_freed_memory_is_reused_without_page_faults() -> None:
    default_faults, _ = second_buffer_faults(keep=False)
    kept_faults, message = second_buffer_faults(keep=True)
    # glibc maps and unmaps such a buffer each time: a fault per page, at least per 2 MiB (numpy asks for huge
    # pages), each on memory the kernel zeroes first.
    assert default_faults >= HUGE_PAGES
    assert kept_faults * 10 < default_faults, message
    assert "kept for reuse" in message


@glibc_only
def test_a_malloc_setting_from_the_environment_is_left_alone() -> None:
    faults, message = second_buffer_faults(keep=True, extra_env={"MALLOC_ARENA_MAX": "2"})
    assert "left as the environment sets it" in message
    assert faults >= HUGE_PAGES


def test_setup_process_freezes_the_live_objects_after_collecting_garbage() -> None:
    probe = f"""
import gc, sys, weakref
sys.path.insert(0, {str(ROOT)!r})
from utils.process import setup_process
class Node:
    pass
cycle = Node(); cycle.me = cycle; gone = weakref.ref(cycle); del cycle  # garbage, in a cycle
before = len(gc.get_objects())
setup_process()
print(gc.get_freeze_count() > 1000, len(gc.get_objects()) < before // 10, gone() is None)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]


# ---- process-wide settings are made in one place (issue 30) ------------------------------------------------


def _kernel_flags() -> tuple:
    import torch

    return (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
    )


def test_seeding_and_choosing_a_device_leave_process_settings_alone(monkeypatch) -> None:
    import torch

    from utils.torch_utils import init_torch_seeds, select_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # a seeding function once set it to True
    before = _kernel_flags()
    init_torch_seeds(3)
    assert select_device("cpu").type == "cpu"
    assert _kernel_flags() == before and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_setup_process_makes_the_settings_and_says_so(monkeypatch) -> None:
    import torch

    from utils import process

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(process, "freeze_imported_objects", lambda: None)  # not this test process's objects
    monkeypatch.setattr(process, "keep_freed_memory", lambda: "allocator: (not in this test)")
    old = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        lines = process.setup_process("cpu", deterministic=True).splitlines()
        assert lines[:2] == [
            "CUDA_VISIBLE_DEVICES=-1 (--device cpu: CUDA stays uninitialised)",
            "kernels: deterministic (--deterministic)",
        ]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "-1"
        assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)
        assert torch.are_deterministic_algorithms_enabled()
        assert process.setup_process("cpu", deterministic=False).splitlines()[0] == "allocator: (not in this test)"
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = old
        torch.use_deterministic_algorithms(False)


def test_importing_every_module_changes_no_process_setting() -> None:
    probe = f"""
import gc, importlib, os, pkgutil, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
def state():
    return (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), gc.get_freeze_count(),
            {{k: v for k, v in os.environ.items() if k.startswith(("CUDA", "CUBLAS", "OMP", "MALLOC"))}})
before = state()
import models, utils, utils.data
names = [m.name for pkg in (models, utils, utils.data) for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]
for name in names + ["train", "val", "detect", "export", "shards"]:
    importlib.import_module(name)
print(len(names) > 30, state() == before)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
