"""Make the repository root importable; shared generated-data fixtures."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


COLOURS = [(40, 40, 220), (220, 160, 40), (40, 200, 40), (200, 40, 200), (20, 220, 220)]  # BGR, one per class


def write_rectangles_dataset(root: Path, n_train: int = 16, n_val: int = 8, size: int = 96, seed: int = 0,
                             n_classes: int = 2, width: int | None = None) -> Path:
    """A tiny YOLO-format dataset of coloured rectangles and its data YAML; returns the YAML path.

    Images are ``size`` high and ``width`` (default ``size``) wide; up to 5 classes, one colour each.
    """
    rng = np.random.default_rng(seed)
    colours = COLOURS[:n_classes]
    width = width or size
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = np.full((size, width, 3), rng.integers(90, 160), np.uint8)
            rows = []
            for _ in range(int(rng.integers(1, 4))):
                cls = int(rng.integers(0, n_classes))
                w, h = int(rng.integers(width // 6, width // 2)), int(rng.integers(size // 6, size // 2))
                x1, y1 = int(rng.integers(0, width - w)), int(rng.integers(0, size - h))
                cv2.rectangle(img, (x1, y1), (x1 + w - 1, y1 + h - 1), colours[cls], -1)
                rows.append(f"{cls} {(x1 + w / 2) / width:.6f} {(y1 + h / 2) / size:.6f} {w / width:.6f} {h / size:.6f}")
            cv2.imwrite(str(root / "images" / split / f"{i:04d}.jpg"), img)
            (root / "labels" / split / f"{i:04d}.txt").write_text("\n".join(rows) + "\n")
    yaml_file = root / "rectangles.yaml"
    names = "".join(f"  {k}: {name}\n" for k, name in enumerate(["red", "blue", "green", "magenta", "yellow"][:n_classes]))
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}")
    return yaml_file


@pytest.fixture(scope="session")
def rectangles_yaml(tmp_path_factory) -> Path:
    return write_rectangles_dataset(tmp_path_factory.mktemp("rectangles"))


# train.py in this process: yolov5n at 64 px, batch 8, no workers, no AutoAnchor, no plots (later flags override).
TINY_IN_PROCESS = ["--imgsz", "64", "--batch-size", "8", "--workers", "0", "--noautoanchor", "--device", "cpu",
                   "--noplots"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def train_here(monkeypatch):
    """``go(*args) -> (exit status, log text)``: train.py's main in this process, with TINY_IN_PROCESS first."""
    import train
    from utils.log import LOGGER

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    handler = _Lines()
    LOGGER.addHandler(handler)
    threads = torch.get_num_threads()

    def go(*args: str) -> tuple[int, str]:
        handler.lines.clear()
        status = train.main([*TINY_IN_PROCESS, *map(str, args)])
        return status, "\n".join(handler.lines)

    yield go
    LOGGER.removeHandler(handler)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)
