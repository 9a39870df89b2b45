"""WebDataset tar shards as a dataset split: naming them, and the index that makes them randomly readable.

A sample is the members of one tar sharing a key (WebDataset's convention, split by ``base_plus_ext``): an
image (``key.jpg|jpeg|png|webp|bmp``) and optionally its YOLO label rows (``key.txt``; none or empty means a
background image). A split's ``train:``/``val:`` may name shards as a brace pattern, a list, a ``.txt`` list of
URLs or a folder of ``.tar`` files; URLs are local paths, ``http(s)://`` or ``pipe:COMMAND``.

The index is built once per shard set (by local rank 0 of each node; the others wait) by streaming every shard
with WebDataset's tar iterator, verifying each sample with the label cache's checks, and taking member offsets
from ``wids``' memory-mapped tar index. It is an ``.npz`` of plain arrays (read without unpickling): per shard
its URL and usable sample count, per sample its shard, image offset and size, shape and labels. With it an
epoch's length is known without reading the shards, and any sample is one ``pread`` away.
"""
from __future__ import annotations

import hashlib
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils.data.image_io import ImageError, probe_image_bytes
from utils.data.label_cache import (BACKGROUND, CORRUPT, EMPTY, FALLBACK_CACHE_DIR, LABELLED, LabelError, LabelSet,
                                    log_problems, parse_label_text, status_tally)
from utils.data.shard_cache import ShardCache, check_local_shards, is_remote, require_fetch
from utils.errors import UserError
from utils.files import atomic_output
from utils.log import LOGGER

INDEX_VERSION = 1
SHARD_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp")
INDEX_SUFFIX = ".yolo-train.index.npz"


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
        from utils.data.config import is_image_file

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
    check_local_shards(urls, f"{yaml_file} '{key}'")
    return ShardSet(tuple(urls), f"{yaml_file} '{key}'")


# ---- the index ----------------------------------------------------------------------------------------------

@dataclass
class ShardLabelSet(LabelSet):
    """A LabelSet whose images are tar members: ``im_files`` are ``<shard url>/<member>``."""

    shard_urls: list[str] = field(default_factory=list)
    shard_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # usable samples per shard
    sample_shard: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # image bytes in the shard file
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass
class _ShardScan:
    """One shard's samples in tar order (usable or not) and what went wrong."""

    members: list[str] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    shapes: list[tuple[int, int]] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    duplicates: int = 0
    messages: list[str] = field(default_factory=list)
    bad_shard: bool = False


def _read_members(local_path: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of every regular member, streamed with WebDataset's tar iterator; raises on a damaged tar."""
    from webdataset.tariterators import tar_file_iterator

    def reraise(exn: Exception) -> bool:
        raise exn

    with open(local_path, "rb") as f:
        return [(m["fname"], m["data"]) for m in tar_file_iterator(f, handler=reraise)]


def _member_offsets(local_path: str) -> dict[str, tuple[int, int]]:
    """name -> (offset of its bytes, size), from wids' memory-mapped index of the tar headers."""
    from wids.wids_mmtar import MMIndexedTar

    tar = MMIndexedTar(local_path, verbose=False)
    try:
        return {name: (offset + 512, size) for name, offset, size in tar.by_index}
    finally:
        tar.close()


def _pax_offsets(local_path: str) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) from the standard library's reader, which follows PAX and GNU long-name headers
    (wids reads the 100-character name field only); used only for names wids did not give."""
    with tarfile.open(local_path, "r:") as tar:
        return {m.name: (m.offset_data, m.size) for m in tar.getmembers() if m.isfile()}


def _verify_sample(url: str, image: tuple[str, bytes] | None, label: bytes | None, nc: int | None,
                   scan: _ShardScan, offsets: dict[str, tuple[int, int]], key: str) -> None:
    empty = np.zeros((0, 5), np.float32)

    def add(status: int, name: str, shape: tuple[int, int], labels: np.ndarray, note: str = "") -> None:
        offset, size = offsets.get(name, (-1, 0))
        scan.members.append(name)
        scan.status.append(status)
        scan.shapes.append(shape)
        scan.labels.append(labels)
        scan.offsets.append(offset)
        scan.sizes.append(size)
        if note:
            scan.messages.append(note)

    if image is None:
        add(CORRUPT, key, (0, 0), empty, f"{url}/{key}: no image member ({', '.join(SHARD_IMAGE_EXTS)}), skipped")
        return
    name, data = image
    if name not in offsets:  # e.g. a name longer than the tar header holds (wids reads the plain header only)
        add(CORRUPT, name, (0, 0), empty, f"{url}/{name}: member not indexable, skipped")
        return
    try:
        shape, warning = probe_image_bytes(data)
    except ImageError as e:
        add(CORRUPT, name, (0, 0), empty, f"{url}/{name}: corrupt image, skipped ({e})")
        return
    note = f"{url}/{name}: {warning}" if warning else ""
    if label is None:
        add(BACKGROUND, name, shape, empty, note)
        return
    try:
        labels, n_dup = parse_label_text(label.decode("utf-8"), nc)
    except UnicodeDecodeError:
        add(CORRUPT, name, (0, 0), empty, f"{url}/{key}.txt: label is not UTF-8 text, sample skipped")
        return
    except LabelError as e:
        add(CORRUPT, name, (0, 0), empty, f"{url}/{key}.txt: {e}, sample skipped")
        return
    scan.duplicates += n_dup
    add(LABELLED if len(labels) else EMPTY, name, shape, labels, note)


def scan_shard(url: str, cache: ShardCache, nc: int | None) -> _ShardScan:
    """Verify one shard; a shard that cannot be read to its end is skipped whole (``bad_shard``)."""
    from webdataset.tariterators import base_plus_ext

    local = require_fetch(cache, url)
    scan = _ShardScan()
    try:
        members = _read_members(local)
        offsets = _member_offsets(local)
        if any(name not in offsets for name, _ in members):
            offsets.update(_pax_offsets(local))
    except (tarfile.TarError, OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        scan.bad_shard = True
        scan.messages.append(f"{url}: unreadable or truncated shard, skipped ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})")
        return scan
    samples: dict[str, dict[str, tuple[str, bytes]]] = {}  # key -> ext -> (name, bytes), in tar order
    for name, data in members:
        key, ext = base_plus_ext(name)
        if key is None or ext is None:
            continue
        samples.setdefault(key, {})[ext.lower()] = (name, data)
    for key, parts in samples.items():
        image = next((parts[e] for e in SHARD_IMAGE_EXTS if e in parts), None)
        label = parts["txt"][1] if "txt" in parts else None
        _verify_sample(url, image, label, nc, scan, offsets, key)
    return scan


def _index_hash(urls: tuple[str, ...], nc: int | None) -> str:
    h = hashlib.sha256(f"v{INDEX_VERSION} nc={nc}\n".encode())
    for url in urls:
        if is_remote(url):
            h.update(f"{url}\n".encode())  # a remote shard is taken as immutable once named
        else:
            st = os.stat(url)
            h.update(f"{url}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def index_path_for(shards: ShardSet, cache: ShardCache, digest: str) -> Path:
    """Beside the first shard when it is local (the converter writes it there), else in the shard cache."""
    first = shards.urls[0]
    if is_remote(first):
        return cache.directory / f"index-{digest[:16]}.npz"
    return Path(first).parent / f"{Path(first).name.split('.')[0].rsplit('-', 1)[0]}-{digest[:12]}{INDEX_SUFFIX}"


def _join(strings: list[str]) -> np.ndarray:
    return np.frombuffer("\n".join(strings).encode("utf-8"), dtype=np.uint8)


def _split(data: np.ndarray) -> list[str]:
    text = data.tobytes().decode("utf-8")
    return text.split("\n") if text else []


def _build(shards: ShardSet, cache: ShardCache, nc: int | None, workers: int, digest: str) -> dict[str, np.ndarray]:
    with ThreadPoolExecutor(max(1, min(workers, 8))) as pool:  # fetching and tar reading wait on I/O
        scans = list(pool.map(lambda u: scan_shard(u, cache, nc), shards.urls))
    status = [s for sc in scans for s in sc.status]
    labels = [lb for sc in scans for lb in sc.labels]
    return {
        "version": np.array(INDEX_VERSION),
        "hash": np.array(digest),
        "urls": _join(list(shards.urls)),
        "bad_shard": np.array([sc.bad_shard for sc in scans], dtype=bool),
        "shard_samples": np.array([len(sc.status) for sc in scans], dtype=np.int64),
        "members": _join([m for sc in scans for m in sc.members]),
        "status": np.array(status, dtype=np.int8),
        "shapes": np.array([s for sc in scans for s in sc.shapes], dtype=np.int32).reshape(-1, 2),
        "offsets": np.array([o for sc in scans for o in sc.offsets], dtype=np.int64),
        "sizes": np.array([o for sc in scans for o in sc.sizes], dtype=np.int64),
        "counts": np.array([len(lb) for lb in labels], dtype=np.int32),
        "labels": (np.concatenate(labels, 0) if labels else np.zeros((0, 5))).astype(np.float32).reshape(-1, 5),
        "duplicates": np.array(sum(sc.duplicates for sc in scans), dtype=np.int64),
        "messages": _join([m.replace("\n", " ") for sc in scans for m in sc.messages]),
    }


def _read_index(path: Path, digest: str) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        if int(arrays["version"]) == INDEX_VERSION and str(arrays["hash"]) == digest:
            return arrays
    except Exception as e:  # any damage (truncated zip, foreign file, missing keys) means rebuild
        LOGGER.info(f"{path}: shard index unreadable ({type(e).__name__}), rebuilding")
    return None


def _store(arrays: dict[str, np.ndarray], primary: Path) -> Path | None:
    fallback = FALLBACK_CACHE_DIR / f"{primary.name}"
    for path in (primary, fallback):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, **arrays)
            return path
        except OSError as e:
            LOGGER.warning(f"{path}: cannot write shard index ({e})")
    return None


def load_shard_index(shards: ShardSet, nc: int | None = None, cache: ShardCache | None = None, workers: int = 8,
                     prefix: str = "", verbose: bool = True) -> ShardLabelSet:
    """The verified samples of a shard set, from its index when current, else scanned and indexed.

    In a distributed run call it on local rank 0 first, so that one process per node builds the index (and
    fetches remote shards into the node's cache) while the others wait. Raises UserError when nothing is usable.
    """
    cache = cache or ShardCache()
    digest = _index_hash(shards.urls, nc)
    primary = index_path_for(shards, cache, digest)
    arrays, reused, stored = None, True, primary
    for path in (primary, FALLBACK_CACHE_DIR / primary.name):
        arrays = _read_index(path, digest)
        if arrays is not None:
            stored = path
            break
    if arrays is None:
        reused = False
        arrays = _build(shards, cache, nc, workers, digest)
        stored = _store(arrays, primary)
    return _label_set(arrays, shards, prefix, verbose, reused, stored)


def _label_set(arrays: dict[str, np.ndarray], shards: ShardSet, prefix: str, verbose: bool, reused: bool,
               stored: Path | None) -> ShardLabelSet:
    urls = list(shards.urls)
    status, members = arrays["status"], _split(arrays["members"])
    per_sample = np.split(arrays["labels"], np.cumsum(arrays["counts"])[:-1]) if len(status) else []
    sample_shard = np.repeat(np.arange(len(urls)), arrays["shard_samples"])
    keep = np.nonzero(status != CORRUPT)[0]
    tally = status_tally(status, int(arrays["duplicates"]))
    tally["bad_shards"] = int(arrays["bad_shard"].sum())
    messages = _split(arrays["messages"])
    if verbose:
        log_problems(messages, prefix)
        where = f"{'index ' if reused else 'indexed to '}{stored}" if stored else "not indexed"
        LOGGER.info(f"{prefix}{len(urls)} shards ({tally['bad_shards']} unreadable, skipped), {len(status)} samples: "
                    f"{tally['labelled']} labelled, {tally['background']} backgrounds without label, {tally['empty']} "
                    f"empty, {tally['corrupt']} corrupt, {tally['duplicates']} duplicate rows dropped ({where})")
    if not len(keep):
        raise UserError(f"{shards.source}: no usable samples in {len(urls)} shard(s)")
    shard_of = sample_shard[keep]
    return ShardLabelSet(
        im_files=[f"{urls[shard_of[j]]}/{members[i]}" for j, i in enumerate(keep)],
        label_files=[f"{urls[shard_of[j]]}/{members[i].rsplit('.', 1)[0]}.txt" for j, i in enumerate(keep)],
        labels=[per_sample[i].copy() for i in keep],
        shapes=arrays["shapes"][keep].astype(np.int64),
        counts=tally, messages=messages, cache_file=str(stored or ""),
        shard_urls=urls, shard_counts=np.bincount(shard_of, minlength=len(urls)).astype(np.int64),
        sample_shard=shard_of.astype(np.int64), offsets=arrays["offsets"][keep], sizes=arrays["sizes"][keep],
    )


# ---- reading samples ----------------------------------------------------------------------------------------

class ShardReader:
    """Image bytes of indexed samples: one ``pread`` from the shard file (remote ones through the node's cache).

    File descriptors are opened lazily and kept per process (a DataLoader worker opens its own; ``pread`` has no
    shared file position, so descriptors inherited across fork are safe too).
    """

    MAX_OPEN = 64

    def __init__(self, label_set: ShardLabelSet, cache: ShardCache | None = None):
        self.urls = label_set.shard_urls
        self.sample_shard, self.offsets, self.sizes = label_set.sample_shard, label_set.offsets, label_set.sizes
        self.cache = cache or ShardCache()
        self._fds: dict[int, int] = {}
        self.failures = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fds"] = {}  # descriptors do not travel to spawned workers
        return state

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= self.MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(self.cache.local_path(self.urls[shard]), os.O_RDONLY)
            self._fds[shard] = fd
        return fd

    def read(self, i: int) -> np.ndarray | None:
        """Encoded bytes of sample ``i`` as uint8, None (and counted) when the shard cannot be read any more."""
        shard = int(self.sample_shard[i])
        try:
            data = os.pread(self._fd(shard), int(self.sizes[i]), int(self.offsets[i]))
        except OSError as e:  # includes FetchError: a remote shard gone since it was indexed
            self.failures += 1
            LOGGER.warning(f"WARNING {self.urls[shard]}: cannot read sample {i} ({e})")
            return None
        if len(data) != int(self.sizes[i]):
            self.failures += 1
            LOGGER.warning(f"WARNING {self.urls[shard]}: sample {i} is cut short (shard changed since indexed)")
            return None
        return np.frombuffer(data, np.uint8)

    def reorder(self, order: np.ndarray) -> None:
        """Sample ``j`` becomes the former sample ``order[j]`` (the dataset sorted its samples)."""
        self.sample_shard, self.offsets, self.sizes = self.sample_shard[order], self.offsets[order], self.sizes[order]

    def shards_in_order(self, samples: list[int]) -> list[str]:
        """The distinct shard URLs of ``samples`` in first-use order (what to prefetch next)."""
        seen: dict[int, None] = {}
        for s in samples:
            seen.setdefault(int(self.sample_shard[s]), None)
        return [self.urls[k] for k in seen]
