"""Hyper-parameters: typed records of floats, read from and written to YAML, and how ``--evolve`` mutates them.

Every record is a frozen dataclass built from groups: :class:`OptimisationHyp` (learning rate, momentum, decay,
warmup) and :class:`AugmentationHyp` (what the data loader draws), shared by every family, with a family's loss
gains between them (each family's record is in its module under models/families/); a recipe adds its own groups
(:class:`StepScheduleHyp`, :class:`ZoomCropHyp`: the DETR families'), which the engine and the dataset read
wherever a record holds them. :class:`Hyp` holds every key the YOLO families read (YOLOv5's published defaults,
and the anchor-free families' ``dfl`` gain), for code that reads a YOLO hyp file without asking a family for its
record.

A YOLOv5 hyp file loads unchanged. Keys YOLOv5 writes but nothing here uses (``iou_t``, read by no YOLOv5
code either; ``copy_paste``, which needs segment labels) are accepted and dropped with a log line; any other
unknown key is a one-line error naming the file and the key. ``EVOLVE_LIMITS`` says how ``--evolve`` may mutate
each value of :class:`Hyp`; families declare their own tables.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from utils.errors import UserError, excerpt, first_line
from utils.log import LOGGER
from utils.yaml_reader import load_yaml

# Keys of YOLOv5 hyp files that are accepted and ignored, with the reason.
IGNORED_KEYS = {
    "iou_t": "an IoU training threshold that YOLOv5 reads nowhere either",
    "copy_paste": "segment copy-paste needs segment labels; boxes only here",
}

OPTIONAL_KEYS = ("anchors", "dfl")  # None means unset: left out of the YAML written

# What each value may be at all (wider than --evolve's limits): outside it training fails, or means nothing. The
# scale gain draws sizes in [1 - scale, 1 + scale], so 1 and above would make empty images.
_PROBABILITY = (0.0, 1.0)
VALID_RANGES: dict[str, tuple[float, float]] = {
    "lr0": (0.0, 10.0),
    "lrf": (0.0, 10.0),
    "momentum": (0.0, 0.999),
    "weight_decay": (0.0, 1.0),
    "warmup_epochs": (0.0, 10_000.0),
    "warmup_momentum": (0.0, 0.999),
    "warmup_bias_lr": (0.0, 10.0),
    "box": (0.0, 1000.0),
    "cls": (0.0, 1000.0),
    "cls_pw": (0.0, 1000.0),
    "obj": (0.0, 1000.0),
    "obj_pw": (0.0, 1000.0),
    "dfl": (0.0, 1000.0),
    "anchor_t": (1.0, 100.0),
    "anchors": (1.0, 100.0),
    "fl_gamma": (0.0, 10.0),
    "hsv_h": _PROBABILITY,
    "hsv_s": _PROBABILITY,
    "hsv_v": _PROBABILITY,
    "degrees": (0.0, 180.0),
    "translate": (0.0, 1.0),
    "scale": (0.0, 0.99),
    "shear": (0.0, 80.0),
    "perspective": (0.0, 0.1),
    "flipud": _PROBABILITY,
    "fliplr": _PROBABILITY,
    "mosaic": _PROBABILITY,
    "mixup": _PROBABILITY,
    # the DETR recipes' groups (StepScheduleHyp, ZoomCropHyp) and gains
    "warmup_steps": (0.0, 1e7),
    "warmup_power": (1.0, 4.0),
    "flat_share": (0.0, 1.0),
    "backbone_lr": (0.0, 10.0),
    "clip_norm": (0.0, 1e6),
    "ema_decay": (0.0, 1.0),
    "ema_tau": (1.0, 1e7),
    "no_aug_share": (0.0, 1.0),
    "stage_ema_restart": (0.0, 1.0),
    "photometric": _PROBABILITY,
    "zoom_out": _PROBABILITY,
    "zoom_out_max": (1.0, 8.0),
    "iou_crop": _PROBABILITY,
    "mosaic_start_share": (0.0, 1.0),
    "mosaic_end_share": (0.0, 1.0),
    "mal": (0.0, 1000.0),
    "vfl": (0.0, 1000.0),
    "bbox": (0.0, 1000.0),
    "giou": (0.0, 1000.0),
    "fgl": (0.0, 1000.0),
    "ddf": (0.0, 1000.0),
    "focal_alpha": (0.0, 1.0),
    "focal_gamma": (0.0, 10.0),
    "cost_class": (0.0, 1000.0),
    "cost_bbox": (0.0, 1000.0),
    "cost_giou": (0.0, 1000.0),
    "matcher_alpha": (0.0, 1.0),
    "matcher_gamma": (0.0, 10.0),
}

R = TypeVar("R", bound="HypRecord")


def _finite(value: int | float) -> bool:
    """A finite number, also where an integer is too large for a float (10**400 is not a hyper-parameter)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class HypRecord:
    """What every hyper-parameter record can do (the records themselves are frozen dataclasses of floats).

    ``IGNORED_KEYS``: keys accepted and dropped (with the reason, logged); ``OPTIONAL_KEYS``: fields whose None
    means unset, left out of the YAML written; ``REQUIRED_KEYS``: keys a file must set (families check them).
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]  # every record is a dataclass: the checker's view of that
    IGNORED_KEYS: ClassVar[dict[str, str]] = IGNORED_KEYS
    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ()
    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[R], values: dict[str, Any], source: str = "hyp") -> R:
        """A record from a mapping; unknown keys and non-numeric values are one-line errors naming ``source``."""
        if not isinstance(values, dict):
            raise UserError(f"{source}: expected a mapping of hyper-parameter names to numbers")
        known = set(cls.field_names())
        unknown = sorted(k for k in values if k not in known and k not in cls.IGNORED_KEYS)
        if unknown:
            raise UserError(
                f"{source}: unknown hyper-parameter(s) {', '.join(map(str, unknown))} "
                f"(known: {', '.join(sorted(known))})"
            )
        for key in sorted(k for k in values if k in cls.IGNORED_KEYS):
            LOGGER.info(f"{source}: '{key}' ignored ({cls.IGNORED_KEYS[key]})")
        chosen = {}
        for key, value in values.items():
            if key not in known or (key in cls.OPTIONAL_KEYS and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise UserError(f"{source}: '{key}' must be a finite number, got {excerpt(value, 40)}")
            low, high = VALID_RANGES.get(key, (-math.inf, math.inf))
            if not low <= value <= high:
                raise UserError(f"{source}: '{key}' {value:g} is outside [{low:g}, {high:g}]")
            chosen[key] = float(value)
        record = cls(**chosen)
        record.check(source)
        return record

    def check(self, source: str) -> None:
        """Rules across its values, checked once they are read: a one-line UserError naming ``source``."""

    @staticmethod
    def read_yaml(path: str | Path, source: str | None = None) -> Any:
        """A hyp file's contents, as YAML read them (checked by ``from_dict``)."""
        try:
            values = load_yaml(Path(path).read_text(encoding="utf-8"), "a hyp file")
        except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:  # ValueError: not UTF-8, 5000 digits
            raise UserError(f"{source or path}: cannot read hyper-parameters ({first_line(e)})") from e
        if not isinstance(values, dict):
            what = "is empty" if values is None else f"holds a {type(values).__name__}"
            raise UserError(f"{source or path}: {what}, not a mapping of hyper-parameter names to numbers")
        return values

    @classmethod
    def from_yaml(cls: type[R], path: str | Path) -> R:
        return cls.from_dict(cls.read_yaml(path), str(path))

    def to_dict(self) -> dict[str, float]:
        """Plain values (for YAML and checkpoints); unset optional values are left out, as YOLOv5 files do."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not (k in self.OPTIONAL_KEYS and v is None)}

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")

    def replace(self: R, **changes: float) -> R:
        return dataclasses.replace(self, **changes)


# The groups below are combined as ``class Record(AugmentationHyp, LossGains, OptimisationHyp)``: a dataclass
# lists the fields of its bases from the last base to the first, so a record's YAML reads optimisation, loss,
# augmentation, as YOLOv5's files do.


@dataclass(frozen=True)
class OptimisationHyp(HypRecord):
    """The optimizer's and the schedule's values (YOLOv5's published defaults)."""

    lr0: float = 0.01  # initial learning rate (SGD; the automatic AdamW choice sets its own, see utils/optimizer.py)
    lrf: float = 0.01  # final learning rate = lr0 * lrf
    momentum: float = 0.937  # SGD momentum / Adam beta1
    weight_decay: float = 0.0005  # conv/linear weights only
    warmup_epochs: float = 3.0  # may be fractional
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1


@dataclass(frozen=True)
class AugmentationHyp(HypRecord):
    """What the data loader draws for each training sample (YOLOv5's low-augmentation defaults)."""

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


@dataclass(frozen=True)
class StepScheduleHyp(HypRecord):
    """A recipe's optimisation beyond YOLO's (the DETR families'), read by the engine wherever a record holds it:
    the learning rate set at every step (``utils/engine/lr_schedule.py: FlatCosine``) instead of YOLO's per-epoch
    schedule and warmup, gradient clipping, the EMA's settings, and the no-augmentation stage at the end of a run,
    which goes on from the best validated epoch before it (weights, optimizer; the EMA restarted or carried on).
    The defaults are D-FINE's (github.com/Peterande/D-FINE, configs/dfine/include/optimizer.yml and
    dfine_hgnetv2_n_coco.yml)."""

    warmup_steps: float = 500.0  # every group's lr rises from 0 to its own over this many optimizer steps
    warmup_power: float = 1.0  # the rise's shape: (step / warmup_steps) ** power (1: linear; DEIM's is 2)
    flat_share: float = 1.0  # share of the steps before the stage held at lr0, then cosine to lr0 * lrf (1: flat)
    backbone_lr: float = 0.5  # the backbone's learning rate as a multiple of lr0
    clip_norm: float = 0.1  # gradients clipped to this total norm
    ema_decay: float = 0.9999  # the EMA's decay, reached through 1 - exp(-updates / ema_tau)
    ema_tau: float = 1000.0
    no_aug_share: float = 0.075  # the run's last share of epochs without augmentation (12 of 160; at least 1)
    stage_ema_restart: float = (
        1.0  # 1: the EMA starts again where the stage begins; 0: it goes on (Trainer.start_stage)
    )


@dataclass(frozen=True)
class ZoomCropHyp(AugmentationHyp):
    """The DETR recipes' augmentations besides the shared ones (torchvision v2's, as the references use them:
    ``utils/data/augmentations.py``), each a probability per sample; all augmentation stops at the stage epoch."""

    photometric: float = 0.5  # probability of each of RandomPhotometricDistort's changes
    zoom_out: float = 0.5  # probability of placing the image on a canvas up to zoom_out_max times its size
    zoom_out_max: float = 4.0  # the canvas's largest side ratio
    iou_crop: float = 0.8  # probability of torchvision's RandomIoUCrop (SSD's crop)
    # mosaic and mixup only in this window of the run's epochs (DEIM-N: 4 to 78 of 160), and never in the stage
    mosaic_start_share: float = 0.0  # from epoch round(epochs * share)
    mosaic_end_share: float = 1.0  # to (not including) epoch round(epochs * share)


@dataclass(frozen=True)
class _EveryLossGain(HypRecord):
    box: float = 0.05  # box loss gain
    cls: float = 0.5  # classification loss gain
    cls_pw: float = 1.0  # classification BCE positive weight
    obj: float = 1.0  # objectness loss gain (scaled with image size)
    obj_pw: float = 1.0  # objectness BCE positive weight
    anchor_t: float = 4.0  # anchor-multiple threshold for matching targets to anchors
    anchors: float | None = None  # anchors per output level (None: the model YAML's), then fitted by AutoAnchor
    fl_gamma: float = 0.0  # focal loss gamma (0: plain BCE)
    dfl: float | None = None  # DFL (or L1) box loss gain of the anchor-free families; unset for anchor-based ones


@dataclass(frozen=True)
class Hyp(AugmentationHyp, _EveryLossGain, OptimisationHyp):
    """Every key any family here reads, with the values of ``data/hyps/hyp.scratch-low.yaml`` (YOLOv5's
    low-augmentation defaults for training from scratch); ``dfl`` unset."""

    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = OPTIONAL_KEYS


@dataclass(frozen=True)
class Limit:
    """How ``--evolve`` mutates a value: a relative mutation scale (0: never mutated) within [low, high]."""

    scale: float
    low: float
    high: float


# Mutation scale and bounds of each value of ``Hyp`` (YOLOv5's evolution table); a family's table takes the
# entries of its own record's keys from here and gives its own bounds where they differ.
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


def evolve_limits_of(record: type[HypRecord], **own: Limit) -> dict[str, Limit]:
    """The evolution table of ``record``'s keys: ``own`` limits where given, else ``EVOLVE_LIMITS``' (keys without
    either are never mutated)."""
    table = {**EVOLVE_LIMITS, **own}
    return {k: table[k] for k in [*EVOLVE_LIMITS, *own] if k in record.field_names()}
