"""`val: 0.1`: a deterministic part of train by a hash of each image's path relative to the dataset root."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np

from utils.data.config import load_data_config
from utils.data.labels import fraction_mask, load_labels


def test_fraction_is_stable_when_images_are_added_or_the_folder_moves() -> None:
    old = [f"/data/a/images/train/{i:05d}.jpg" for i in range(2000)]
    mask = fraction_mask(old, "/data/a", 0.1)
    assert 150 < mask.sum() < 250  # about a tenth
    grown = old + [f"/data/a/images/train/new_{i}.jpg" for i in range(500)]
    assert np.array_equal(fraction_mask(grown, "/data/a", 0.1)[:2000], mask)  # old images stay where they were
    moved = [p.replace("/data/a/", "/mnt/elsewhere/b/") for p in old]
    assert np.array_equal(fraction_mask(moved, "/mnt/elsewhere/b", 0.1), mask)
    assert np.array_equal(fraction_mask(old, "/data/a", 0.1), mask)  # and the same on every call
    assert (fraction_mask(old, "/data/a", 0.2) >= mask).all()  # a larger fraction only adds images


def _dataset(root: Path, n: int) -> Path:
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    for i in range(n):
        cv2.imwrite(str(root / "images" / "train" / f"{i:03d}.png"), np.full((16, 16, 3), i, np.uint8))
        (root / "labels" / "train" / f"{i:03d}.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    yaml_file = root / "data.yaml"
    yaml_file.write_text("path: .\ntrain: images/train\nval: 0.25\nnames: [a]\n")
    return yaml_file


def test_val_fraction_split_never_overlaps_train(tmp_path: Path) -> None:
    cfg = load_data_config(_dataset(tmp_path / "a", 40))
    train_table, val_table = load_labels(cfg["train"], verbose=False), load_labels(cfg["val"], verbose=False)
    train, val = set(train_table.im_files), set(val_table.im_files)
    assert train.isdisjoint(val) and len(train | val) == 40 and 3 <= len(val) <= 20
    assert val_table.counts["labelled"] == len(val) and train_table.counts["labelled"] == len(train)
    shutil.move(tmp_path / "a", tmp_path / "b")  # the same dataset elsewhere: the same images in val
    cfg = load_data_config(tmp_path / "b" / "data.yaml")
    moved = {Path(f).name for f in load_labels(cfg["val"], verbose=False).im_files}
    assert moved == {Path(f).name for f in val}
