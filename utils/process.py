"""Process-wide settings the entry points (train.py, val.py, detect.py) make once, before the real work.

Keeping freed memory: glibc gives every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB)
its own mapping and unmaps it on free, so a training step or a validation batch maps and faults in its large
activations afresh every time. On a 2-core AMD EPYC (AVX2, no bf16), yolov5n at 320 in fp32, five pairs of
fresh processes (bench/allocator.py): inference 1.36-1.54x as fast, a training step 0.97-1.16x (median 1.04x;
three more pairs: 1.23-1.76x and 0.93-1.25x, so the step's gain is within the noise).
The cost: memory the process freed stays with it (up to its peak) until it ends; the 3-epoch coco128 run's
peak PSS was 2.71-2.81 GiB against 2.60 GiB.

Freezing the imports' objects: importing torch (and torch._dynamo, which its optimizers import) leaves about
370,000 objects that the garbage collector scans in every full collection, including the one at exit; moved
out of its reach, a 3-epoch coco128 run at 320 spent 0.56 instead of 0.71 s in collections and its exit took
0.7-0.9 instead of 2.0 s (same machine).
"""
from __future__ import annotations

import ctypes
import gc
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap beyond this still goes back to the system


def user_tuned_malloc() -> bool:
    """True when the environment already tunes or replaces malloc: then it is left as the user set it."""
    return (any(name.startswith("MALLOC_") for name in os.environ) or "GLIBC_TUNABLES" in os.environ
            or "LD_PRELOAD" in os.environ)


def setup_process() -> str:
    """Both settings below, for an entry point's main(); says what was done."""
    freeze_imported_objects()
    return keep_freed_memory()


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
