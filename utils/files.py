"""Writing files so that a crash never leaves a half-written one: write beside it, then rename over it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask: from /proc on Linux; elsewhere by setting it and putting it back at once, under a lock
    (two threads doing that together could leave the wrong one set)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """A temporary path in ``path``'s folder; when the block ends without error it replaces ``path``.

    Whatever the block writes to the temporary path appears at ``path`` all at once or not at all; on an
    error (or a kill) ``path`` keeps its old content and the temporary file is removed where it can be.
    ``durable`` also flushes the file to disk before the rename (checkpoints: survive a power cut too).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600 whatever the umask; the file it becomes follows the umask, as open() would
        # make it, so that a teammate on shared storage reads checkpoints and caches as any other file.
        os.fchmod(fd, 0o666 & ~current_umask())
    finally:
        os.close(fd)
    try:
        yield Path(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
