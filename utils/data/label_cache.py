"""Verify every image/label pair once and cache the result next to the labels.

Each image falls in exactly one category: *labelled* (a label file with at least one valid row),
*background* (no label file), *empty* (a label file with no rows) or *corrupt* (unusable image or label
file: skipped). Duplicate rows are dropped and counted separately.

The cache is an ``.npz`` of plain arrays (never pickled objects, so reading one cannot run code) holding a
format version and a hash of the file list, sizes and modification times; it is reused only when both
match and is always written atomically.
"""
from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from utils.data.config import img2label_path, list_image_files
from utils.errors import UserError
from utils.files import atomic_output
from utils.data.image_io import ImageError, probe_image
from utils.log import LOGGER

CACHE_VERSION = 1
COORD_TOLERANCE = 1e-3  # label coordinates this far outside [0, 1] are clipped; farther is an error
MIN_POOL_SIZE = 512  # below this many images a process pool costs more than it saves
MAX_LOGGED_WARNINGS = 100
CACHE_SUFFIX = ".yolo-train.cache"
FALLBACK_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "yolo-train" / "labels"

# Per-image status codes stored in the cache.
LABELLED, BACKGROUND, EMPTY, CORRUPT = 0, 1, 2, 3


class LabelError(ValueError):
    """A label file that cannot be used; the message says which row and why."""


@dataclass
class LabelSet:
    """The usable images of a dataset with their labels and sizes, plus the verification summary."""

    im_files: list[str]
    label_files: list[str]
    labels: list[np.ndarray]  # float32 (n, 5) [cls, x, y, w, h] normalised
    shapes: np.ndarray  # int (N, 2) displayed (width, height)
    counts: dict[str, int] = field(default_factory=dict)  # labelled, background, empty, corrupt, duplicates
    messages: list[str] = field(default_factory=list)
    cache_file: str = ""


def _polygon_to_box(values: list[float]) -> list[float]:
    """A segment row (cls x1 y1 x2 y2 ...) as its enclosing normalised xywh box."""
    xs, ys = values[1::2], values[2::2]
    x1, x2, y1, y2 = min(xs), max(xs), min(ys), max(ys)
    return [values[0], (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]


def _check_row(values: list[float], line_no: int, nc: int | None) -> tuple[float, ...]:
    """One row validated and with its box edges clipped to the image (pure Python: rows are few and short)."""
    cls, x, y, w, h = values
    if cls != int(cls) or cls < 0 or (nc is not None and cls >= nc):
        raise LabelError(f"row {line_no}: class {cls:g} is not an integer in [0, {nc if nc is not None else 'nc'})")
    if any(v < -COORD_TOLERANCE or v > 1 + COORD_TOLERANCE for v in (x, y, w, h)):
        raise LabelError(f"row {line_no}: coordinates {[x, y, w, h]} outside [0, 1]")
    # Clip the box edges to the image: the visible part of a box that pokes out is the right target.
    x1, x2 = min(max(x - w / 2, 0.0), 1.0), min(max(x + w / 2, 0.0), 1.0)
    y1, y2 = min(max(y - h / 2, 0.0), 1.0), min(max(y + h / 2, 0.0), 1.0)
    if x2 <= x1 or y2 <= y1:
        raise LabelError(f"row {line_no}: width and height must be positive")
    return cls, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1


def parse_label_text(text: str, nc: int | None) -> tuple[np.ndarray, int]:
    """Rows of a label file as float32 (n, 5) and the number of duplicate rows dropped; LabelError if bad.

    Rows are ``cls x y w h`` normalised; YOLOv5 segment rows (cls and 3+ xy points) become their box.
    """
    rows: dict[tuple[float, ...], None] = {}  # insertion-ordered set: drops duplicates, keeps the order
    n_rows = 0
    for line_no, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            values = [float(v) for v in parts]
        except ValueError as e:
            raise LabelError(f"row {line_no}: non-numeric value") from e
        if not all(math.isfinite(v) for v in values):
            raise LabelError(f"row {line_no}: NaN or infinite value")
        if len(values) >= 7 and len(values) % 2 == 1:
            values = _polygon_to_box(values)
        elif len(values) != 5:
            raise LabelError(f"row {line_no}: {len(values)} columns, expected 5 (cls x y w h)")
        rows[_check_row(values, line_no, nc)] = None
        n_rows += 1
    if not rows:
        return np.zeros((0, 5), np.float32), 0
    return np.array(list(rows), dtype=np.float32), n_rows - len(rows)


def verify_pair(im_file: str, lb_file: str, nc: int | None) -> tuple[int, tuple[int, int], np.ndarray, int, str]:
    """Check one image and its label file: (status, (w, h), labels (n, 5), duplicates dropped, warning)."""
    empty = np.zeros((0, 5), np.float32)
    try:
        shape, warning = probe_image(im_file)
    except ImageError as e:
        return CORRUPT, (0, 0), empty, 0, f"{im_file}: corrupt image, skipped ({e})"
    try:
        with open(lb_file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return BACKGROUND, shape, empty, 0, f"{im_file}: {warning}" if warning else ""
    except OSError as e:
        return CORRUPT, (0, 0), empty, 0, f"{lb_file}: unreadable label file, image skipped ({e})"
    try:
        labels, n_dup = parse_label_text(raw.decode("utf-8"), nc)
    except UnicodeDecodeError:
        return CORRUPT, (0, 0), empty, 0, f"{lb_file}: label file is not UTF-8 text, image skipped"
    except LabelError as e:
        return CORRUPT, (0, 0), empty, 0, f"{lb_file}: {e}, image skipped"
    notes = [f"{im_file}: {warning}"] if warning else []
    if n_dup:
        notes.append(f"{lb_file}: {n_dup} duplicate row(s) dropped")
    return (LABELLED if len(labels) else EMPTY), shape, labels, n_dup, "; ".join(notes)


Chunk = tuple[list[int], list[tuple[int, int]], list[int], np.ndarray, int, list[str]]


def _verify_chunk(args: tuple[list[str], list[str], int | None]) -> Chunk:
    """verify_pair over a chunk, packed into a few objects: pickling one small array per image is slow."""
    im_files, lb_files, nc = args
    results = [verify_pair(im, lb, nc) for im, lb in zip(im_files, lb_files)]
    labels = [r[2] for r in results if len(r[2])]
    return ([r[0] for r in results], [r[1] for r in results], [len(r[2]) for r in results],
            np.concatenate(labels, 0) if labels else np.zeros((0, 5), np.float32),
            sum(r[3] for r in results), [r[4].replace("\n", " ") for r in results if r[4]])


def files_hash(im_files: list[str], label_files: list[str], nc: int | None) -> str:
    """Hash of the file paths, sizes and modification times (and nc, which decides what is valid)."""
    h = hashlib.sha256(f"v{CACHE_VERSION} nc={nc}\n".encode())
    for path in (*im_files, *label_files):
        try:
            st = os.stat(path)
            h.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{path}\t-\n".encode())
    return h.hexdigest()


def cache_path_for(source: str | list[str], label_files: list[str]) -> Path:
    """Where the cache of a split lives: ``labels/<split>.yolo-train.cache``, or ``<list>.yolo-train.cache``.

    The name is our own: YOLOv5 keeps a differently formatted ``labels/<split>.cache`` beside it, and users
    switch between the two on one dataset without either rebuilding over the other's file.
    """
    if isinstance(source, str) and source.lower().endswith(".txt") and os.path.isfile(source):
        return Path(source).with_suffix(CACHE_SUFFIX)
    base = Path(label_files[0]).parent
    if isinstance(source, (list, tuple)) and len(source) > 1:
        tag = hashlib.sha256("\n".join(map(str, source)).encode()).hexdigest()[:8]
        return base.with_name(f"{base.name}.{tag}{CACHE_SUFFIX}")
    return base.with_name(base.name + CACHE_SUFFIX)


def fallback_cache_path(primary: Path) -> Path:
    """A user-writable place for the cache of a read-only dataset, keyed by the primary location."""
    key = hashlib.sha256(str(primary.resolve()).encode()).hexdigest()[:16]
    return FALLBACK_CACHE_DIR / f"{primary.name.split('.')[0]}-{key}{CACHE_SUFFIX}"


def _join(strings: list[str]) -> np.ndarray:
    return np.frombuffer("\n".join(strings).encode("utf-8"), dtype=np.uint8)


def status_tally(status: np.ndarray, duplicates: int) -> dict[str, int]:
    """How many items of each verification status, and the duplicate label rows dropped."""
    tally = {name: int((status == code).sum()) for name, code in
             (("labelled", LABELLED), ("background", BACKGROUND), ("empty", EMPTY), ("corrupt", CORRUPT))}
    tally["duplicates"] = duplicates
    return tally


def log_problems(messages: list[str], prefix: str) -> None:
    """The first MAX_LOGGED_WARNINGS problems found while verifying, then how many more there were."""
    for msg in messages[:MAX_LOGGED_WARNINGS]:
        LOGGER.warning(f"{prefix}WARNING {msg}")
    if len(messages) > MAX_LOGGED_WARNINGS:
        LOGGER.warning(f"{prefix}WARNING ... and {len(messages) - MAX_LOGGED_WARNINGS} more problems")


def _split(data: np.ndarray) -> list[str]:
    text = data.tobytes().decode("utf-8")
    return text.split("\n") if text else []


def write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an .npz atomically: a temp file in the same folder, then os.replace (raises OSError)."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def read_cache(path: Path, expected_hash: str) -> dict[str, np.ndarray] | None:
    """The cache's arrays when it is ours, complete, of this version and for these files; else None."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:  # allow_pickle=False: a pickle payload is refused, not run
            arrays = {k: z[k] for k in z.files}
        if int(arrays["version"]) != CACHE_VERSION or str(arrays["hash"]) != expected_hash:
            LOGGER.info(f"{path}: label cache is stale, rebuilding")
            return None
        return arrays
    except Exception as e:  # any damage (truncated zip, foreign format, missing keys) means rebuild
        LOGGER.info(f"{path}: label cache unreadable ({type(e).__name__}), rebuilding")
        return None


def scan(im_files: list[str], label_files: list[str], nc: int | None, workers: int, prefix: str = "",
         show_progress: bool = True) -> list[Chunk]:
    """verify_pair for every pair, in a process pool for large sets; packed chunks in input order."""
    n = len(im_files)
    workers = max(1, min(workers, os.cpu_count() or 1))
    pooled = n >= MIN_POOL_SIZE and workers > 1
    step = max(16, min(1024, n // (workers * 8))) if pooled else 64
    chunks = [(im_files[i : i + step], label_files[i : i + step], nc) for i in range(0, n, step)]
    bar = tqdm(total=n, desc=f"{prefix}Verifying {n} images", unit="img", disable=not show_progress, leave=False)
    results: list[Chunk] = []
    if pooled:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        with context.Pool(workers) as pool:
            for part in pool.imap(_verify_chunk, chunks):
                results.append(part)
                bar.update(len(part[0]))
    else:
        for chunk in chunks:
            results.append(_verify_chunk(chunk))
            bar.update(len(chunk[0]))
    bar.close()
    return results


def _build_arrays(chunks: list[Chunk], file_hash: str, im_files: list[str]) -> dict[str, np.ndarray]:
    status = np.array([s for c in chunks for s in c[0]], dtype=np.int8)
    shapes = np.array([wh for c in chunks for wh in c[1]], dtype=np.int32).reshape(-1, 2)
    counts = np.array([k for c in chunks for k in c[2]], dtype=np.int32)
    labels = np.concatenate([c[3] for c in chunks], 0) if chunks else np.zeros((0, 5), np.float32)
    return {
        "version": np.array(CACHE_VERSION),
        "hash": np.array(file_hash),
        "im_files": _join(im_files),
        "status": status,
        "shapes": shapes,
        "counts": counts,
        "labels": labels.astype(np.float32).reshape(-1, 5),
        "duplicates": np.array(sum(c[4] for c in chunks), dtype=np.int64),
        "messages": _join([m for c in chunks for m in c[5]]),
    }


def _store(arrays: dict[str, np.ndarray], primary: Path) -> Path | None:
    for path in (primary, fallback_cache_path(primary)):
        try:
            write_cache(path, arrays)
            return path
        except OSError as e:
            LOGGER.warning(f"{path}: cannot write label cache ({e})")
    return None


def _load_or_build(im_files: list[str], label_files: list[str], cache_path: Path, nc: int | None,
                   workers: int, prefix: str, verbose: bool) -> tuple[dict[str, np.ndarray], Path | None, bool]:
    file_hash = files_hash(im_files, label_files, nc)
    for path in (cache_path, fallback_cache_path(cache_path)):
        arrays = read_cache(path, file_hash)
        if arrays is not None:
            return arrays, path, True
    results = scan(im_files, label_files, nc, workers, prefix, show_progress=verbose)
    arrays = _build_arrays(results, file_hash, im_files)
    return arrays, _store(arrays, cache_path), False


def load_split(source: str | list[str], nc: int | None = None, workers: int = 8, prefix: str = "",
               verbose: bool = True) -> LabelSet:
    """The verified labels of a split's images (a folder, a .txt list or a list of those): ``load_label_set``."""
    return load_label_set(list_image_files(source), nc=nc, workers=workers, prefix=prefix, source=source,
                          verbose=verbose)


def load_label_set(im_files: list[str], cache_path: Path | None = None, nc: int | None = None, workers: int = 8,
                   prefix: str = "", source: str | list[str] = "", verbose: bool = True) -> LabelSet:
    """Verified labels of ``im_files``, from the cache when it is current, else verified and cached.

    In a distributed run call it on local rank 0 first (``torch_distributed_zero_first``), so that one process
    per machine builds the cache and the others read it. Raises UserError when no image is usable.
    """
    label_files = [img2label_path(f) for f in im_files]
    if cache_path is None:
        cache_path = cache_path_for(source or str(Path(im_files[0]).parent), label_files)
    arrays, stored_at, reused = _load_or_build(im_files, label_files, cache_path, nc, workers, prefix, verbose)

    status, shapes, counts = arrays["status"], arrays["shapes"], arrays["counts"]
    per_image = np.split(arrays["labels"], np.cumsum(counts)[:-1]) if len(counts) else []
    keep = np.nonzero(status != CORRUPT)[0]
    tally = status_tally(status, int(arrays["duplicates"]))
    messages = _split(arrays["messages"])

    if verbose:
        log_problems(messages, prefix)
        where = f"{'cache ' if reused else 'cached to '}{stored_at}" if stored_at else "not cached"
        LOGGER.info(
            f"{prefix}{len(im_files)} images: {tally['labelled']} labelled, {tally['background']} backgrounds "
            f"without label file, {tally['empty']} empty, {tally['corrupt']} corrupt, "
            f"{tally['duplicates']} duplicate rows dropped ({where})"
        )
    if not len(keep):
        raise UserError(f"{cache_path.parent}: no usable images among {len(im_files)} listed")
    return LabelSet(
        im_files=[im_files[i] for i in keep],
        label_files=[label_files[i] for i in keep],
        labels=[per_image[i].copy() for i in keep],
        shapes=shapes[keep].astype(np.int64),
        counts=tally,
        messages=messages,
        cache_file=str(stored_at or ""),
    )
