"""Writing files so that a crash never leaves a half-written one: write beside it, then rename over it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
