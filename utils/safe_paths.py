"""Strings from users' files (class names, image stems) made into path parts that stay inside a run folder.

A class name comes from a data YAML or a checkpoint, a stem from a file someone else named: either may hold
``../``, a leading ``/``, a leading dot, characters a file system refuses, or hundreds of bytes. ``safe_part``
keeps ``[A-Za-z0-9._-]`` and writes ``_`` for anything else, so that a part is never a path of its own;
``PathParts`` also keeps two different strings from landing on one part (``a/b`` and ``a_b``, or ``A`` and
``a`` on a case-insensitive file system); ``inside`` is the last check before a file is written. A string that a
user's file gives as a path below a folder it belongs to (a VOC image id) is kept only when ``relative_inside``
finds it stays there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from utils.errors import UserError

MAX_BYTES = 100  # well under every file system's 255-byte limit, with room for a suffix and an extension
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_part(text: object) -> str:
    """``text`` as one path part: characters outside ``[A-Za-z0-9._-]`` become ``_``, no leading dot (no hidden
    file, no ``..``), never empty, at most ``MAX_BYTES`` bytes (all ASCII, so bytes are characters)."""
    part = _UNSAFE.sub("_", str(text))
    if part.startswith("."):
        part = "_" + part[1:]
    return part[:MAX_BYTES] or "_"


class PathParts:
    """One safe part per string, the same each time it is asked; a string whose safe part another string already
    holds gets ``_2``, ``_3``, ... (parts compared without case, for case-insensitive file systems)."""

    def __init__(self, texts: Iterable[object] = ()):
        self._parts: dict[str, str] = {}
        self._taken: set[str] = set()
        for text in texts:
            self.part(text)

    def part(self, text: object) -> str:
        key = str(text)
        if key in self._parts:
            return self._parts[key]
        base = candidate = safe_part(key)
        n = 2
        while candidate.lower() in self._taken:
            suffix = f"_{n}"
            candidate = base[: MAX_BYTES - len(suffix)] + suffix
            n += 1
        self._parts[key] = candidate
        self._taken.add(candidate.lower())
        return candidate


def inside(root: str | Path, path: str | Path) -> Path:
    """``path`` resolved, after checking that it lies inside ``root`` (links followed): a UserError otherwise."""
    root_resolved = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise UserError(f"{path}: would be written outside the run folder {root_resolved}; nothing was written there")
    return resolved


def relative_inside(root: str | Path, text: str) -> Path | None:
    """``root / text`` when ``text``, a path relative to ``root`` written in a user's file, stays inside ``root``
    as written: not empty, not absolute, no NUL byte, no ``..`` that climbs above ``root``; else None.

    Judged on the text alone: links inside ``root`` are the dataset's own (datasets are often folders of links),
    so nothing is resolved.
    """
    if not text or "\0" in text:
        return None
    pure = PurePosixPath(text)
    if pure.is_absolute():
        return None
    depth = 0
    for part in pure.parts:
        depth += -1 if part == ".." else 1
        if depth < 0:
            return None
    return Path(root) / text
