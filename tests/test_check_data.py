"""check_data.py on generated sets with known problems: counts, leaks naming both files, thresholds, --strict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np

import check_data


def _image(path: Path, seed: int, h: int = 40, w: int = 40) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _label(root: Path, split: str, stem: str, text: str) -> None:
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split / f"{stem}.txt").write_text(text)


def make_broken_set(root: Path) -> Path:
    for i in range(6):
        _image(root / "images" / "train" / f"t{i}.png", i)
        _label(root, "train", f"t{i}", "0 0.5 0.5 0.5 0.5\n" + ("1 0.5 0.5 0.4 0.3\n" if i < 2 else ""))
    _label(root, "train", "t3", "0 0.5 0.5 0.01 0.5\n")  # 0.4 px wide at imgsz 40... and aspect 50
    shutil.copy(root / "images" / "train" / "t1.png", root / "images" / "train" / "copy_of_t1.png")  # within
    _image(root / "images" / "train" / "bg.png", 50)  # background
    (root / "images" / "train" / "broken.png").write_bytes(b"not a png")  # corrupt
    _image(root / "images" / "train" / "badrow.png", 51)
    _label(root, "train", "badrow", "5 0.5 0.5 0.2 0.2\n")  # class out of range: label error
    for i in range(3):
        _image(root / "images" / "val" / f"v{i}.png", 100 + i)
        _label(root, "val", f"v{i}", "1 0.5 0.5 0.5 0.5\n")
    shutil.copy(root / "images" / "train" / "t4.png", root / "images" / "val" / "leak.png")  # across splits
    yaml_file = root / "data.yaml"
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: [a, b, c]\n")
    return yaml_file


def test_check_data_reports_problems_and_leaks(tmp_path: Path, capsys) -> None:
    yaml_file = make_broken_set(tmp_path)
    args = ["--data", str(yaml_file), "--imgsz", "40", "--save-dir", str(tmp_path / "out"), "--workers", "1"]
    assert check_data.main(args) == 0  # a report, not a verdict, without --strict
    out = capsys.readouterr().out
    assert (
        "train: 8 images (2 backgrounds), 8 instances; 1 corrupt images, 1 label errors, 1 tiny boxes, "
        "1 extreme aspect ratios" in out
    )
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "a: 6 instances in 6 images" in lines and "b: 2 instances in 2 images" in lines
    assert "c: 0 instances in 0 images" in lines and "WARNING classes without instances in train: c" in lines
    assert (
        f"duplicate in train: {tmp_path}/images/train/t1.png has the same bytes as "
        f"{tmp_path}/images/train/copy_of_t1.png" in out
    )
    assert (
        f"LEAK val image {tmp_path}/images/val/leak.png is a copy of train image {tmp_path}/images/train/t4.png" in out
    )
    assert "broken.png" in out and "badrow.txt" in out  # the corrupt image and the bad row, named
    assert (tmp_path / "out" / "labels.jpg").is_file()
    assert check_data.main([*args, "--strict", "--noplots"]) == 1
    capsys.readouterr()
    assert (
        check_data.main([*args, "--noplots", "--min-box-px", "0.1", "--max-aspect", "60", "--max-imbalance", "1.5"])
        == 0
    )
    out = capsys.readouterr().out
    assert "0 tiny boxes, 0 extreme aspect ratios" in out and "class imbalance > 1.5x" in out
    assert "WARNING class imbalance in train: 3.0x" in out


def test_check_data_reads_coco_json_and_passes_a_clean_set_strictly(tmp_path: Path, capsys) -> None:
    images = []
    for i in range(3):
        _image(tmp_path / "train" / f"{i}.jpg", i)
        images.append({"id": i + 1, "file_name": f"{i}.jpg", "width": 40, "height": 40})
    anns = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 5, 20, 20]},
        {"id": 2, "image_id": 2, "category_id": 9, "bbox": [5, 5, 20, 20]},
    ]  # unknown category: label error
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_train.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]})
    )
    _image(tmp_path / "val" / "v.jpg", 9)
    yaml_file = tmp_path / "coco.yaml"
    yaml_file.write_text(f"path: {tmp_path}\ntrain: annotations/instances_train.json\nval: val\n")
    args = ["--data", str(yaml_file), "--save-dir", str(tmp_path / "out"), "--strict", "--noplots"]
    assert check_data.main(args) == 1
    out = capsys.readouterr().out
    assert "train: 3 images (2 backgrounds), 1 instances; 0 corrupt images, 1 label errors" in out
    assert "annotation 2 has category id 9 not in 'categories'" in out
    anns.pop()
    (tmp_path / "annotations" / "instances_train.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]})
    )
    assert check_data.main(args) == 0


def test_check_data_names_labels_without_images_and_classes_only_val_has(tmp_path: Path, capsys) -> None:
    for i in range(2):
        _image(tmp_path / "images" / "train" / f"t{i}.png", i)
        _label(tmp_path, "train", f"t{i}", "0 0.5 0.5 0.5 0.5\n")
    _label(tmp_path, "train", "gone", "0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n")  # its image was removed
    _image(tmp_path / "images" / "val" / "v0.png", 9)
    _label(tmp_path, "val", "v0", "0 0.5 0.5 0.5 0.5\n2 0.5 0.5 0.2 0.2\n")  # class c: never in train
    yaml_file = tmp_path / "data.yaml"
    yaml_file.write_text(f"path: {tmp_path}\ntrain: images/train\nval: images/val\nnames: [a, b, c]\n")
    assert check_data.main(["--data", str(yaml_file), "--workers", "0", "--noplots"]) == 0
    out = capsys.readouterr().out
    gone = tmp_path / "labels" / "train" / "gone.txt"
    assert f"  1 label files without an image (2 boxes never trained):\n    {gone}\n" in out
    assert out.count("label files without an image") == 1  # val's folder has none
    assert "WARNING classes in val that train never shows (the model cannot learn them): c\n" in out
