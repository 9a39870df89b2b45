"""A built-in synthetic detection dataset: simple coloured shapes on textured backgrounds.

Deterministic (same seed, same files), generated offline in seconds, and easy enough that a small model
learns it within minutes on a CPU. ``data/shapes.yaml`` asks for it with ``builtin: shapes``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import cv2
import numpy as np

from utils.boxes import box_iou_exact
from utils.log import LOGGER

SHAPE_NAMES = ("circle", "rectangle", "triangle", "cross", "star")
GENERATOR_VERSION = 1
DEFAULTS = {"n_train": 400, "n_val": 100, "imgsz": 320, "seed": 0}
# what a data YAML's `builtin:` may ask for: enough to train on, small enough to generate
OPTION_RANGES = {"n_train": (1, 100_000), "n_val": (1, 100_000), "imgsz": (32, 2048), "seed": (0, 2**32 - 1)}
_SIZES = ((1.0, 1.0), (1.0, 0.75), (0.75, 1.0), (1.0, 0.8))  # (w, h) as fractions of imgsz


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A gradient, noise, stripes or checkerboard in muted colours."""
    kind = rng.integers(4)
    c1, c2 = rng.integers(40, 200, 3), rng.integers(40, 200, 3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == 0:
        angle = rng.uniform(0, 2 * np.pi)
        t = xx * math.cos(angle) + yy * math.sin(angle)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
    elif kind == 1:
        t = cv2.resize(rng.random((max(2, h // 16), max(2, w // 16)), dtype=np.float32), (w, h))
    elif kind == 2:
        period = rng.uniform(12, 40)
        t = 0.5 + 0.5 * np.sin((xx + yy * rng.uniform(-1, 1)) * 2 * np.pi / period)
    else:
        cell = int(rng.integers(16, 48))
        t = (((xx // cell) + (yy // cell)) % 2).astype(np.float32)
    img = c1 * (1 - t[..., None]) + c2 * t[..., None]
    img += rng.normal(0, 6, (h, w, 1)).astype(np.float32)  # grain, so flat colour is never a shortcut
    return img.clip(0, 255).astype(np.uint8)


def _polygon(cls: int, cx: float, cy: float, rx: float, ry: float, angle: float) -> np.ndarray:
    """Outline points of a non-circle shape centred on (cx, cy) with half-sizes rx, ry."""
    if cls == 1:
        pts: list[tuple[float, float]] = [(-1, -1), (1, -1), (1, 1), (-1, 1)]
    elif cls == 2:
        pts = [(0, -1), (0.95, 0.8), (-0.95, 0.8)]
    elif cls == 3:
        a = 0.32
        pts = [
            (-a, -1),
            (a, -1),
            (a, -a),
            (1, -a),
            (1, a),
            (a, a),
            (a, 1),
            (-a, 1),
            (-a, a),
            (-1, a),
            (-1, -a),
            (-a, -a),
        ]
    else:
        pts = [
            (math.cos(t) * r, math.sin(t) * r)
            for k in range(10)
            for t, r in [(-math.pi / 2 + k * math.pi / 5, 1.0 if k % 2 == 0 else 0.42)]
        ]
    p = np.array(pts, dtype=np.float64) * (rx, ry)
    c, s = math.cos(angle), math.sin(angle)
    p = p @ np.array([[c, s], [-s, c]])
    return p + (cx, cy)


def _draw_image(rng: np.random.Generator, imgsz: int) -> tuple[np.ndarray, list[list[float]]]:
    fw, fh = _SIZES[rng.integers(len(_SIZES))]
    w, h = int(imgsz * fw), int(imgsz * fh)
    img = _background(rng, h, w)
    boxes: list[list[float]] = []
    for _ in range(int(rng.integers(1, 6))):
        cls = int(rng.integers(len(SHAPE_NAMES)))
        side = rng.uniform(0.08, 0.4) * min(w, h)  # object size 8-40 % of the image side
        rx, ry = side / 2 * rng.uniform(0.8, 1.2), side / 2 * rng.uniform(0.8, 1.2)
        cx, cy = rng.uniform(1.3 * rx + 1, w - 1.3 * rx - 1), rng.uniform(1.3 * ry + 1, h - 1.3 * ry - 1)
        if cls == 0:
            pts = np.asarray(cv2.ellipse2Poly((int(cx), int(cy)), (int(rx), int(ry)), 0, 0, 360, 3), np.float64)
        else:
            angle = rng.uniform(-0.3, 0.3) if cls in (1, 3) else rng.uniform(-0.2, 0.2)
            pts = _polygon(cls, cx, cy, rx, ry, angle)
        x1, y1 = pts.min(0).clip(0, (w, h))
        x2, y2 = pts.max(0).clip(0, (w, h))
        box = np.array([x1, y1, x2, y2])
        if boxes and box_iou_exact(box, np.array([b[1:] for b in boxes])).max() > 0.3:
            continue  # some overlap is fine, hiding an object is not
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if np.abs(np.array(colour) - img[int(cy), int(cx)]).sum() < 150:  # keep contrast with the background
            colour = tuple(int(255 - v) for v in img[int(cy), int(cx)])
        cv2.fillPoly(img, [np.round(pts).astype(np.int32)], colour, lineType=cv2.LINE_AA)
        boxes.append([cls, x1, y1, min(x2 + 1, w), min(y2 + 1, h)])  # edge coordinates
    return img, [
        [b[0], (b[1] + b[3]) / 2 / w, (b[2] + b[4]) / 2 / h, (b[3] - b[1]) / w, (b[4] - b[2]) / h] for b in boxes
    ]


def generate_shapes(root: str | Path, n_train: int = 400, n_val: int = 100, imgsz: int = 320, seed: int = 0) -> Path:
    """Write ``images/{train,val}/*.jpg`` and ``labels/{train,val}/*.txt`` under ``root`` (deterministic)."""
    root = Path(root)
    for split, count, split_seed in (("train", n_train, 0), ("val", n_val, 1)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            rng = np.random.default_rng([seed, split_seed, i])
            img, labels = _draw_image(rng, imgsz)
            name = f"{split}_{i:05d}"
            cv2.imwrite(str(root / "images" / split / f"{name}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
            lines = "".join(f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in labels)
            (root / "labels" / split / f"{name}.txt").write_text(lines, encoding="utf-8")
    return root


def ensure_shapes_dataset(root: str | Path, **options: int) -> Path:
    """Generate the dataset into ``root`` unless it is already there with the same options.

    Generation goes to a temp folder beside ``root`` that is then renamed, so an interrupted or
    concurrent run never leaves a half-written dataset behind.
    """
    root = Path(root)
    params = {**DEFAULTS, **options}
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}, expected {sorted(DEFAULTS)}")
    stamp = {"generator": "shapes", "version": GENERATOR_VERSION, **params}
    marker = root / "shapes.json"
    if marker.is_file():
        try:
            if json.loads(marker.read_text(encoding="utf-8")) == stamp:
                return root
        except (OSError, ValueError):
            pass
    elif root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists but is not a generated shapes dataset; refusing to overwrite")

    LOGGER.info(f"Generating the built-in shapes dataset into {root} ...")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        generate_shapes(tmp, **params)
        (tmp / "shapes.json").write_text(json.dumps(stamp), encoding="utf-8")
        old = None
        if root.exists():  # an older version: move it aside first, so root is never half-replaced
            old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old.", dir=root.parent))
            os.replace(root, old / root.name)
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / "shapes.json").is_file():  # someone else finishing first is fine; anything else is not
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
