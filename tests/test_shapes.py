"""The built-in shapes dataset: deterministic, valid labels, generated once and atomically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from utils.data.config import load_data_config
from utils.data.shapes import SHAPE_NAMES, ensure_shapes_dataset, generate_shapes
from utils.data.yolo_labels import parse_label_text


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_is_deterministic_and_labels_valid(tmp_path: Path) -> None:
    a = _contents(generate_shapes(tmp_path / "a", n_train=6, n_val=2, imgsz=96, seed=1))
    b = _contents(generate_shapes(tmp_path / "b", n_train=6, n_val=2, imgsz=96, seed=1))
    c = _contents(generate_shapes(tmp_path / "c", n_train=6, n_val=2, imgsz=96, seed=2))
    assert a == b and a != c
    assert sum(k.startswith("images/train/") for k in a) == 6 and sum(k.startswith("labels/val/") for k in a) == 2
    all_labels = np.concatenate(
        [parse_label_text(v.decode(), len(SHAPE_NAMES))[0] for k, v in a.items() if k.endswith(".txt")]
    )
    assert len(all_labels) >= 8
    assert (all_labels[:, 3:] >= 0.05).all() and (all_labels[:, 3:] <= 0.6).all()  # not tiny, not huge


def test_ensure_generates_once_atomically(tmp_path: Path) -> None:
    root = tmp_path / "shapes"
    ensure_shapes_dataset(root, n_train=3, n_val=1, imgsz=64)
    stamp = (root / "shapes.json").stat().st_mtime_ns
    ensure_shapes_dataset(root, n_train=3, n_val=1, imgsz=64)
    assert (root / "shapes.json").stat().st_mtime_ns == stamp  # reused, not regenerated
    ensure_shapes_dataset(root, n_train=2, n_val=1, imgsz=64)  # other options: replaced
    assert len(list((root / "images" / "train").iterdir())) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]  # no temp folders left behind
    foreign = tmp_path / "mine"
    (foreign / "keep").mkdir(parents=True)
    with pytest.raises(FileExistsError):
        ensure_shapes_dataset(foreign, n_train=1, n_val=1)


def test_builtin_yaml_hook_generates_on_first_use(tmp_path: Path) -> None:
    yaml_file = tmp_path / "cfg" / "s.yaml"
    yaml_file.parent.mkdir()
    yaml_file.write_text(
        "path: ../datasets/shapes\ntrain: images/train\nval: images/val\n"
        f"names: {list(SHAPE_NAMES)}\nbuiltin: {{name: shapes, n_train: 3, n_val: 2, imgsz: 64}}\n"
    )
    cfg = load_data_config(yaml_file)
    assert cfg["path"] == (tmp_path / "datasets" / "shapes").resolve() and cfg["nc"] == 5
    assert len(list(Path(cfg["val"]).iterdir())) == 2
