"""INT8 calibration data from the data YAML's train split, for the formats' INT8 writers (``job.calibration``).

Calibration images come from train, never from val (which only export.py's accuracy gate reads): any split form
the loader reads (folders, lists, COCO JSON, VOC, shards). A tenth of train, chosen by a hash of each image's path
as ``val: 0.1`` is, is held out for accuracy-aware searches (``holdout_map``); the calibration images are the
first ``n`` of the rest in the order of that same hash, so the choice is the same on every run and machine and
does not move when images are added.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from utils.data.splits import FractionSplit
from utils.errors import UserError
from utils.formats.base import Calibration, Runner
from utils.log import LOGGER

HOLDOUT_FRACTION = 0.1  # of train, for accuracy-aware INT8 searches


def path_order(paths: list[str], root: str) -> np.ndarray:
    """Indices of ``paths`` sorted by a hash of each path relative to ``root``: a fixed, content-blind order."""
    keys = []
    for path in paths:
        rel = os.path.relpath(path, root) if os.path.isabs(path) else path
        keys.append(hashlib.blake2b(rel.replace(os.sep, "/").encode("utf-8"), digest_size=8).digest())
    return np.array(sorted(range(len(paths)), key=keys.__getitem__), dtype=np.int64)


def train_parts(data_cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(calibration part, held-out part) of the train split."""
    train = data_cfg.get("train")
    if not train:
        raise UserError(f"{data_cfg.get('yaml_file', 'the data YAML')}: no 'train' split to calibrate INT8 on")
    held_out = FractionSplit(base=train, root=str(data_cfg["path"]), fraction=HOLDOUT_FRACTION, part="val")
    return replace(held_out, part="train"), held_out


def calibration_labels(data_cfg: dict[str, Any], n: int, workers: int = 0) -> Any:
    """The label set of up to ``n`` calibration images (``.im_files``: their paths, for other tools to calibrate on
    the same images)."""
    from utils.data.loader import load_labels

    part, _ = train_parts(data_cfg)
    labels = load_labels(part, nc=int(data_cfg["nc"]), workers=workers, prefix="calibration: ", verbose=False)
    return labels.take(path_order([str(p) for p in labels.im_files], str(data_cfg["path"]))[:n])


def calibration_images(
    data_cfg: dict[str, Any], n: int, imgsz: int, stride: int, workers: int = 0
) -> Iterator[np.ndarray]:
    """Up to ``n`` calibration images, each float32 (1, 3, imgsz, imgsz) RGB in [0, 1], letterboxed as the gate's."""
    from utils.data.loader import create_dataloader

    chosen = calibration_labels(data_cfg, n, workers)
    LOGGER.info(f"INT8 calibration: {len(chosen)} images of the train split (asked for {n})")
    loader, _ = create_dataloader(
        None, imgsz, 1, stride, augment=False, rect=False, workers=workers, nc=int(data_cfg["nc"]), label_set=chosen
    )
    for imgs, _, _, _ in loader:
        yield imgs.numpy().astype(np.float32) / 255


def make_calibration(data_cfg: dict[str, Any], imgsz: int, stride: int, family: Any, workers: int = 0) -> Calibration:
    """The ``Calibration`` export.py hands to INT8 writers."""
    from utils.evaluation.gate import split_map

    def images(n: int) -> Iterator[np.ndarray]:
        return calibration_images(data_cfg, n, imgsz, stride, workers)

    def holdout_map(runner: Runner) -> float:
        _, held_out = train_parts(data_cfg)
        return split_map(runner, family, data_cfg, held_out, imgsz, workers)

    return Calibration(images=images, holdout_map=holdout_map)
