"""WebDataset tar shards as a dataset split: the index that makes them randomly readable, and reading samples.

A sample is the members of one tar sharing a key (WebDataset's convention, split by ``base_plus_ext``): an
image (``key.jpg|jpeg|png|webp|bmp|tif|tiff``) and optionally its YOLO label rows (``key.txt``; none or empty means a
background image). How a data YAML names shards is shard_names.py's.

The index is built once per shard set (by local rank 0 of each node; the others wait) by reading every shard's tar
headers (the standard library's reader: member names, offsets and sizes), then each sample's members one sample at
a time, verified with the label cache's checks. A shard cut or damaged anywhere is skipped whole and named; a member
over ``MAX_MEMBER_BYTES`` skips its sample. It is the split's LabelTable (label_table.py, stored by label_cache.py)
with, per sample, its shard, image offset and size, and per split the shard URLs. With it an epoch's length is
known without reading the shards, and any sample is one ``pread`` away.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from utils.data.image_checks import probe_key
from utils.data.image_io import ImageError, probe_image_bytes
from utils.data.label_cache import cached_table
from utils.data.label_table import BACKGROUND, CORRUPT, EMPTY, LABELLED, LabelTable, TableBuilder, report
from utils.data.shard_cache import ShardCache, is_remote, require_fetch
from utils.data.shard_names import ShardSet  # noqa: F401  (what the index is of; named by the data YAML)
from utils.data.yolo_labels import LabelError, parse_label_text
from utils.errors import UserError, describe
from utils.log import LOGGER

INDEX_VERSION = 1
SHARD_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")  # every format the loose-file readers take
INDEX_SUFFIX = ".yolo-train.index.npz"
# A member larger than this (an image or its labels) skips its sample at the index: no sample's bytes are ever read
# whole into memory beyond it, whatever a shard holds.
MAX_MEMBER_BYTES = 256 << 20
# WebDataset's metadata members (``__key__``, ``__meta__/...``) are not samples.
_META_NAME = re.compile(r"__[^/]*__($|/)")


# ---- the index ----------------------------------------------------------------------------------------------


class ShardLabelSet(LabelTable):
    """A LabelTable whose images are tar members: ``im_files`` are ``<shard url>/<member>``.

    Per sample ``extra`` holds ``shard`` (its index in ``meta['urls']``), ``offset`` and ``size`` (its image bytes
    in the shard file).
    """

    @property
    def shard_urls(self) -> list[str]:
        return [str(u) for u in self.meta["urls"]]

    @property
    def sample_shard(self) -> np.ndarray:
        return self.extra["shard"]

    @property
    def offsets(self) -> np.ndarray:
        return self.extra["offset"]

    @property
    def sizes(self) -> np.ndarray:
        return self.extra["size"]

    @property
    def shard_counts(self) -> np.ndarray:
        """Samples per shard (of those in this table)."""
        return np.bincount(self.sample_shard, minlength=len(self.meta["urls"])).astype(np.int64)


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


def _tar_members(local_path: str) -> list[tuple[str, int, int]]:
    """(name, offset of its bytes, size) of every regular member, in tar order, from the headers alone (PAX and GNU
    long names followed; no member's bytes are read). Raises ``tarfile.ReadError`` for a shard cut or damaged inside
    a header or a member."""
    file_size = os.path.getsize(local_path)
    with tarfile.open(local_path, "r:") as tar:
        members = [(m.name, m.offset_data, m.size) for m in tar if m.isreg() and not _META_NAME.match(m.name)]
        end = tar.offset  # where the header after the last member starts (or the archive's end blocks)
    cut = next((name for name, offset, size in members if offset + size > file_size), None)
    if cut is not None:
        raise tarfile.ReadError(f"member {cut} is cut short")
    # tarfile takes a header cut short or garbled anywhere but first for the end of the archive: past the last
    # member only the archive's zero blocks may follow.
    with open(local_path, "rb") as f:
        f.seek(end)
        while chunk := f.read(1 << 20):
            if chunk.strip(b"\0"):
                raise tarfile.ReadError(f"a damaged or cut tar header at byte {end}, after {len(members)} members")
    return members


def _read_member(f: BinaryIO, name: str, offsets: dict[str, tuple[int, int]]) -> bytes:
    offset, size = offsets[name]
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise tarfile.ReadError(f"member {name} is cut short")
    return data


def _verify_sample(
    url: str,
    image: tuple[str, bytes] | None,
    label: bytes | None,
    nc: int | None,
    scan: _ShardScan,
    offsets: dict[str, tuple[int, int]],
    key: str,
) -> None:
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
    """Verify one shard, one sample's members in memory at a time; a shard that cannot be read to its end is skipped
    whole (``bad_shard``), a member over ``MAX_MEMBER_BYTES`` skips its sample."""
    from webdataset.tariterators import base_plus_ext

    local = require_fetch(cache, url)
    scan = _ShardScan()
    samples: dict[str, dict[str, str]] = {}  # key -> ext -> member name, in tar order
    try:
        members = _tar_members(local)
        offsets = {name: (offset, size) for name, offset, size in members}
        for name, _, _ in members:
            key, ext = base_plus_ext(name)
            if key is not None and ext is not None:
                samples.setdefault(key, {})[ext.lower()] = name
        with open(local, "rb") as f:
            for key, parts in samples.items():
                _scan_sample(url, key, parts, f, offsets, nc, scan)
    # OverflowError: a PAX record's length past ssize_t, which the standard library's reader cannot seek to
    except (tarfile.TarError, OSError, EOFError, ValueError, OverflowError) as e:
        return _ShardScan(bad_shard=True, messages=[f"{url}: unreadable or truncated shard, skipped ({describe(e)})"])
    return scan


def _scan_sample(
    url: str,
    key: str,
    parts: dict[str, str],
    f: BinaryIO,
    offsets: dict[str, tuple[int, int]],
    nc: int | None,
    scan: _ShardScan,
) -> None:
    """Read one sample's image and label members (unless one is over the size bound) and verify them."""
    name = next((parts[e] for e in SHARD_IMAGE_EXTS if e in parts), None)
    wanted = [n for n in (name, parts.get("txt")) if n is not None]
    too_big = next((n for n in wanted if offsets[n][1] > MAX_MEMBER_BYTES), None)
    if too_big is not None:
        scan.members.append(name or key)
        scan.status.append(CORRUPT)
        scan.shapes.append((0, 0))
        scan.labels.append(np.zeros((0, 5), np.float32))
        scan.offsets.append(-1)
        scan.sizes.append(0)
        scan.messages.append(
            f"{url}/{too_big}: member of {offsets[too_big][1]:,} bytes, over the {MAX_MEMBER_BYTES:,}-byte bound; "
            "sample skipped"
        )
        return
    image = (name, _read_member(f, name, offsets)) if name is not None else None
    label = _read_member(f, parts["txt"], offsets) if "txt" in parts else None
    _verify_sample(url, image, label, nc, scan, offsets, key)


def _index_hash(urls: tuple[str, ...], nc: int | None) -> str:
    h = hashlib.sha256(f"v{INDEX_VERSION} nc={nc} {probe_key()}\n".encode())
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


def _build(shards: ShardSet, cache: ShardCache, nc: int | None, workers: int) -> ShardLabelSet:
    with ThreadPoolExecutor(max(1, min(workers, 8))) as pool:  # fetching and tar reading wait on I/O
        scans = list(pool.map(lambda u: scan_shard(u, cache, nc), shards.urls))
    builder = TableBuilder()
    for _k, (url, sc) in enumerate(zip(shards.urls, scans)):
        for member, status, shape, labels in zip(sc.members, sc.status, sc.shapes, sc.labels):
            builder.add(f"{url}/{member}", status, shape, labels)
        builder.messages += sc.messages
        builder.count("duplicates", sc.duplicates)
    builder.count("bad_shards", sum(sc.bad_shard for sc in scans))
    extra = {
        "shard": np.repeat(np.arange(len(scans)), [len(sc.status) for sc in scans]).astype(np.int64),
        "offset": np.array([o for sc in scans for o in sc.offsets], dtype=np.int64),
        "size": np.array([o for sc in scans for o in sc.sizes], dtype=np.int64),
    }
    table = builder.build(extra=extra, meta={"urls": np.array(list(shards.urls))})
    return ShardLabelSet(**vars(table))


def load_shard_index(
    shards: ShardSet,
    nc: int | None = None,
    cache: ShardCache | None = None,
    workers: int = 8,
    prefix: str = "",
    verbose: bool = True,
) -> ShardLabelSet:
    """The usable samples of a shard set, from its index when current, else scanned and indexed.

    In a distributed run call it on local rank 0 first, so that one process per node builds the index (and
    fetches remote shards into the node's cache) while the others wait. Raises UserError when nothing is usable.
    """
    table, reused = read_shard_table(shards, nc, cache, workers)
    report(table, prefix, verbose, reused, what=f"samples in {len(shards.urls)} shards")
    usable = table.usable()
    if not len(usable):
        raise UserError(f"{shards.source}: no usable samples in {len(shards.urls)} shard(s)")
    return usable


def read_shard_table(
    shards: ShardSet, nc: int | None = None, cache: ShardCache | None = None, workers: int = 8
) -> tuple[ShardLabelSet, bool]:
    """Every sample of a shard set (usable or not), from its index when current; and whether it was."""
    cache = cache or ShardCache()
    digest = _index_hash(shards.urls, nc)
    table, reused = cached_table(
        index_path_for(shards, cache, digest), digest, lambda: _build(shards, cache, nc, workers)
    )
    return (table if isinstance(table, ShardLabelSet) else ShardLabelSet(**vars(table))), reused


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

    def shards_in_order(self, samples: list[int]) -> list[str]:
        """The distinct shard URLs of ``samples`` in first-use order (what to prefetch next)."""
        seen: dict[int, None] = {}
        for s in samples:
            seen.setdefault(int(self.sample_shard[s]), None)
        return [self.urls[k] for k in seen]
