"""A dataset's health without training: counts, problems and leaks of every split, whatever its form.

Each split is read through labels.py (label files, COCO JSON, VOC, shards; caches are used and built as in
training), then measured: images and instances per class, backgrounds, corrupt files and label errors (what the
readers skipped and counted), boxes smaller than ``min_box_px`` pixels at ``imgsz``, boxes more elongated than
``max_aspect``, class imbalance beyond ``max_imbalance`` (most to fewest instances of classes in use, and classes
without any, and classes val has that train never shows), duplicate images (same bytes) within a split and
across splits, naming both files, and label files that no image of the split has (their boxes vanish unnamed).
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from utils.data.image_files import orphan_label_files
from utils.data.label_table import CORRUPT, LabelTable
from utils.data.labels import read_table

# Counts the readers keep of label problems (besides whole files skipped as corrupt).
LABEL_ERROR_KEYS = (
    "label_files_unusable",
    "bad_boxes",
    "bad_annotations",
    "bad_images",
    "unknown_image_annotations",
    "unknown_category_annotations",
    "unknown_class_objects",
    "missing_images",
    "ids_outside_dataset",
)


@dataclass
class Thresholds:
    imgsz: int = 640
    min_box_px: float = 3.0  # a box narrower or lower than this many pixels at imgsz is "tiny"
    max_aspect: float = 20.0  # width/height (or height/width) beyond this is "extreme"
    max_imbalance: float = 50.0  # instances of the most common class over the least common (in use) one


@dataclass
class SplitHealth:
    name: str
    table: LabelTable
    instances: np.ndarray  # per class
    images_with: np.ndarray  # per class: images holding at least one instance
    backgrounds: int
    corrupt: int  # images that cannot be used (missing or undecodable)
    label_errors: int
    tiny_boxes: int
    extreme_aspect: int
    problems: list[str] = field(default_factory=list)
    orphan_labels: list[str] = field(default_factory=list)  # label files of this split's folders without an image


@dataclass
class Health:
    splits: list[SplitHealth]
    duplicates_within: list[tuple[str, str, str]]  # (split, file, copy of it)
    leaks: list[tuple[str, str, str, str]]  # (split a, file a, split b, file b)
    imbalance: float
    missing_classes: list[int]
    thresholds: Thresholds
    val_only_classes: list[int] = field(default_factory=list)  # classes val has and train never shows

    @property
    def failed(self) -> bool:
        """What ``--strict`` refuses: leaks across splits, corrupt files, label errors."""
        return bool(self.leaks) or any(s.corrupt or s.label_errors for s in self.splits)


def image_bytes(table: LabelTable, i: int) -> bytes:
    """The encoded bytes of sample ``i``: its file, or its member of a tar shard."""
    if "offset" in table.extra:
        url = str(table.meta["urls"][int(table.extra["shard"][i])])
        with open(url, "rb") as f:
            return os.pread(f.fileno(), int(table.extra["size"][i]), int(table.extra["offset"][i]))
    with open(table.im_files[i], "rb") as f:
        return f.read()


def _digests(table: LabelTable) -> dict[str, list[int]]:
    """sha256 of the bytes -> indices of the usable samples holding them."""
    out: dict[str, list[int]] = defaultdict(list)
    for i in np.nonzero(table.status != CORRUPT)[0]:
        try:
            out[hashlib.sha256(image_bytes(table, int(i))).hexdigest()].append(int(i))
        except OSError:
            continue  # counted as corrupt by the reader already, or gone since
    return out


def split_health(name: str, table: LabelTable, nc: int, t: Thresholds) -> SplitHealth:
    usable = table.status != CORRUPT
    rows = table.labels.rows
    image_of_row = table.labels.image_of_row()
    rows, image_of_row = rows[usable[image_of_row]], image_of_row[usable[image_of_row]]
    cls = rows[:, 0].astype(np.int64)
    instances = np.bincount(cls, minlength=nc)[: max(nc, 0)] if len(cls) else np.zeros(nc, np.int64)
    pairs = np.unique(np.stack([image_of_row, cls], 1), axis=0) if len(cls) else np.zeros((0, 2), np.int64)
    images_with = np.bincount(pairs[:, 1], minlength=nc)[:nc] if len(pairs) else np.zeros(nc, np.int64)
    wh = table.shapes[image_of_row].astype(np.float64)
    scale = t.imgsz / np.maximum(wh.max(1), 1)
    box_w, box_h = rows[:, 3] * wh[:, 0] * scale, rows[:, 4] * wh[:, 1] * scale
    aspect = np.maximum(box_w / np.maximum(box_h, 1e-9), box_h / np.maximum(box_w, 1e-9))
    counts = table.counts
    return SplitHealth(
        name=name,
        table=table,
        instances=instances,
        images_with=images_with,
        backgrounds=int(counts.get("background", 0) + counts.get("empty", 0)),
        corrupt=int(counts.get("corrupt", 0) - counts.get("label_files_unusable", 0)),
        label_errors=int(sum(counts.get(k, 0) for k in LABEL_ERROR_KEYS)),
        tiny_boxes=int(((box_w < t.min_box_px) | (box_h < t.min_box_px)).sum()),
        extreme_aspect=int((aspect > t.max_aspect).sum()),
        problems=list(table.messages),
    )


def check_dataset(config: dict, t: Thresholds, workers: int = 8) -> Health:
    """Every split of a loaded data config (``load_data_config``) measured, and duplicates found."""
    nc = int(config["nc"])
    splits = [
        split_health(key, read_table(config[key], nc=nc, workers=workers, verbose=False)[0], nc, t)
        for key in ("train", "val", "test")
        if config.get(key) is not None
    ]
    within: list[tuple[str, str, str]] = []
    leaks: list[tuple[str, str, str, str]] = []
    first_seen: dict[str, tuple[str, str]] = {}  # digest -> (split, file) where it was met first
    for s in splits:
        for digest, indices in _digests(s.table).items():
            files = [s.table.im_files[i] for i in indices]
            within += [(s.name, files[0], f) for f in files[1:]]
            if digest in first_seen and first_seen[digest][0] != s.name:
                leaks += [(*first_seen[digest], s.name, f) for f in files]
            first_seen.setdefault(digest, (s.name, files[0]))
    for s in splits:
        if isinstance(config[s.name], (str, list)):  # images with label files beside them (not JSON, XML, shards)
            s.orphan_labels = orphan_label_files(list(s.table.im_files))
    train = splits[0].instances
    in_use = train[train > 0]
    imbalance = float(in_use.max() / in_use.min()) if len(in_use) else 0.0
    val = next((s.instances for s in splits if s.name == "val"), np.zeros_like(train))
    val_only = [int(k) for k in np.nonzero((train == 0) & (val > 0))[0]]
    return Health(splits, within, leaks, imbalance, [int(k) for k in np.nonzero(train == 0)[0]], t, val_only)


def _class_name(names: list[str], k: int) -> str:
    return names[k] if k < len(names) else str(k)


def _orphan_lines(s: SplitHealth, max_listed: int) -> list[str]:
    """The label files of a split that have no image, named, with the boxes they hold (never trained)."""
    if not s.orphan_labels:
        return []
    boxes = 0
    for path in s.orphan_labels:
        try:
            with open(path, encoding="utf-8") as f:
                boxes += sum(1 for line in f if line.strip())
        except (OSError, UnicodeDecodeError):
            continue  # named all the same; its boxes cannot be counted
    out = [f"  {len(s.orphan_labels)} label files without an image ({boxes} boxes never trained):"]
    out += [f"    {p}" for p in s.orphan_labels[:max_listed]]
    if len(s.orphan_labels) > max_listed:
        out.append(f"    ... and {len(s.orphan_labels) - max_listed} more")
    return out


def report_lines(health: Health, names: list[str], max_listed: int = 20) -> list[str]:
    """The report as text lines."""
    t = health.thresholds
    out = [
        f"thresholds: tiny box < {t.min_box_px:g} px at --imgsz {t.imgsz}, extreme aspect ratio > "
        f"{t.max_aspect:g}, class imbalance > {t.max_imbalance:g}x (set with --min-box-px, --max-aspect, "
        "--max-imbalance)"
    ]
    for s in health.splits:
        n = int((s.table.status != CORRUPT).sum())
        out.append(
            f"{s.name}: {n} images ({s.backgrounds} backgrounds), {int(s.instances.sum())} "
            f"instances; {s.corrupt} corrupt images, {s.label_errors} label errors, {s.tiny_boxes} tiny boxes, "
            f"{s.extreme_aspect} extreme aspect ratios"
        )
        for k, name in enumerate(names):
            out.append(f"  {name:>20}: {int(s.instances[k]):>8} instances in {int(s.images_with[k]):>7} images")
        for msg in s.problems[:max_listed]:
            out.append(f"  problem: {msg}")
        if len(s.problems) > max_listed:
            out.append(f"  ... and {len(s.problems) - max_listed} more problems")
        out += _orphan_lines(s, max_listed)
    if health.imbalance > t.max_imbalance:
        out.append(
            f"WARNING class imbalance in train: {health.imbalance:.1f}x between the most and least common "
            f"classes (threshold {t.max_imbalance:g}x)"
        )
    if health.val_only_classes:
        out.append(
            "WARNING classes in val that train never shows (the model cannot learn them): "
            f"{', '.join(_class_name(names, k) for k in health.val_only_classes)}"
        )
    if health.missing_classes:
        out.append(
            f"WARNING classes without instances in train: "
            f"{', '.join(names[k] if k < len(names) else str(k) for k in health.missing_classes)}"
        )
    for split, a, b in health.duplicates_within[:max_listed]:
        out.append(f"duplicate in {split}: {b} has the same bytes as {a}")
    if len(health.duplicates_within) > max_listed:
        out.append(f"... and {len(health.duplicates_within) - max_listed} more duplicates within splits")
    for sa, a, sb, b in health.leaks[:max_listed]:
        out.append(f"LEAK {sb} image {b} is a copy of {sa} image {a}")
    if len(health.leaks) > max_listed:
        out.append(f"... and {len(health.leaks) - max_listed} more leaks across splits")
    out.append(f"{len(health.duplicates_within)} duplicates within splits, {len(health.leaks)} across splits")
    return out
