"""Labels as YOLO text files: one ``.txt`` per image under ``labels/`` beside ``images/``, rows ``cls x y w h``.

Each image falls in exactly one category: *labelled* (a label file with at least one valid row),
*background* (no label file), *empty* (a label file with no rows) or *corrupt* (unusable image or label
file: skipped). Duplicate rows are dropped and counted separately. The verified split is a LabelTable
(label_table.py), cached by label_cache.py under a digest of the file list, sizes and modification times.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from utils.data.image_files import img2label_path, list_image_files
from utils.data.image_io import ImageError, probe_image
from utils.data.label_cache import CACHE_SUFFIX, cached_table, stat_digest
from utils.data.label_table import (
    BACKGROUND,
    CORRUPT,
    EMPTY,
    LABELLED,
    LabelTable,
    TableBuilder,
    finite_text,
    report,
)
from utils.errors import UserError

COORD_TOLERANCE = 1e-3  # label coordinates this far outside [0, 1] are clipped; farther is an error
MIN_POOL_SIZE = 512  # below this many images a process pool costs more than it saves


class LabelError(ValueError):
    """A label file that cannot be used; the message says which row and why."""


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
            values = [finite_text(v) for v in parts]
        except ValueError as e:  # not a number, or NaN, an infinity or 1e400
            raise LabelError(f"row {line_no}: {e}") from e
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


Chunk = tuple[list[int], list[tuple[int, int]], list[int], np.ndarray, int, list[str], int]


def _verify_chunk(args: tuple[list[str], list[str], int | None]) -> Chunk:
    """verify_pair over a chunk, packed into a few objects: pickling one small array per image is slow."""
    im_files, lb_files, nc = args
    results = [verify_pair(im, lb, nc) for im, lb in zip(im_files, lb_files)]
    labels = [r[2] for r in results if len(r[2])]
    label_errors = sum(r[0] == CORRUPT and r[4].startswith(lb) for r, lb in zip(results, lb_files))
    return (
        [r[0] for r in results],
        [r[1] for r in results],
        [len(r[2]) for r in results],
        np.concatenate(labels, 0) if labels else np.zeros((0, 5), np.float32),
        sum(r[3] for r in results),
        [r[4].replace("\n", " ") for r in results if r[4]],
        label_errors,
    )


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


def scan(
    im_files: list[str],
    label_files: list[str],
    nc: int | None,
    workers: int,
    prefix: str = "",
    show_progress: bool = True,
) -> list[tuple[list[str], Chunk]]:
    """verify_pair for every pair, in a process pool for large sets; (image files, packed chunk) in input order."""
    n = len(im_files)
    workers = max(1, min(workers, os.cpu_count() or 1))
    pooled = n >= MIN_POOL_SIZE and workers > 1
    step = max(16, min(1024, n // (workers * 8))) if pooled else 64
    chunks = [(im_files[i : i + step], label_files[i : i + step], nc) for i in range(0, n, step)]
    bar = tqdm(total=n, desc=f"{prefix}Verifying {n} images", unit="img", disable=not show_progress, leave=False)
    results: list[tuple[list[str], Chunk]] = []
    if pooled:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        with context.Pool(workers) as pool:
            for chunk, part in zip(chunks, pool.imap(_verify_chunk, chunks)):
                results.append((chunk[0], part))
                bar.update(len(part[0]))
    else:
        for chunk in chunks:
            results.append((chunk[0], _verify_chunk(chunk)))
            bar.update(len(chunk[0]))
    bar.close()
    return results


def read_yolo_table(
    im_files: list[str],
    nc: int | None,
    workers: int = 8,
    prefix: str = "",
    source: str | list[str] = "",
    cache_path: Path | None = None,
    verbose: bool = True,
) -> tuple[LabelTable, bool]:
    """Every image of ``im_files`` (usable or not) with its labels, from the cache when current; and whether it was."""
    label_files = [img2label_path(f) for f in im_files]
    if cache_path is None:
        cache_path = cache_path_for(source or str(Path(im_files[0]).parent), label_files)
    digest = stat_digest(f"yolo nc={nc}", (*im_files, *label_files))

    def build() -> LabelTable:
        builder = TableBuilder()
        chunks = scan(im_files, label_files, nc, workers, prefix, show_progress=verbose)
        for chunk_files, (status, shapes, counts, rows, dups, messages, label_errors) in chunks:
            builder.add_many(chunk_files, status, shapes, counts, rows, messages)
            builder.count("duplicates", dups)
            builder.count("label_files_unusable", label_errors)  # of the corrupt ones: the label file, not the image
        return builder.build()

    return cached_table(cache_path, digest, build)


def load_label_set(
    im_files: list[str],
    cache_path: Path | None = None,
    nc: int | None = None,
    workers: int = 8,
    prefix: str = "",
    source: str | list[str] = "",
    verbose: bool = True,
) -> LabelTable:
    """The usable images of ``im_files`` with their labels (corrupt ones dropped); UserError when none is."""
    table, reused = read_yolo_table(im_files, nc, workers, prefix, source, cache_path, verbose)
    report(table, prefix, verbose, reused)
    usable = table.usable()
    if not len(usable):
        where = Path(cache_path).parent if cache_path else Path(img2label_path(im_files[0])).parent
        raise UserError(f"{where}: no usable images among {len(im_files)} listed")
    return usable


def load_split(
    source: str | list[str], nc: int | None = None, workers: int = 8, prefix: str = "", verbose: bool = True
) -> LabelTable:
    """The verified labels of a split's images (a folder, a .txt list or a list of those): ``load_label_set``."""
    return load_label_set(
        list_image_files(source), nc=nc, workers=workers, prefix=prefix, source=source, verbose=verbose
    )
