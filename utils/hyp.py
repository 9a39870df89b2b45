"""Hyper-parameters: one typed record with YOLOv5's published defaults, read from and written to YAML.

A YOLOv5 hyp file loads unchanged. Keys YOLOv5 writes but nothing here uses (``iou_t``, read by no YOLOv5
code either; ``copy_paste``, which needs segment labels) are accepted and dropped with a log line; any other
unknown key is a one-line error naming the file and the key. ``EVOLVE_LIMITS`` (YOLOv5) and
``ANCHOR_FREE_EVOLVE_LIMITS`` beside the record say how ``--evolve`` may mutate each value of a family's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from utils.errors import UserError
from utils.log import LOGGER

# Keys of YOLOv5 hyp files that are accepted and ignored, with the reason.
IGNORED_KEYS = {
    "iou_t": "an IoU training threshold that YOLOv5 reads nowhere either",
    "copy_paste": "segment copy-paste needs segment labels; boxes only here",
}

OPTIONAL_KEYS = ("anchors", "dfl")  # None means unset: left out of the YAML written


@dataclass(frozen=True)
class Hyp:
    """Values of ``data/hyps/hyp.scratch-low.yaml`` (YOLOv5's low-augmentation defaults for training from scratch)."""

    # optimisation
    lr0: float = 0.01  # initial learning rate (SGD; the automatic AdamW choice sets its own, see utils/optimizer.py)
    lrf: float = 0.01  # final learning rate = lr0 * lrf
    momentum: float = 0.937  # SGD momentum / Adam beta1
    weight_decay: float = 0.0005  # conv/linear weights only
    warmup_epochs: float = 3.0  # may be fractional
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    # loss
    box: float = 0.05  # box loss gain
    cls: float = 0.5  # classification loss gain
    cls_pw: float = 1.0  # classification BCE positive weight
    obj: float = 1.0  # objectness loss gain (scaled with image size)
    obj_pw: float = 1.0  # objectness BCE positive weight
    anchor_t: float = 4.0  # anchor-multiple threshold for matching targets to anchors
    anchors: float | None = None  # anchors per output level (None: the model YAML's), then fitted by AutoAnchor
    fl_gamma: float = 0.0  # focal loss gamma (0: plain BCE)
    dfl: float | None = None  # DFL (YOLO26: L1) box loss gain of the anchor-free families; unset for YOLOv5
    # augmentation
    hsv_h: float = 0.015  # hue jitter (fraction)
    hsv_s: float = 0.7  # saturation jitter (fraction)
    hsv_v: float = 0.4  # value jitter (fraction)
    degrees: float = 0.0  # rotation (+/- deg)
    translate: float = 0.1  # translation (+/- fraction)
    scale: float = 0.5  # scale gain (+/-)
    shear: float = 0.0  # shear (+/- deg)
    perspective: float = 0.0  # perspective (+/- fraction), range 0-0.001
    flipud: float = 0.0  # probability of a vertical flip
    fliplr: float = 0.5  # probability of a horizontal flip
    mosaic: float = 1.0  # probability of a 4-image mosaic
    mixup: float = 0.0  # probability of mixup

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "hyp") -> Hyp:
        """A record from a mapping; unknown keys and non-numeric values are one-line errors naming ``source``."""
        if not isinstance(values, dict):
            raise UserError(f"{source}: expected a mapping of hyper-parameter names to numbers")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in values if k not in known and k not in IGNORED_KEYS)
        if unknown:
            raise UserError(f"{source}: unknown hyper-parameter(s) {', '.join(map(str, unknown))} "
                            f"(known: {', '.join(sorted(known))})")
        for key in sorted(k for k in values if k in IGNORED_KEYS):
            LOGGER.info(f"{source}: '{key}' ignored ({IGNORED_KEYS[key]})")
        chosen = {}
        for key, value in values.items():
            if key not in known or (key in OPTIONAL_KEYS and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"{source}: '{key}' must be a finite number, got {value!r}")
            chosen[key] = float(value)
        return cls(**chosen)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Hyp:
        try:
            values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise UserError(f"{path}: cannot read hyper-parameters ({e.__class__.__name__})") from e
        return cls.from_dict(values, str(path))

    def to_dict(self) -> dict[str, float]:
        """Plain values (for YAML and checkpoints); unset ``anchors`` and ``dfl`` are left out, as YOLOv5 files do."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not (k in OPTIONAL_KEYS and v is None)}

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")

    def replace(self, **changes: float) -> Hyp:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Limit:
    """How ``--evolve`` mutates a value: a relative mutation scale (0: never mutated) within [low, high]."""

    scale: float
    low: float
    high: float


# YOLOv5's evolution table: mutation scale and bounds per hyper-parameter.
EVOLVE_LIMITS: dict[str, Limit] = {
    "lr0": Limit(1, 1e-5, 1e-1),
    "lrf": Limit(1, 0.01, 1.0),
    "momentum": Limit(0.3, 0.6, 0.98),
    "weight_decay": Limit(1, 0.0, 0.001),
    "warmup_epochs": Limit(1, 0.0, 5.0),
    "warmup_momentum": Limit(1, 0.0, 0.95),
    "warmup_bias_lr": Limit(1, 0.0, 0.2),
    "box": Limit(1, 0.02, 0.2),
    "cls": Limit(1, 0.2, 4.0),
    "cls_pw": Limit(1, 0.5, 2.0),
    "obj": Limit(1, 0.2, 4.0),
    "obj_pw": Limit(1, 0.5, 2.0),
    "anchor_t": Limit(1, 2.0, 8.0),
    "anchors": Limit(2, 2.0, 10.0),
    "fl_gamma": Limit(0, 0.0, 2.0),
    "hsv_h": Limit(1, 0.0, 0.1),
    "hsv_s": Limit(1, 0.0, 0.9),
    "hsv_v": Limit(1, 0.0, 0.9),
    "degrees": Limit(1, 0.0, 45.0),
    "translate": Limit(1, 0.0, 0.9),
    "scale": Limit(1, 0.0, 0.9),
    "shear": Limit(1, 0.0, 10.0),
    "perspective": Limit(0, 0.0, 0.001),
    "flipud": Limit(1, 0.0, 1.0),
    "fliplr": Limit(0, 0.0, 1.0),
    "mosaic": Limit(1, 0.0, 1.0),
    "mixup": Limit(1, 0.0, 1.0),
}

# The anchor-free families' evolution table: YOLOv5's for what they share; the box gain on their scale (7.5),
# the DFL/L1 gain; nothing for the terms they do not have (objectness, anchors, focal loss, class pos-weight).
ANCHOR_FREE_EVOLVE_LIMITS: dict[str, Limit] = {
    **{k: v for k, v in EVOLVE_LIMITS.items()
       if k not in ("obj", "obj_pw", "anchor_t", "anchors", "fl_gamma", "cls_pw")},
    "box": Limit(1, 1.0, 20.0),
    "dfl": Limit(1, 0.4, 6.0),
}
