"""Loose images, label files and image lists in a bucket (``s3://``, ``gs://``), kept as a per-node local copy.

A data YAML's split may name a folder of images, a ``.txt`` list of images or a single file in object storage.
Everything that reads data here (labels, image checks, the label cache, ``--cache disk``) reads local files, so
such a split is fetched into a folder of the node's cache (``YOLO_TRAIN_DATA_CACHE``, default
``~/.cache/yolo-train/data``) and read from there: one folder per bucket and endpoint (the data's identity), the
objects at their keys below it. An object is fetched again only when its size or modification time in the bucket
differs from the local copy's (the copy takes the object's time), so the label cache, keyed by the local files'
sizes and times, stays valid until the bucket changes. A file removed from a listed folder in the bucket is removed
from its copy. The label and image caches are written in the copy, never into the bucket. Ranks of one node share
the folder: a lock makes one fetch while the others wait. Data that would not fit the folder's disk, or the size
limit ``YOLO_TRAIN_DATA_CACHE_GB``, is refused before any of it is fetched, every split of a data YAML counted
together (``copy_to_node``; the copy is read whole, so nothing is evicted).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import posixpath
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from utils.data.image_files import IMG_FORMATS, img2label_path, is_image_file
from utils.errors import UserError
from utils.log import LOGGER
from utils.safe_paths import relative_inside
from utils.storage import FileStat, Storage, is_url, open_storage, protocol_of

DEFAULT_DATA_CACHE = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "yolo-train" / "data"
# The files a split's folder holds for training: images, YOLO label and list files, VOC's XML, COCO's JSON.
DATA_SUFFIXES = (*IMG_FORMATS, "txt", "xml", "json")
# A size limit on the node's copies of bucket data, in GiB (as YOLO_TRAIN_SHARD_CACHE_GB is on the shard cache); the
# copy is never evicted (a split is read whole), so data that would pass it is refused before anything is fetched.
DATA_CACHE_GB_ENV = "YOLO_TRAIN_DATA_CACHE_GB"
# Where each backend is told of an endpoint other than the provider's own: part of the data's identity.
ENDPOINT_VARIABLES = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "gs": ("STORAGE_EMULATOR_HOST",)}


def is_object_store(location: str) -> bool:
    """Whether ``location`` is a URL of object storage whose loose files this module copies (not ``http(s)``)."""
    return protocol_of(location) in ("s3", "s3a", "gs", "gcs")


def cache_root() -> Path:
    return Path(os.environ.get("YOLO_TRAIN_DATA_CACHE") or DEFAULT_DATA_CACHE)


def _bucket_and_key(url: str) -> tuple[str, str, str]:
    protocol = protocol_of(url) or ""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return protocol, bucket, posixpath.normpath(key).lstrip("/") if key.strip("/") else ""


def bucket_folder(url: str) -> Path:
    """The local folder of the bucket of ``url``: named by the bucket and a hash of its protocol and endpoint,
    so that two servers' buckets of one name never share a copy."""
    protocol, bucket, _ = _bucket_and_key(url)
    family = "gs" if protocol in ("gs", "gcs") else "s3" if protocol in ("s3", "s3a") else protocol
    endpoint = next((os.environ[v] for v in ENDPOINT_VARIABLES.get(family, ()) if os.environ.get(v)), "")
    identity = hashlib.sha256(f"{family}://{bucket} at {endpoint}".encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in bucket)[:60]
    return cache_root() / f"{safe}-{identity}"


def local_path_of(url: str) -> Path:
    """Where the object (or folder) ``url`` lies in the node's copy; a key that climbs out of it is an error."""
    _, _, key = _bucket_and_key(url)
    folder = bucket_folder(url)
    path = relative_inside(folder, key) if key else folder
    if path is None:
        raise UserError(f"{url}: the key climbs out of its bucket ('..'); refused")
    return path


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_STORAGES: dict[tuple[str, int, int], Storage] = {}


def _storage_of(bucket_url: str) -> Storage:
    """The bucket's storage, one per process and environment: a data YAML's splits and lists are read with one
    client (a new one costs a fraction of a second before its first answer)."""
    key = (bucket_url, os.getpid(), hash(frozenset(os.environ.items())))
    if key not in _STORAGES:
        _STORAGES.clear()  # another environment or process: the old clients are of no use
        _STORAGES[key] = open_storage(bucket_url)
    return _STORAGES[key]


def read_text(url: str) -> str:
    """A small file in a bucket (a data YAML) as text; a one-line UserError when it is missing."""
    protocol, bucket, key = _bucket_and_key(url)
    try:
        return _storage_of(f"{protocol}://{bucket}").read_bytes(key).decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{url}: no such file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{url}: not UTF-8 text ({e.reason})") from None


def url_beside(list_url: str, entry: str) -> str:
    """The URL of ``entry``, a path relative to the folder of the object ``list_url`` (a list in a bucket); a
    one-line UserError when it climbs out of the bucket."""
    protocol, bucket, key = _bucket_and_key(list_url)
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(key), entry))
    if joined == ".." or joined.startswith("../"):
        raise UserError(f"{entry[:120]!r} climbs out of its bucket {protocol}://{bucket} ('..')")
    return f"{protocol}://{bucket}/{joined}"


def missing_objects(urls: list[str]) -> list[str]:
    """Those of ``urls`` (objects of one bucket) that the bucket does not hold, from one listing per folder."""
    if not urls:
        return []
    protocol, bucket, _ = _bucket_and_key(urls[0])
    keys = {_bucket_and_key(u)[2]: u for u in urls}
    found = _stats_of(_storage_of(f"{protocol}://{bucket}"), dict.fromkeys(keys))
    return [u for k, u in keys.items() if k not in found]


def local_data(url: str, where: str) -> str:
    """A local path that reads like the split entry ``url``: its folder, list or file copied into the node's
    cache (fetched where missing or changed); ``where`` names the YAML and key for messages."""
    return copy_to_node([(url, where)], url)[0]


def copy_to_node(entries: list[tuple[str, str]], source: str) -> list[str]:
    """Every entry (a split entry in a bucket: url, where) copied into the node's cache, one room check over all
    the files they need first, so that no split is fetched only for another to be refused (a one-line UserError
    naming ``source``, the data YAML); each bucket is listed once. Returns the local paths, in order."""
    copies = [_plan(url, where) for url, where in entries]
    needed: dict[Path, int] = {}
    for copy in copies:
        for name, stat in copy.wanted.items():
            local = local_path_of(copy.storage.full(name))
            if not _current(local, stat):
                needed[local] = stat.size
    if needed:
        _check_room(source, [(size, local) for local, size in needed.items()])
    return [str(_make(copy)) for copy in copies]


@dataclass(frozen=True)
class _Copy:
    """What the node's copy of one split entry needs: the objects (key: size and time in the bucket) and, for a
    folder, the folders whose stale files go; for a list, the local list's lines."""

    storage: Storage
    url: str
    wanted: dict[str, FileStat]
    folders: tuple[str, ...] = ()
    lines: tuple[str, ...] | None = None


def _plan(url: str, where: str) -> _Copy:
    protocol, bucket, key = _bucket_and_key(url)
    storage = _storage_of(f"{protocol}://{bucket}")
    under = storage.file_stats(key) if key else storage.file_stats()
    if under:  # a folder: its data files, and those of its labels' folder
        prefix = f"{key}/" if key else ""
        wanted = {f"{prefix}{name}": stat for name, stat in under.items() if _is_data(name)}
        labels = posixpath.dirname(_label_key(f"{prefix}image.jpg"))
        if labels != key:
            wanted |= {f"{labels}/{n}": st for n, st in storage.file_stats(labels).items() if n.endswith(".txt")}
        return _Copy(storage, storage.full(key), wanted, folders=tuple(dict.fromkeys([key, labels])))
    if not key or storage.modified(key) is None:
        raise UserError(f"{where}: {url} does not exist (no such object or folder)")
    if key.lower().endswith(".txt"):
        lines, keys = _list_entries(storage, key, url, where)
        return _Copy(storage, url, _stats_of(storage, keys), lines=tuple(lines))
    keys = {key: None, **({_label_key(key): None} if is_image_file(key) else {})}
    return _Copy(storage, url, _stats_of(storage, keys))


def _make(copy: _Copy) -> Path:
    """The copy made (one process of the node at a time): the objects fetched where missing or changed, a
    folder's files that the bucket no longer holds removed (no longer trained on), a list's local list written."""
    storage, local = copy.storage, local_path_of(copy.url)
    with _locked(bucket_folder(copy.url)):
        _fetch(storage, copy.url, copy.wanted)
        kept = {local_path_of(storage.full(k)) for k in copy.wanted}
        for folder in copy.folders:
            _remove_stale(local_path_of(storage.full(folder)), kept)
        if copy.lines is not None:
            body = "".join(f"{line}\n" for line in copy.lines).encode()
            if not local.is_file() or local.read_bytes() != body:  # rewritten only when changed: its time keys caches
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(body)
    return local


def _label_key(image_key: str) -> str:
    """The label file's key of an image's key (``/images/`` becomes ``/labels/``, the suffix ``.txt``)."""
    return img2label_path(f"/{image_key}")[1:]


def _is_data(name: str) -> bool:
    return "." in name and name.rsplit(".", 1)[1].lower() in DATA_SUFFIXES


def _list_entries(storage: Storage, key: str, url: str, where: str) -> tuple[list[str], dict[str, None]]:
    """The local list's lines of the bucket's list ``key``, and the keys of the images and labels it names."""
    text = storage.read_bytes(key).decode("utf-8", errors="replace")
    bucket_url = storage.location.rstrip("/")
    folder = posixpath.dirname(key)
    lines: list[str] = []
    wanted: dict[str, None] = {}
    for line in text.splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        if is_url(entry):
            if not entry.startswith(f"{bucket_url}/"):
                raise UserError(f"{where}: {url} lists {entry[:120]}, outside its bucket {bucket_url}")
            image_key = posixpath.normpath(entry[len(bucket_url) + 1 :])
        elif entry.startswith("/"):
            lines.append(entry)  # a local file of every node
            continue
        else:
            image_key = posixpath.normpath(posixpath.join(folder, entry))
        lines.append(str(local_path_of(f"{bucket_url}/{image_key}")))
        if is_image_file(image_key):
            wanted |= {image_key: None, _label_key(image_key): None}
    return lines, wanted


def _stats_of(storage: Storage, keys: dict[str, None]) -> dict[str, FileStat]:
    """The sizes and times of those of ``keys`` that exist, from one listing of each folder they lie in."""
    found: dict[str, FileStat] = {}
    for folder in sorted({posixpath.dirname(k) for k in keys}):
        listing = storage.file_stats(folder, recursive=False)
        found |= {f"{folder}/{n}" if folder else n: s for n, s in listing.items()}
    return {k: found[k] for k in keys if k in found}


def _fetch(storage: Storage, url: str, wanted: dict[str, FileStat]) -> None:
    """The objects ``wanted`` (key: size and time in the bucket) in the node's copy, fetching only those missing or
    changed (their room checked before: ``copy_to_node``); each copy takes its object's time."""
    pairs = []
    for key, stat in wanted.items():
        local = local_path_of(storage.full(key))
        if not _current(local, stat):
            pairs.append((key, local))
    if not pairs:
        return
    LOGGER.info(f"{url}: fetching {len(pairs)} of {len(wanted)} files into {bucket_folder(url)}")
    storage.download_many(pairs)
    for key, local in pairs:
        modified = wanted[key].modified
        if modified is not None:
            os.utime(local, (modified, modified))


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if size >= scale // 10:
            return f"{size / scale:.2f} {unit}"
    return f"{size / 1024:.1f} KiB"


def _cap_bytes() -> int | None:
    text = os.environ.get(DATA_CACHE_GB_ENV, "").strip()
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb > 0:  # NaN and negatives too
        raise UserError(f"{DATA_CACHE_GB_ENV}={text!r}: expected a size in GiB greater than 0")
    return int(gb * (1 << 30))


def _folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile by another node's process: not there
                total += os.stat(os.path.join(parent, name)).st_size
    return total


def _check_room(url: str, fetches: list[tuple[int, Path]]) -> None:
    """Before any download: a one-line UserError naming ``url`` when the files to fetch (size in the bucket, local
    path; a changed file replaces its older copy) need more than the cache folder's disk has free, or than is left
    under DATA_CACHE_GB_ENV."""
    root = cache_root()
    needed = sum(size - (path.stat().st_size if path.is_file() else 0) for size, path in fetches)
    if needed <= 0:
        return
    root.mkdir(parents=True, exist_ok=True)  # the disk it will be on (the first check of a node comes before it)
    available, why = shutil.disk_usage(root).free, f"free on the disk of {root}"
    cap = _cap_bytes()
    if cap is not None:
        used = _folder_bytes(root)
        if cap - used < available:
            available, why = max(cap - used, 0), f"left under {DATA_CACHE_GB_ENV}={os.environ[DATA_CACHE_GB_ENV]}"
            why += f", with {_size_text(used)} of copies in {root} already" if used else ""
    if needed > available:
        raise UserError(
            f"{url}: the node's copy of its {len(fetches)} files needs {_size_text(needed)} but "
            f"{_size_text(available)} is available ({why}); nothing was fetched"
        )


def _current(local: Path, stat: FileStat) -> bool:
    try:
        st = local.stat()
    except OSError:
        return False
    return st.st_size == stat.size and stat.modified is not None and int(st.st_mtime) == int(stat.modified)


def _remove_stale(folder: Path, kept: set[Path]) -> None:
    if not folder.is_dir():
        return
    for path in folder.rglob("*"):
        if path.is_file() and _is_data(path.name) and path not in kept:
            path.unlink(missing_ok=True)
