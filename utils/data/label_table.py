"""The label table: what every reader of labels produces and what the datasets read.

A split's samples live in a few flat numpy arrays instead of Python lists of objects: the label rows of all
images in one (R, 5) float32 array with per-image offsets, the image sizes in one (N, 2) array and the image
paths in one byte buffer with offsets. A data-loader worker forked from the process that built them shares
these pages for good: reading an element makes a new small object and never writes to the shared pages,
whereas reading from a list of objects changes their reference counts and so copies every page it touches.

Readers (YOLO text files, COCO JSON, VOC XML, tar-shard index) build a table with ``TableBuilder`` over every
sample they list, usable or not (``status``); the label cache stores that table as plain arrays; the datasets
take the usable samples (``usable()``) and index them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from utils.log import LOGGER

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations are never evaluated on older ones

# Per-sample status codes.
LABELLED, BACKGROUND, EMPTY, CORRUPT = 0, 1, 2, 3
MAX_LOGGED_WARNINGS = 100
ID_RANGE = (-(2**63), 2**63 - 1)  # ids are stored as int64
MAX_IMAGE_SIDE = 2**28  # pixels: a width or height stated beyond this is an error, not an image


def finite_number(value: Any) -> float | None:
    """A number parsed from JSON as a float, or None: booleans (``True`` is not 1), non-numbers, NaN, infinities and
    integers too large for a float are not numbers in a label source."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def finite_text(text: str) -> float:
    """A number written as text (a YOLO label row, a VOC XML tag) as a float; ValueError naming it unless it is a
    finite number (``nan``, ``inf`` and ``1e400`` are not)."""
    try:
        number = float(text)
    except ValueError as e:
        raise ValueError(f"{text[:40]!r} is not a number") from e
    if not math.isfinite(number):
        raise ValueError(f"{text[:40]!r} is not a finite number")
    return number


def is_id(value: Any) -> bool:
    """Whether a JSON value is usable as an id: an integer (not a boolean) in the int64 range."""
    return isinstance(value, int) and not isinstance(value, bool) and ID_RANGE[0] <= value <= ID_RANGE[1]


class PathList(Sequence[str]):
    """Strings kept as one UTF-8 buffer and an offsets array; ``p[i]`` decodes one on demand."""

    def __init__(self, buffer: np.ndarray, offsets: np.ndarray):
        self.buffer = np.ascontiguousarray(buffer, dtype=np.uint8)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> PathList:
        encoded = [s.encode("utf-8") for s in strings]
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"path index {i} out of range ({n})")
        return self.buffer[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        text = self.buffer.tobytes()
        offsets = self.offsets.tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            yield text[a:b].decode("utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PathList):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.buffer, other.buffer)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def take(self, indices: np.ndarray) -> PathList:
        starts, lengths = _take_spans(self.offsets, indices)
        return PathList(self.buffer[_gather_index(starts, lengths)], _offsets_of(lengths))

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths, {len(self.buffer)} bytes)"


class LabelRows(Sequence[np.ndarray]):
    """Per-image (n, 5) label arrays as views of one (R, 5) array and an offsets array."""

    def __init__(self, rows: np.ndarray, offsets: np.ndarray):
        self.rows = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, 5)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"label index {i} out of range ({n})")
        view = self.rows[self.offsets[i] : self.offsets[i + 1]]
        view.flags.writeable = False  # a view into the shared table: writing would change every later read
        return view

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def image_of_row(self) -> np.ndarray:
        """(R,) the image index of each row."""
        return np.repeat(np.arange(len(self)), self.counts())


def _offsets_of(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _take_spans(offsets: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, dtype=np.int64)
    return offsets[indices], offsets[indices + 1] - offsets[indices]


def _gather_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the elements of the spans [start, start + length) one after another (no Python loop)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    new_starts = _offsets_of(lengths)[:-1]
    return np.repeat(starts - new_starts, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class LabelTable:
    """Every sample of a split: labels, displayed (w, h) sizes, paths, status and what reading them found.

    ``extra`` holds per-sample arrays a form adds (COCO's image ids; a shard index's offsets) and ``meta``
    per-split facts (COCO's category id of each class); both travel through the cache and through ``take``.
    """

    labels: LabelRows
    shapes: np.ndarray  # int64 (N, 2) displayed (width, height)
    im_files: PathList
    status: np.ndarray  # int8 (N,)
    counts: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    cache_file: str = ""

    def __len__(self) -> int:
        return len(self.status)

    def take(self, indices: np.ndarray) -> Self:
        """The samples ``indices``, in that order, as a new table of flat arrays."""
        indices = np.asarray(indices, dtype=np.int64)
        starts, lengths = _take_spans(self.labels.offsets, indices)
        rows = self.labels.rows[_gather_index(starts, lengths)]
        return replace(
            self,
            labels=LabelRows(rows, _offsets_of(lengths)),
            shapes=self.shapes[indices],
            im_files=self.im_files.take(indices),
            status=self.status[indices],
            extra={k: v[indices] for k, v in self.extra.items()},
        )

    def usable(self) -> Self:
        """The samples that can be trained on (not corrupt)."""
        return self.take(np.nonzero(self.status != CORRUPT)[0])

    def with_single_class(self) -> LabelTable:
        rows = self.labels.rows.copy()
        rows[:, 0] = 0
        return replace(self, labels=LabelRows(rows, self.labels.offsets))

    # ---- as plain arrays (the label cache) ------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {
            "rows": self.labels.rows,
            "row_offsets": self.labels.offsets,
            "shapes": self.shapes.astype(np.int32),
            "paths": self.im_files.buffer,
            "path_offsets": self.im_files.offsets,
            "status": self.status,
            "messages": _join(self.messages),
            "counts_keys": _join(list(self.counts)),
            "counts_values": np.array(list(self.counts.values()), np.int64),
            "meta_keys": _join(list(self.meta)),
        }
        for k, v in self.extra.items():
            arrays[f"extra_{k}"] = v
        for k, v in self.meta.items():
            arrays[f"meta_{k}"] = np.asarray(v)
        return arrays

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> LabelTable:
        keys = _split(a["counts_keys"])
        return cls(
            labels=LabelRows(a["rows"], a["row_offsets"]),
            shapes=a["shapes"].astype(np.int64),
            im_files=PathList(a["paths"], a["path_offsets"]),
            status=a["status"].astype(np.int8),
            counts=dict(zip(keys, (int(v) for v in a["counts_values"]))),
            messages=_split(a["messages"]),
            extra={k[6:]: v for k, v in a.items() if k.startswith("extra_")},
            meta={k: a[f"meta_{k}"].tolist() for k in _split(a["meta_keys"])},
        )


def _join(strings: list[str]) -> np.ndarray:
    return np.frombuffer("\n".join(s.replace("\n", " ") for s in strings).encode("utf-8"), dtype=np.uint8)


def _split(data: np.ndarray) -> list[str]:
    text = data.tobytes().decode("utf-8")
    return text.split("\n") if text else []


class TableBuilder:
    """Collects samples one by one (or chunk by chunk) and makes the LabelTable."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.status: list[int] = []
        self.shapes: list[tuple[int, int]] = []
        self.row_counts: list[int] = []
        self.rows: list[np.ndarray] = []
        self.messages: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, path: str, status: int, shape: tuple[int, int], rows: np.ndarray, message: str = "") -> None:
        rows = np.asarray(rows, np.float32).reshape(-1, 5)
        self.paths.append(path)
        self.status.append(status)
        self.shapes.append(shape)
        self.row_counts.append(len(rows))
        if len(rows):
            self.rows.append(rows)
        if message:
            self.messages.append(message)

    def add_many(
        self,
        paths: list[str],
        status: list[int],
        shapes: list[tuple[int, int]],
        row_counts: list[int],
        rows: np.ndarray,
        messages: list[str],
    ) -> None:
        self.paths += paths
        self.status += status
        self.shapes += shapes
        self.row_counts += row_counts
        if len(rows):
            self.rows.append(np.asarray(rows, np.float32).reshape(-1, 5))
        self.messages += messages

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def build(self, extra: dict[str, np.ndarray] | None = None, meta: dict[str, Any] | None = None) -> LabelTable:
        status = np.array(self.status, dtype=np.int8)
        rows = np.concatenate(self.rows, 0) if self.rows else np.zeros((0, 5), np.float32)
        counts = status_tally(status)
        counts["duplicates"] = self.counts.pop("duplicates", 0)
        counts.update(self.counts)
        return LabelTable(
            labels=LabelRows(rows, _offsets_of(np.array(self.row_counts, np.int64))),
            shapes=np.array(self.shapes, dtype=np.int64).reshape(-1, 2),
            im_files=PathList.from_strings(self.paths),
            status=status,
            counts=counts,
            messages=list(self.messages),
            extra=dict(extra or {}),
            meta=dict(meta or {}),
        )


def status_tally(status: np.ndarray) -> dict[str, int]:
    """How many samples of each status."""
    return {
        name: int((status == code).sum())
        for name, code in (("labelled", LABELLED), ("background", BACKGROUND), ("empty", EMPTY), ("corrupt", CORRUPT))
    }


def log_problems(messages: list[str], prefix: str) -> None:
    """The first MAX_LOGGED_WARNINGS problems found while reading, then how many more there were."""
    for msg in messages[:MAX_LOGGED_WARNINGS]:
        LOGGER.warning(f"{prefix}WARNING {msg}")
    if len(messages) > MAX_LOGGED_WARNINGS:
        LOGGER.warning(f"{prefix}WARNING ... and {len(messages) - MAX_LOGGED_WARNINGS} more problems")


def report(table: LabelTable, prefix: str, verbose: bool, reused: bool, what: str = "images") -> None:
    """Log the problems found and one summary line of the table's counts and where its cache is."""
    if not verbose:
        return
    log_problems(table.messages, prefix)
    c = table.counts
    where = f"{'cache ' if reused else 'cached to '}{table.cache_file}" if table.cache_file else "not cached"
    others = ", ".join(
        f"{v} {k.replace('_', ' ')}"
        for k, v in c.items()
        if k not in ("labelled", "background", "empty", "corrupt", "duplicates") and v
    )
    LOGGER.info(
        f"{prefix}{len(table)} {what}: {c.get('labelled', 0)} labelled, {c.get('background', 0)} backgrounds "
        f"without labels, {c.get('empty', 0)} empty, {c.get('corrupt', 0)} corrupt, "
        f"{c.get('duplicates', 0)} duplicate rows dropped{', ' + others if others else ''} ({where})"
    )
