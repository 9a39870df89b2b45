"""Labels as Pascal VOC XML: ``Annotations/<id>.xml`` with ``JPEGImages/<id>.jpg``, the ids listed by
``ImageSets/Main/<set>.txt``; read straight into a LabelTable.

As YOLOv5's VOC conversion does, ``difficult`` objects are left out (counted, and said so in the log) and VOC's
1-based pixel corners become ``x = ((xmin + xmax) / 2 - 1) / width``, ``y = ((ymin + ymax) / 2 - 1) / height``,
``w = (xmax - xmin) / width``, ``h = (ymax - ymin) / height``. Classes are the YAML's ``names``, else the sorted
set of object names found. Samples are ordered by image path.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from utils.data.label_cache import CACHE_SUFFIX, cached_table, stat_digest
from utils.data.label_table import (
    BACKGROUND,
    CORRUPT,
    EMPTY,
    LABELLED,
    MAX_IMAGE_SIDE,
    LabelTable,
    TableBuilder,
    finite_text,
)
from utils.data.probe_pool import probe_files
from utils.data.splits import VocSplit
from utils.errors import UserError
from utils.log import LOGGER
from utils.safe_paths import relative_inside

COORD_TOLERANCE = 1e-3  # normalised: corners this far outside the image are clipped, farther is an error


def image_ids(root: Path, image_set: str) -> tuple[list[str], list[str]]:
    """The ids listed by ``ImageSets/Main/<image_set>.txt`` (first column; VOC's per-class lists add a second),
    and a line for each id refused: one naming a file outside the VOC folder (absolute, or climbing out with
    ``..``) is never opened."""
    path = root / "ImageSets" / "Main" / f"{image_set}.txt"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read VOC image set ({e})") from e
    ids, refused = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        i = line.split()[0]
        if relative_inside(root / "JPEGImages", i) is None:
            refused.append(f"{path}: line {n}: id {i[:80]!r} names a file outside {root}, skipped")
        else:
            ids.append(i)
    return ids, refused


def _objects(xml_file: Path) -> tuple[tuple[float, float], list[tuple[str, bool, tuple[float, ...]]]]:
    """(width, height) and the (name, difficult, (xmin, xmax, ymin, ymax)) of each object; raises ValueError."""
    try:
        root = ET.parse(xml_file).getroot()
    except (ET.ParseError, OSError) as e:
        raise ValueError(f"unreadable XML ({e})") from e
    size = root.find("size")
    if size is None:
        raise ValueError("no <size>")
    w, h = _size_side(size, "width"), _size_side(size, "height")
    objects = []
    for k, obj in enumerate(root.iter("object"), 1):
        name = (obj.findtext("name") or "").strip()
        box = obj.find("bndbox")
        if not name or box is None:
            raise ValueError(f"object {k} needs <name> and <bndbox>")
        try:
            corners = tuple(finite_text(box.findtext(t) or "") for t in ("xmin", "xmax", "ymin", "ymax"))
        except ValueError as e:  # missing, not a number, NaN, an infinity or 1e400
            raise ValueError(f"object {k}: <bndbox> {e}") from e
        objects.append((name, (obj.findtext("difficult") or "0").strip() == "1", corners))
    return (w, h), objects


def _size_side(size: ET.Element, tag: str) -> float:
    """<size>'s width or height; 0 when absent or 0 (the image's own is used), ValueError when not a finite size."""
    text = size.findtext(tag)
    if text is None or not text.strip():
        return 0.0
    try:
        side = finite_text(text)
    except ValueError as e:
        raise ValueError(f"<size> <{tag}> {e}") from e
    if not 0 <= side <= MAX_IMAGE_SIDE:
        raise ValueError(f"<size> <{tag}> {side:g} is not in [0, {MAX_IMAGE_SIDE}]")
    return side


def voc_class_names(split: VocSplit) -> list[str]:
    """The sorted set of object names in the split's XML files (classes when the YAML gives no names)."""
    found: set[str] = set()
    for root in map(Path, split.roots):
        for i in image_ids(root, split.image_set)[0]:
            try:
                found.update(name for name, _, _ in _objects(root / "Annotations" / f"{i}.xml")[1])
            except ValueError:
                continue  # reported when the split is read
    return sorted(found)


def voc_row(cls: int, corners: tuple[float, ...], w: float, h: float) -> tuple[float, ...] | None:
    """YOLOv5's VOC conversion of one box, clipped to the image; None when outside or without area."""
    xmin, xmax, ymin, ymax = corners
    x, y = ((xmin + xmax) / 2 - 1) / w, ((ymin + ymax) / 2 - 1) / h
    bw, bh = (xmax - xmin) / w, (ymax - ymin) / h
    if not all(math.isfinite(v) for v in (x, y, bw, bh)) or bw <= 0 or bh <= 0:
        return None
    x1, x2, y1, y2 = x - bw / 2, x + bw / 2, y - bh / 2, y + bh / 2
    if min(x1, y1) < -COORD_TOLERANCE or max(x2, y2) > 1 + COORD_TOLERANCE:
        return None
    x1, x2, y1, y2 = max(x1, 0.0), min(x2, 1.0), max(y1, 0.0), min(y2, 1.0)
    return float(cls), (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1


def read_voc_table(
    split: VocSplit, root: Path, workers: int = 8, prefix: str = "", verbose: bool = True
) -> tuple[LabelTable, bool]:
    """Every image of one VOC folder's image set (usable or not), from the cache when current; and whether it was."""
    ids, refused = image_ids(root, split.image_set)
    xmls = [str(root / "Annotations" / f"{i}.xml") for i in ids]
    set_file = root / "ImageSets" / "Main" / f"{split.image_set}.txt"
    digest = stat_digest(f"voc names={list(split.names)}", [str(set_file), str(root / "JPEGImages"), *xmls])
    return cached_table(
        set_file.with_suffix(CACHE_SUFFIX),
        digest,
        lambda: _build(root, ids, refused, list(split.names), workers, prefix, verbose),
    )


def _build(
    root: Path, ids: list[str], refused: list[str], names: list[str], workers: int, prefix: str, verbose: bool
) -> LabelTable:
    class_index = {n: k for k, n in enumerate(names)}
    builder = TableBuilder()
    builder.messages += refused
    if refused:
        builder.count("ids_outside_dataset", len(refused))
    files = sorted((str(root / "JPEGImages" / f"{i}.jpg"), i) for i in dict.fromkeys(ids))
    probes = probe_files(
        [f for f, _ in files], workers, f"{prefix}Verifying {len(files)} images", show_progress=verbose
    )
    empty = np.zeros((0, 5), np.float32)
    for (file, i), (shape, warning, error) in zip(files, probes):
        xml = root / "Annotations" / f"{i}.xml"
        if error:
            why = "listed but missing" if not Path(file).is_file() else error
            builder.add(file, CORRUPT, (0, 0), empty, f"{root}: image {i} ({file}): {why}, skipped")
            continue
        if not xml.is_file():
            builder.add(file, BACKGROUND, shape, empty)
            continue
        try:
            (w, h), objects = _objects(xml)
        except ValueError as e:
            builder.add(file, CORRUPT, (0, 0), empty, f"{xml}: {e}, image skipped")
            builder.count("label_files_unusable")  # the image is fine, its labels are not: a label error
            continue
        if not (w > 0 and h > 0):
            w, h = float(shape[0]), float(shape[1])  # VOC's <size> missing or zero: the image's own
        rows: dict[tuple[float, ...], None] = {}
        for k, (name, difficult, corners) in enumerate(objects, 1):
            if difficult:
                builder.count("difficult_left_out")
                continue
            if name not in class_index:
                builder.messages.append(f"{xml}: object {k} {name!r} is not in the data YAML's names, skipped")
                builder.count("unknown_class_objects")
                continue
            row = voc_row(class_index[name], corners, w, h)
            if row is None:
                builder.messages.append(f"{xml}: object {k} box {corners} is outside the image or has no area, skipped")
                builder.count("bad_boxes")
                continue
            if row in rows:
                builder.count("duplicates")
            rows[row] = None
        labels = np.array(list(rows), np.float32).reshape(-1, 5)
        status = LABELLED if len(labels) else (EMPTY if objects else BACKGROUND)
        builder.add(file, status, shape, labels, f"{file}: {warning}" if warning else "")
    if builder.counts.get("difficult_left_out"):
        LOGGER.info(
            f"{prefix}{root}: {builder.counts['difficult_left_out']} 'difficult' objects left out, as "
            "YOLOv5's VOC conversion does"
        )
    return builder.build()
