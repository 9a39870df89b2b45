"""Naming WebDataset tar shards in a data YAML: which split entries are shards, and their URLs in order.

A split's ``train:``/``val:`` may name shards as a brace pattern, a list, a ``.txt`` list of URLs or a folder
of ``.tar`` files; URLs are local paths, ``http(s)://`` or ``pipe:COMMAND`` (refused unless the user opts in with
``--allow-pipe``). The index that makes them readable is ``webshards.py``'s.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from utils.data.image_files import is_image_file
from utils.data.remote_data import is_object_store, missing_objects, read_text, url_beside
from utils.data.shard_cache import check_local_shards, check_pipe_allowed, is_remote
from utils.data.splits import user_path
from utils.errors import UserError


@dataclass(frozen=True)
class ShardSet:
    """The shard URLs of one split, in order, and what the data YAML said (for messages)."""

    urls: tuple[str, ...]
    source: str


# ---- naming shards ------------------------------------------------------------------------------------------


MAX_SHARD_URLS = 1_000_000  # a split's shards after expansion: far more than any dataset, few enough to list
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")  # a numeric brace range: {000..999}, {0..99..2}


def _braces(pattern: str, room: int) -> list[str]:
    """The pattern's expansion; a one-line UserError when it names more than ``room`` shards (it is expanded no
    further: `{000000000..999999999}` would take minutes and gigabytes)."""
    import braceexpand  # WebDataset's own dependency, the expansion its shard lists use

    # braceexpand lists each range whole before it yields anything: a range too long is refused unexpanded
    for start, end, step in _RANGE.findall(pattern):
        if len(start) > 12 or len(end) > 12 or abs(int(end) - int(start)) // max(abs(int(step or 1)), 1) >= room:
            raise UserError(f"{pattern[:120]}: names more than {MAX_SHARD_URLS} shards")
    try:
        urls = list(itertools.islice(braceexpand.braceexpand(pattern), room + 1))
    except ValueError:  # braceexpand.UnbalancedBracesError, its only error
        raise UserError(f"{pattern[:120]!r}: unbalanced braces (a shard pattern's {{ and }} must pair)") from None
    if len(urls) > room:
        raise UserError(f"{pattern[:120]}: names more than {MAX_SHARD_URLS} shards")
    return urls


def _local(entry: str, base: Path) -> str:
    p = user_path(entry, f"shard {entry[:80]!r}")
    return str(p if p.is_absolute() else (base / p).resolve())


def _tar_folder(path: Path) -> list[str]:
    return sorted(str(p) for p in path.iterdir() if p.is_file() and p.name.endswith(".tar"))


def _txt_entries(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read shard list ({e})") from e
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def _lists_shards(first: str) -> bool:
    """Whether a ``.txt`` list whose first entry is ``first`` lists shards (rather than images)."""
    return is_remote(first) or first.endswith(".tar") or (".tar" in first and "{" in first)


def _is_bucket_list(entry: str) -> bool:
    return is_object_store(entry) and entry.lower().endswith(".txt") and "{" not in entry


def _bucket_list_entries(url: str) -> list[str]:
    return [s for s in (line.strip() for line in read_text(url).splitlines()) if s and not s.startswith("#")]


def is_shard_entry(entry: str, base: Path) -> bool:
    """True when a data YAML split entry names shards (rather than images, folders of images or image lists)."""
    if _is_bucket_list(entry):  # a list in a bucket: of shards, or of loose images (utils/data/remote_data.py)
        try:
            return _lists_shards(next(iter(_bucket_list_entries(entry)), ""))
        except UserError:  # missing or not text: the loose-data reader says so in its own words
            return False
    if is_remote(entry):  # in a bucket, anything but tar shards is loose files (utils/data/remote_data.py)
        return ".tar" in entry or not is_object_store(entry)
    if ".tar" in entry and ("{" in entry or entry.endswith(".tar")):
        return True
    path = Path(_local(entry, base))
    if path.is_dir():  # a folder of images that happens to hold a .tar stays a folder of images
        return bool(_tar_folder(path)) and not any(is_image_file(p.name) for p in path.iterdir())
    if path.is_file() and path.suffix.lower() == ".txt":
        return _lists_shards(next(iter(_txt_entries(path)), ""))
    return False


def _bucket_list_urls(url: str, room: int, lists: tuple[Path | str, ...]) -> list[str]:
    """The shard URLs of the ``.txt`` list ``url`` in a bucket: relative entries resolved against the list's own
    folder in the bucket, URLs and absolute local paths as they are, nested lists followed. A bad entry (one that
    climbs out of the bucket, unbalanced braces, a shard of the list's bucket that it does not hold) is one line
    naming the list and the entry's line."""
    urls: list[str] = []
    numbered = [(n, line.strip()) for n, line in enumerate(read_text(url).splitlines(), 1)]
    bucket = "/".join(url.split("/", 3)[:3]) + "/"  # s3://name/: the prefix of the list's own bucket's objects
    own: dict[str, int] = {}  # the shards of the list's own bucket, and the line that named each
    for n, entry in numbered:
        if not entry or entry.startswith("#"):
            continue
        try:
            if not is_remote(entry) and not entry.startswith("/"):  # relative: to the list's folder in the bucket
                entry = url_beside(url, entry)
            if is_remote(entry) and not _is_bucket_list(entry):
                found = _braces(entry, room - len(urls))
                own |= {u: n for u in found if u.startswith(bucket) and u not in own}
            else:  # another list (its shards checked as it is read), or a local path, pattern, list or folder
                found = expand_shard_urls([entry], Path("/"), (*lists, url))
        except UserError as e:
            raise UserError(f"{url} line {n}: {e}") from None
        urls += found
        if len(urls) > room:
            raise UserError(f"{url}: names more than {MAX_SHARD_URLS} shards")
    missing = missing_objects(list(own))
    if missing:
        raise UserError(
            f"{url} line {own[missing[0]]}: {missing[0]} is not in the bucket"
            + (f" (nor are {len(missing) - 1} more of its shards)" if len(missing) > 1 else "")
        )
    return urls


def expand_shard_urls(entries: list[str], base: Path, lists: tuple[Path | str, ...] = ()) -> list[str]:
    """Every entry (brace pattern, URL, .txt list here or in a bucket, folder of .tar) as a flat list of shard URLs,
    at most MAX_SHARD_URLS; ``lists`` are the .txt lists being read (one that lists itself, at any depth, is an
    error)."""
    urls: list[str] = []
    for entry in entries:
        room = MAX_SHARD_URLS - len(urls)
        if _is_bucket_list(entry):
            if entry in lists:
                chain = " -> ".join(str(p) for p in (*lists[lists.index(entry) :], entry))
                raise UserError(f"{entry}: shard list lists itself ({chain})")
            urls += _bucket_list_urls(entry, room, lists)
            continue
        if is_remote(entry):
            urls += _braces(entry, room)
            continue
        path = Path(_local(entry, base))
        if path.is_dir():
            urls += _tar_folder(path)
        elif path.suffix.lower() == ".txt" and path.is_file():
            if path in lists:
                chain = " -> ".join(str(p) for p in (*lists[lists.index(path) :], path))
                raise UserError(f"{path}: shard list lists itself ({chain})")
            urls += expand_shard_urls(_txt_entries(path), path.parent, (*lists, path))
        else:
            urls += [_local(u, base) for u in _braces(entry, room)]
        if len(urls) > MAX_SHARD_URLS:
            raise UserError(f"{lists[-1] if lists else entry[:120]}: names more than {MAX_SHARD_URLS} shards")
    return urls


def resolve_shard_split(value: str | list[str], root: Path, yaml_file: Path | str, key: str) -> ShardSet:
    """A split that names shards, expanded and checked: a missing local shard is a one-line error naming it."""
    entries = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    try:
        urls = expand_shard_urls(entries, root)
    except UserError as e:  # a list, pattern or path the YAML led to: say which YAML
        raise UserError(f"{yaml_file} '{key}': {e}") from e
    if not urls:
        raise UserError(f"{yaml_file}: '{key}' {value!r} names no shards")
    for url in urls:  # before anything is opened: a pipe: URL from a shard list too
        check_pipe_allowed(url, f"{yaml_file} '{key}'")
    check_local_shards(urls, f"{yaml_file} '{key}'")
    return ShardSet(tuple(urls), f"{yaml_file} '{key}'")
