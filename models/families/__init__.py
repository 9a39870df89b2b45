"""The model families and the questions code outside them asks: which family a model, config or name is, how
another tool's checkpoint is imported, what a missing release file is.

Each family is one module here (the contract: models/families/base.py and docs/design.md). ``FAMILIES`` lists them
most specific first: a config without a ``family:`` key (YOLOv5's and Ultralytics' files, and ours written before
the key existed) belongs to the first family that recognises its contents (YOLO26 and YOLO12 configs also have
YOLO11's C3k2 blocks, and every anchor-free config would pass for YOLOv8's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.nn as nn

from models.families.base import CheckpointImporter, ExportModule, Family, Int8Scope, TrainBatch
from models.families.dfine import DFINE
from models.families.rtdetrv2 import RTDETRV2
from models.families.ultralytics_import import ULTRALYTICS_IMPORTER
from models.families.yolo12 import YOLO12
from models.families.yolo26 import YOLO26
from models.families.yolov5 import YOLOV5
from models.families.yolov8 import YOLO11, YOLOV8
from utils.distributed import de_parallel
from utils.errors import UserError

# The DETR families recognise only configs that name them (their place in the order does not matter).
FAMILIES: dict[str, Family] = {f.name: f for f in (YOLOV5, YOLO26, YOLO12, YOLO11, YOLOV8, DFINE, RTDETRV2)}
Family.register(*FAMILIES.values())
# The order in which help texts and messages list the families: the order they appeared in.
LISTING_ORDER = (YOLOV5, YOLOV8, YOLO11, YOLO12, YOLO26, DFINE, RTDETRV2)

# The family of exported files of this project that record none (the first exports were all YOLOv5 models).
UNRECORDED_EXPORT_FAMILY = YOLOV5

__all__ = [
    "DFINE",
    "FAMILIES",
    "RTDETRV2",
    "LISTING_ORDER",
    "YOLO11",
    "YOLO12",
    "YOLO26",
    "YOLOV5",
    "YOLOV8",
    "CheckpointImporter",
    "ExportModule",
    "Family",
    "Int8Scope",
    "TrainBatch",
    "UNRECORDED_EXPORT_FAMILY",
    "family_name",
    "family_of",
    "import_checkpoint",
    "imported_records",
    "importer_of_source",
    "known_layouts",
    "missing_weights_message",
    "model_config_of_name",
    "titles_by",
    "ultralytics_export_family",
]


def family_name(cfg: Mapping[str, Any]) -> str:
    """The name of a model config's family: its ``family:`` key, else the first family recognising its contents."""
    declared = cfg.get("family")
    if declared is not None:
        if declared not in FAMILIES:
            raise UserError(
                f"{cfg.get('yaml_file', 'model config')}: model family {declared!r} is not supported here "
                f"(known: {', '.join(sorted(FAMILIES))})"
            )
        return str(declared)
    for family in FAMILIES.values():
        if family.recognizes(cfg):
            return family.name
    raise UserError(
        f"{cfg.get('yaml_file', 'model config')}: no model family recognises this config "
        f"(known: {', '.join(sorted(FAMILIES))})"
    )


def model_config_of_name(cfg: str | Path) -> dict[str, Any] | None:
    """The model config of a ``--cfg`` name that a family resolves itself (``dfine-n.yaml``), or None: the YOLO YAML
    reader's (models/yolo.py: load_model_config)."""
    for family in FAMILIES.values():
        config = family.config_of_name(cfg)
        if config is not None:
            return config
    return None


def family_of(model_or_cfg: nn.Module | Mapping[str, Any] | str | Family) -> Family:
    """The family of a model (DDP-wrapped or not), a model config, or a family name."""
    if isinstance(model_or_cfg, Family):
        return model_or_cfg
    if isinstance(model_or_cfg, nn.Module):
        cfg = getattr(de_parallel(model_or_cfg), "yaml", None)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{type(model_or_cfg).__name__} has no model config: its family is unknown")
        name = family_name(cfg)
    elif isinstance(model_or_cfg, Mapping):
        name = family_name(model_or_cfg)
    else:
        name = str(model_or_cfg)
    if name not in FAMILIES:
        raise UserError(f"model family {name!r} is not supported here (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]


def titles_by(value_of: Callable[[Family], Any], template: str = "{value} {titles}") -> str:
    """The families grouped by ``value_of(family)``, each group written through ``template`` (``value``, and
    ``titles`` joined by "/"), the groups joined by ", ": help texts say a per-family default with it, without
    naming a family themselves (``titles_by(lambda f: f.val_iou)``: "0.6 YOLOv5, 0.7 YOLOv8/YOLO11/YOLO12/YOLO26")."""
    listed = [*LISTING_ORDER, *(f for f in FAMILIES.values() if f not in LISTING_ORDER)]
    groups: dict[Any, list[str]] = {}
    for family in listed:
        groups.setdefault(value_of(family), []).append(family.title)
    return ", ".join(template.format(value=value, titles="/".join(titles)) for value, titles in groups.items())


def known_layouts() -> tuple[str, ...]:
    """Every output layout a family here gives (exported files name theirs in their metadata)."""
    return tuple(dict.fromkeys(layout for f in FAMILIES.values() for layout in f.layouts))


# ---- other tools' checkpoints ----------------------------------------------------------------------------------


def _importers() -> list[CheckpointImporter]:
    """Every family's importers, once each; a catch-all importer last."""
    unique = dict.fromkeys(imp for f in FAMILIES.values() for imp in f.importers)
    return sorted(unique, key=lambda importer: importer.catch_all)


def _families_of(importer: CheckpointImporter) -> list[Family]:
    return [f for f in FAMILIES.values() if importer in f.importers]


def import_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint of another tool (YOLOv5's, Ultralytics', ...) read through its importer's allow-list, as this
    project's checkpoint dict; a file no importer takes is refused in one line naming what it holds."""
    path = Path(path)
    for importer in _importers():
        ckpt = importer.read(path, _families_of(importer))
        if ckpt is not None:
            return ckpt
    raise UserError(f"{path}: not a checkpoint of this project, nor one any importer here reads")


def imported_records(ckpt: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The other tools' own records a checkpoint holds (each importer keeps its tool's under its ``source``)."""
    return [ckpt[importer.source] for importer in _importers() if isinstance(ckpt.get(importer.source), dict)]


def importer_of_source(source: Any) -> CheckpointImporter | None:
    """The importer whose checkpoints carry ``source`` (a checkpoint dict's ``source``), or None (ours)."""
    return next((importer for importer in _importers() if importer.source == source), None)


def missing_weights_message(path: str | Path, what: str = "checkpoint") -> str:
    """The one-line error for a weights file that is not there; a tool's released file names say where they come
    from (nothing is downloaded here)."""
    path = Path(path)
    for importer in _importers():
        hint = importer.missing_file_hint(path.name, _families_of(importer))
        if hint:
            return f"{path}: {what} not found ({hint})"
    return f"{path}: {what} not found"


def ultralytics_export_family(description: str) -> Family:
    """The family of a file Ultralytics' exporter wrote, from its metadata's ``description``."""
    return ULTRALYTICS_IMPORTER.export_family(description, _families_of(ULTRALYTICS_IMPORTER))
