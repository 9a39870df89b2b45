"""Make the repository root importable; shared generated-data fixtures."""
from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def write_rectangles_dataset(root: Path, n_train: int = 16, n_val: int = 8, size: int = 96, seed: int = 0) -> Path:
    """A tiny YOLO-format dataset of coloured rectangles (2 classes) and its data YAML; returns the YAML path."""
    rng = np.random.default_rng(seed)
    colours = [(40, 40, 220), (220, 160, 40)]  # BGR, one per class
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = np.full((size, size, 3), rng.integers(90, 160), np.uint8)
            rows = []
            for _ in range(int(rng.integers(1, 4))):
                cls = int(rng.integers(0, 2))
                w, h = (int(v) for v in rng.integers(size // 6, size // 2, 2))
                x1, y1 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
                cv2.rectangle(img, (x1, y1), (x1 + w - 1, y1 + h - 1), colours[cls], -1)
                rows.append(f"{cls} {(x1 + w / 2) / size:.6f} {(y1 + h / 2) / size:.6f} {w / size:.6f} {h / size:.6f}")
            cv2.imwrite(str(root / "images" / split / f"{i:04d}.jpg"), img)
            (root / "labels" / split / f"{i:04d}.txt").write_text("\n".join(rows) + "\n")
    yaml_file = root / "rectangles.yaml"
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: red\n  1: blue\n")
    return yaml_file


@pytest.fixture(scope="session")
def rectangles_yaml(tmp_path_factory) -> Path:
    return write_rectangles_dataset(tmp_path_factory.mktemp("rectangles"))
