"""Numbered run folders: runs/val/exp, exp2, exp3, ..."""

from __future__ import annotations

from pathlib import Path


def increment_path(path: str | Path, exist_ok: bool = False, mkdir: bool = False, sep: str = "") -> Path:
    """``path`` itself if free (or ``exist_ok``), else the first free ``path{sep}2``, ``path{sep}3``, ...

    A file path keeps its suffix (``results.txt`` -> ``results2.txt``). ``mkdir`` creates the folder.
    The check-then-create is not atomic: two processes starting the same run name at once can collide.
    """
    path = Path(path)
    if path.exists() and not exist_ok:
        stem, suffix = (path.with_suffix(""), path.suffix) if path.is_file() else (path, "")
        n = 2
        while Path(f"{stem}{sep}{n}{suffix}").exists():
            n += 1
        path = Path(f"{stem}{sep}{n}{suffix}")
    if mkdir:
        path.mkdir(parents=True, exist_ok=True)
    return path
