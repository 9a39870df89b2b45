"""Labels as a COCO JSON (``images``, ``annotations``, ``categories``): read straight into a LabelTable.

Each image's ``file_name`` (which may hold subfolders) is looked up in the YAML's ``images`` folder, else where
the layouts in use put it: beside the JSON (Roboflow), or in ``<stem>/`` and ``images/<stem>/`` beside the
annotations folder (COCO, Ultralytics: ``annotations/instances_train2017.json`` -> ``train2017``). Boxes are
COCO's pixel ``[x, y, w, h]`` of the image's ``width``/``height``; a box poking out of its image by at most
``BOX_TOLERANCE`` of the image's side is clipped (and counted), farther out it is skipped; crowd regions
(``iscrowd: 1``) are left out and counted; images without annotations are backgrounds. Classes are the
categories in id order, or the YAML's ``names`` matched by category name. Samples are ordered by image path, as
for label files, so the same set as COCO JSON and as YOLO label files trains identically.

Bad items (an annotation of an unknown image or category, a box without area or far outside its image, an image
listed but missing or corrupt) are one message each naming the JSON and the item; they are skipped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    finite_number,
    is_id,
)
from utils.data.probe_pool import probe_files
from utils.data.splits import CocoSplit
from utils.errors import UserError, excerpt, first_line
from utils.log import LOGGER

BOX_TOLERANCE = 0.02  # of the image's width/height: boxes poking out this far are clipped, farther are skipped
LOOKUP_SAMPLE = 32  # images tried in each candidate folder to pick the one that holds the split


def read_coco_json(path: str | Path) -> dict[str, Any]:
    """The parsed JSON; a one-line UserError when it is unreadable or not COCO detection JSON."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except RecursionError as e:  # arrays or objects nested thousands deep: no COCO file is
        raise UserError(f"{path}: cannot read COCO JSON (nested too deep)") from e
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
        raise UserError(f"{path}: cannot read COCO JSON ({first_line(e)})") from e
    missing = [k for k in ("images", "annotations") if not isinstance(data, dict) or not isinstance(data.get(k), list)]
    if missing:
        raise UserError(f"{path}: not a COCO JSON file (no {' or '.join(repr(k) for k in missing)} list)")
    return data


def _categories(data: dict, path: Path) -> list[tuple[int, str]]:
    categories = data.get("categories") or []
    if not isinstance(categories, list):
        raise UserError(f"{path}: 'categories' is {str(categories)[:40]!r}, not a list")
    out: dict[int, str] = {}
    for c in categories:
        if not isinstance(c, dict) or not is_id(c.get("id")) or "name" not in c:
            raise UserError(f"{path}: category {excerpt(c, 80)} needs an integer 'id' and a 'name'")
        if c["id"] in out:  # a second entry would shift every class after it
            raise UserError(f"{path}: category id {c['id']} is listed twice ({out[c['id']]!r}, {str(c['name'])!r})")
        out[c["id"]] = str(c["name"])
    if not out:
        raise UserError(f"{path}: no 'categories' (needed for class names)")
    return sorted(out.items())


def coco_class_names(path: str | Path) -> list[str]:
    """Class names of a COCO JSON without YAML names: its categories in id order."""
    return [name for _, name in _categories(read_coco_json(path), Path(path))]


def class_of_category(categories: list[tuple[int, str]], names: list[str] | None, path: Path) -> dict[int, int]:
    """category id -> class index: by id order without names, else by name (a category not in names: UserError)."""
    if names is None:
        return {cid: k for k, (cid, _) in enumerate(categories)}
    index = {n: k for k, n in enumerate(names)}
    mapping = {}
    for cid, name in categories:
        if name not in index:
            raise UserError(f"{path}: category {cid} {name!r} is not in the data YAML's names")
        mapping[cid] = index[name]
    return mapping


def image_folders(split: CocoSplit) -> list[Path]:
    """Where the JSON's file names may be, in the order tried."""
    if split.images:
        return [Path(split.images)]
    ann = Path(split.annotations)
    stem = ann.name[: -len(".json")] if ann.name.lower().endswith(".json") else ann.stem
    stems = [stem.split("_", 1)[1]] if "_" in stem.strip("_") else []  # instances_train2017 -> train2017
    stems.append(stem)
    folders = [ann.parent]
    for s in dict.fromkeys(stems):
        folders += [ann.parent.parent / s, ann.parent.parent / "images" / s]
    return list(dict.fromkeys(folders))


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a name no file can have (a component over the system's 255 bytes): such
    an image is then counted as missing, as any other."""
    try:
        return path.is_file()
    except OSError:
        return False


def _choose_folder(folders: list[Path], file_names: list[str], path: Path) -> Path:
    """The candidate folder holding most of a sample of the images; a UserError naming the places tried if none."""
    sample = file_names[:: max(1, len(file_names) // LOOKUP_SAMPLE)][:LOOKUP_SAMPLE]
    found = [sum(_is_file(f / name) for name in sample) for f in folders]
    if max(found) == 0:
        raise UserError(f"{path}: image {sample[0]!r} not found in any of {', '.join(map(str, folders))}")
    return folders[int(np.argmax(found))]


def read_coco_table(
    split: CocoSplit, workers: int = 8, prefix: str = "", verbose: bool = True
) -> tuple[LabelTable, bool]:
    """Every image of the JSON (usable or not) with its labels, from the cache when current; and whether it was.

    ``extra['image_id']`` holds each sample's image id and ``meta['category_ids']`` each class's category id, so
    predictions can be written with the JSON's own ids.
    """
    path = Path(split.annotations)
    folders = image_folders(split)
    names = list(split.names) if split.names is not None else None
    # The JSON names every image: its own size and time decide (an image file that appears later where one was
    # reported missing is found after the JSON is touched or the cache deleted).
    digest = stat_digest(f"coco names={names} tol={BOX_TOLERANCE} folders={[str(f) for f in folders]}", [str(path)])
    return cached_table(
        path.with_suffix(CACHE_SUFFIX), digest, lambda: _build(path, folders, names, workers, prefix, verbose)
    )


def _box_row(bbox: Any, w: float, h: float) -> tuple[tuple[float, ...] | None, str, bool]:
    """(normalised x, y, w, h) or None, why it was skipped, and whether it was clipped."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        return None, f"bbox {bbox!r} is not [x, y, w, h]", False
    values = [finite_number(v) for v in bbox]
    if any(v is None for v in values):
        return None, f"bbox {excerpt(bbox, 80)} is not 4 finite numbers", False
    x, y, bw, bh = (float(v) for v in values if v is not None)
    if bw <= 0 or bh <= 0:
        return None, f"bbox {bbox!r} has no area", False
    tx, ty = BOX_TOLERANCE * w, BOX_TOLERANCE * h
    if x < -tx or y < -ty or x + bw > w + tx or y + bh > h + ty:
        return None, f"bbox {bbox!r} is far outside its {w:g}x{h:g} image", False
    x1, y1, x2, y2 = max(x, 0.0), max(y, 0.0), min(x + bw, w), min(y + bh, h)
    if x2 <= x1 or y2 <= y1:
        return None, f"bbox {bbox!r} has no area inside its image", False
    clipped = (x1, y1, x2, y2) != (x, y, x + bw, y + bh)
    return ((x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h), "", clipped


def _build(
    path: Path, folders: list[Path], names: list[str] | None, workers: int, prefix: str, verbose: bool
) -> LabelTable:
    data = read_coco_json(path)
    categories = _categories(data, path)
    class_of = class_of_category(categories, names, path)
    nc = len(names) if names is not None else len(categories)
    builder = TableBuilder()
    images = _image_entries(data, path, builder)
    folder = _choose_folder(folders, [im["file_name"] for im in images.values()], path)
    boxes = _annotation_rows(data, path, images, class_of, builder)

    unused = [f"{cid} {name!r}" for cid, name in categories if cid not in boxes.used_categories]
    if unused:  # e.g. the placeholder category some exporters add
        LOGGER.info(f"{prefix}{path}: categories without annotations: {', '.join(unused)}")
        builder.count("unused_categories", len(unused))

    entries = sorted(((str(folder / im["file_name"]), im) for im in images.values()), key=lambda e: e[0])
    probes = probe_files(
        [p for p, _ in entries], workers, f"{prefix}Verifying {len(entries)} images", show_progress=verbose
    )
    ids = _add_images(builder, list(zip(entries, probes)), boxes, folders, path)
    category_ids = [cid for cid, _ in categories]
    if names is not None:  # class k's category: the one matched to names[k] (-1 where none is)
        by_class = {k: cid for cid, k in class_of.items()}
        category_ids = [by_class.get(k, -1) for k in range(nc)]
    return builder.build(
        extra={"image_id": np.array(ids, dtype=np.int64)},
        meta={
            "category_ids": np.array(category_ids, dtype=np.int64),
            "annotations": str(path),
            "names": np.array(names if names is not None else [n for _, n in categories]),
        },
    )


def _image_entries(data: dict, path: Path, builder: TableBuilder) -> dict[Any, dict]:
    """The JSON's usable image entries by id; an entry without id or file name is counted and skipped."""
    images: dict[Any, dict] = {}
    for im in data["images"]:
        if not isinstance(im, dict) or "id" not in im or not isinstance(im.get("file_name"), str):
            builder.messages.append(f"{path}: image entry {excerpt(im, 80)} needs 'id' and 'file_name', skipped")
            builder.count("bad_images")
            continue
        if not is_id(im["id"]):
            raise UserError(f"{path}: image id {excerpt(im['id'], 40)} is not an integer in the 64-bit range")
        if im["id"] in images:  # the later entry would hide the earlier image
            raise UserError(f"{path}: image id {im['id']} is listed twice")
        images[im["id"]] = im
    if not images:
        raise UserError(f"{path}: lists no usable images")
    return images


@dataclass
class _ImageBoxes:
    """What the annotations say of each image."""

    rows: dict[int, dict[tuple[float, ...], None]]  # per image id, its label rows (insertion-ordered sets)
    annotated: set[int] = field(default_factory=set)  # images with any annotation, crowd or bad ones included
    used_categories: set[int] = field(default_factory=set)


def _annotation_rows(
    data: dict, path: Path, images: dict[Any, dict], class_of: dict[int, int], builder: TableBuilder
) -> _ImageBoxes:
    """Each image's label rows from the annotations; a bad annotation is reported, counted and skipped."""
    boxes = _ImageBoxes({i: {} for i in images})
    for k, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            builder.messages.append(f"{path}: annotation #{k} is not an object, skipped")
            builder.count("bad_annotations")
            continue
        item = f"annotation {ann['id'] if is_id(ann.get('id')) else '#' + str(k)}"
        why = _annotation_problem(ann)
        if why:
            builder.messages.append(f"{path}: {item}: {why}, skipped")
            builder.count("bad_annotations")
            continue
        image = images.get(ann.get("image_id"))
        if image is None:
            builder.messages.append(f"{path}: {item} has unknown image id {ann.get('image_id')!r}, skipped")
            builder.count("unknown_image_annotations")
            continue
        boxes.annotated.add(image["id"])
        cid = ann.get("category_id")
        if cid not in class_of:
            builder.messages.append(f"{path}: {item} has category id {cid!r} not in 'categories', skipped")
            builder.count("unknown_category_annotations")
            continue
        boxes.used_categories.add(cid)
        if ann.get("iscrowd", 0) == 1:
            builder.count("crowd_annotations_left_out")
            continue
        row = _annotation_row(ann, image, item, class_of[cid], path, builder)
        if row is None:
            continue
        if row in boxes.rows[image["id"]]:
            builder.count("duplicates")
        boxes.rows[image["id"]][row] = None
    return boxes


def _annotation_problem(ann: dict) -> str:
    """Why an annotation's ids or crowd flag cannot be used (``True`` is not image 1, ``"0"`` is not a flag), or ''."""
    for key in ("image_id", "category_id"):
        if key in ann and not is_id(ann[key]):
            return f"{key} {excerpt(ann[key], 40)} is not an integer id"
    crowd = ann.get("iscrowd", 0)
    if isinstance(crowd, bool) or crowd not in (0, 1) or not isinstance(crowd, int):
        return f"iscrowd {str(crowd)[:40]!r} is not 0 or 1"
    return ""


def _annotation_row(
    ann: dict, image: dict, item: str, cls: int, path: Path, builder: TableBuilder
) -> tuple[float, ...] | None:
    """One annotation's label row (class, normalised x, y, w, h), or None when its box or image size is bad."""
    w, h = finite_number(image.get("width")), finite_number(image.get("height"))
    if w is None or h is None or not (0 < w <= MAX_IMAGE_SIDE and 0 < h <= MAX_IMAGE_SIDE):
        size = f"{excerpt(image.get('width'), 20)}x{excerpt(image.get('height'), 20)}"
        builder.messages.append(
            f"{path}: image {image['id']} width/height {size} is not a finite size in (0, {MAX_IMAGE_SIDE}], "
            f"{item} skipped"
        )
        builder.count("bad_boxes")
        return None
    box, why, clipped = _box_row(ann.get("bbox"), w, h)
    if box is None:
        builder.messages.append(f"{path}: {item} of image {image['id']}: {why}, skipped")
        builder.count("bad_boxes")
        return None
    builder.count("clipped_boxes", int(clipped))
    return (float(cls), *box)


def _add_images(
    builder: TableBuilder,
    probed: list[tuple[tuple[str, dict], tuple]],
    boxes: _ImageBoxes,
    folders: list[Path],
    path: Path,
) -> list[int]:
    """Every image, in file order, into the table with its status; returns their image ids."""
    seen: set[str] = set()
    ids = []
    for (file, im), (shape, warning, error) in probed:
        item = f"image {im['id']} {im['file_name']!r}"
        empty = np.zeros((0, 5), np.float32)
        if file in seen:
            builder.add(file, CORRUPT, (0, 0), empty, f"{path}: {item} is listed twice, skipped")
        elif error:
            if not _is_file(Path(file)):
                tried = [str(f / im["file_name"]) for f in folders]
                error = f"listed but missing (tried {', '.join(tried)})"
                builder.count("missing_images")
            builder.add(file, CORRUPT, (0, 0), empty, f"{path}: {item}: {error}, skipped")
        else:
            labels = np.array(list(boxes.rows[im["id"]]), np.float32).reshape(-1, 5)
            status = LABELLED if len(labels) else (EMPTY if im["id"] in boxes.annotated else BACKGROUND)
            builder.add(file, status, shape, labels, f"{file}: {warning}" if warning else "")
        seen.add(file)
        ids.append(im["id"])
    return ids
