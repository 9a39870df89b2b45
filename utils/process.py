"""Process-wide settings: the entry points (train.py, val.py, detect.py, export.py) make them once, in
``setup_process`` before the real work, and log what it says; no import and no seeding function sets them.

Which GPUs the process sees (``CUDA_VISIBLE_DEVICES`` from ``--device``, before CUDA starts; ``cpu`` hides them
all so CUDA stays uninitialised) and how kernels are chosen (cuDNN's benchmark, or with ``--deterministic``
repeatable kernels and cuBLAS workspace) are set here; so are the two memory settings below.

Keeping freed memory: glibc gives every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB)
its own mapping and unmaps it on free, so a training step or a validation batch maps and faults in its large
activations afresh every time; keeping freed memory makes inference faster (bench/allocator.py measures it;
figures in docs/benchmarks.md). The cost: memory the process freed stays with it (up to its peak) until it
ends, so the peak resident memory rises a little.

Freezing the imports' objects: importing torch (and torch._dynamo, which its optimizers import) leaves
hundreds of thousands of objects that the garbage collector scans in every full collection, including the one
at exit; moved out of its reach, collections and the exit take less time.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import platform
import sys

import torch

from utils.cli import parse_device
from utils.errors import UserError

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap beyond this still goes back to the system


def user_tuned_malloc() -> bool:
    """True when the environment already tunes or replaces malloc: then it is left as the user set it."""
    return (
        any(name.startswith("MALLOC_") for name in os.environ)
        or "GLIBC_TUNABLES" in os.environ
        or "LD_PRELOAD" in os.environ
    )


def setup_process(device: str = "", deterministic: bool | None = None) -> str:
    """Every process-wide setting, for an entry point's main(); says what was set, a line each.

    ``device`` is --device; ``deterministic`` is --deterministic where the script trains (None leaves the
    kernel choice as torch has it).
    """
    done = [visible_devices(device)]
    if deterministic is not None:
        done.append(kernel_choice(deterministic))
    done.append(keep_freed_memory())
    freeze_imported_objects()
    return "\n".join(line for line in done if line)


def _set_env(name: str, value: str) -> bool:
    changed = os.environ.get(name) != value
    os.environ[name] = value
    return changed


def visible_devices(device: str) -> str:
    """CUDA_VISIBLE_DEVICES from --device ('cpu', '0' or '0,1,2,3'; '' leaves it), before CUDA starts; says what
    was set. A --device that is not valid is left to ``select_device`` to refuse."""
    try:
        request = parse_device(device)
    except UserError:
        return ""
    if request.cpu:
        value, why = "-1", "--device cpu: CUDA stays uninitialised"
    elif request.gpus:
        # Each GPU once: CUDA stops reading the list at a repeated id, and '0,0' means two ranks on GPU 0.
        value, why = ",".join(map(str, request.distinct)), "from --device; set before CUDA starts"
    else:
        return ""
    return f"CUDA_VISIBLE_DEVICES={value} ({why})" if _set_env("CUDA_VISIBLE_DEVICES", value) else ""


def kernel_choice(deterministic: bool) -> str:
    """cuDNN's benchmark (the fastest kernels for each shape), or repeatable kernels for --deterministic."""
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    if not deterministic:
        return ""
    torch.use_deterministic_algorithms(True, warn_only=True)
    line = "kernels: deterministic (--deterministic)"
    if torch.cuda.is_available() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        _set_env("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        line += "; CUBLAS_WORKSPACE_CONFIG=:4096:8 for repeatable cuBLAS results"
    return line


EXIT_WATCH_S = 20.0  # a process's teardown (workers, threads, CUDA) that takes longer than this names where it waits


def watch_exit(status: int, seconds: float = EXIT_WATCH_S) -> int:
    """Called with an entry point's exit status when its work is done, before the interpreter's teardown (loader
    workers, threads, the CUDA context): if the process is still running ``seconds`` later, every thread's Python
    stack goes to stderr, so that a slow exit says where it waits instead of passing unexplained. Returns
    ``status``."""
    faulthandler.dump_traceback_later(seconds, exit=False, file=sys.stderr)
    return status


def freeze_imported_objects() -> None:
    """Exempt every object alive now (after the imports) from garbage collection; forked workers inherit it.

    Garbage is collected first (0.2 s after train.py's imports), so that only live objects are frozen.
    """
    gc.collect()
    gc.freeze()


def keep_freed_memory() -> str:
    """Ask glibc to serve every allocation from its heap and keep freed memory; says what was done.

    Call it before allocating much; forked data-loader workers inherit it.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"allocator: left as it is ({platform.system()} without glibc)"
    if user_tuned_malloc():
        return "allocator: left as the environment sets it (MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD given)"
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "allocator: glibc refused the settings; left as it is"
    return "allocator: freed memory is kept for reuse (glibc mmap off, trim threshold 1 GiB)"
