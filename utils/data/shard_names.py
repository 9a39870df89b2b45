"""Naming WebDataset tar shards in a data YAML: which split entries are shards, and their URLs in order.

A split's ``train:``/``val:`` may name shards as a brace pattern, a list, a ``.txt`` list of URLs or a folder
of ``.tar`` files; URLs are local paths, ``http(s)://`` or ``pipe:COMMAND`` (refused unless the user opts in with
``--allow-pipe``). The index that makes them readable is ``webshards.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from utils.data.image_files import is_image_file
from utils.data.shard_cache import check_local_shards, check_pipe_allowed, is_remote
from utils.errors import UserError


@dataclass(frozen=True)
class ShardSet:
    """The shard URLs of one split, in order, and what the data YAML said (for messages)."""

    urls: tuple[str, ...]
    source: str


# ---- naming shards ------------------------------------------------------------------------------------------


def _braces(pattern: str) -> list[str]:
    import braceexpand  # WebDataset's own dependency, the expansion its shard lists use

    return list(braceexpand.braceexpand(pattern))


def _local(entry: str, base: Path) -> str:
    p = Path(entry).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _tar_folder(path: Path) -> list[str]:
    return sorted(str(p) for p in path.iterdir() if p.is_file() and p.name.endswith(".tar"))


def _txt_entries(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read shard list ({e})") from e
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def is_shard_entry(entry: str, base: Path) -> bool:
    """True when a data YAML split entry names shards (rather than images, folders of images or image lists)."""
    if is_remote(entry) or ".tar" in entry and ("{" in entry or entry.endswith(".tar")):
        return True
    path = Path(_local(entry, base))
    if path.is_dir():  # a folder of images that happens to hold a .tar stays a folder of images
        return bool(_tar_folder(path)) and not any(is_image_file(p.name) for p in path.iterdir())
    if path.is_file() and path.suffix.lower() == ".txt":
        first = next(iter(_txt_entries(path)), "")
        return is_remote(first) or first.endswith(".tar") or (".tar" in first and "{" in first)
    return False


def expand_shard_urls(entries: list[str], base: Path) -> list[str]:
    """Every entry (brace pattern, URL, .txt list, folder of .tar) as a flat list of shard URLs."""
    urls: list[str] = []
    for entry in entries:
        if is_remote(entry):
            urls += _braces(entry)
            continue
        path = Path(_local(entry, base))
        if path.is_dir():
            urls += _tar_folder(path)
        elif path.suffix.lower() == ".txt" and path.is_file():
            urls += expand_shard_urls(_txt_entries(path), path.parent)
        else:
            urls += [_local(u, base) for u in _braces(entry)]
    return urls


def resolve_shard_split(value: str | list[str], root: Path, yaml_file: Path, key: str) -> ShardSet:
    """A split that names shards, expanded and checked: a missing local shard is a one-line error naming it."""
    entries = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    urls = expand_shard_urls(entries, root)
    if not urls:
        raise UserError(f"{yaml_file}: '{key}' {value!r} names no shards")
    for url in urls:  # before anything is opened: a pipe: URL from a shard list too
        check_pipe_allowed(url, f"{yaml_file} '{key}'")
    check_local_shards(urls, f"{yaml_file} '{key}'")
    return ShardSet(tuple(urls), f"{yaml_file} '{key}'")
