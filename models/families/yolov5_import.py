"""Import YOLOv5 (v6 and later) checkpoints without running anything from the file.

A YOLOv5 ``.pt`` is a pickle of YOLOv5's own classes (``models.yolo.DetectionModel``, ``models.common.Conv``,
...). Unpickling it normally imports and instantiates whatever classes it names, which is how a payload runs.
Here the pickle is read by an unpickler whose ``find_class`` answers from an explicit allow-list:

* YOLOv5's detection blocks and the torch.nn modules they contain become inert :class:`ModuleRecord`
  objects: a class name and an attribute dict, nothing callable;
* tensors are rebuilt from the file's storages (torch's own persistent-id handling) as plain tensors;
* ``pathlib`` paths become strings, numpy scalars Python numbers and numeric numpy arrays inert records;
* every other global (``os.system``, ``builtins.eval``, an unknown class, ...) raises before it is used.

The records then give a model YAML, class names and a state dict; the model is built from that YAML through
our own module registry and every tensor must match by name and shape.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from models.families.base import CheckpointImporter, Family
from models.families.records import (
    MALFORMED_FILE_ERRORS,
    MODULE_ALIASES,
    SAFE_CALLABLES,
    ModuleRecord,
    RefusedGlobal,
    named_records,
    plain,
    record_class,
    record_state_dict,
)
from models.yolo import Model
from utils.errors import UserError, describe
from utils.log import LOGGER
from utils.torch_utils import cpu_fp32_state

# YOLOv5's classes a detection checkpoint may name; Model is the v6.0/v6.1 name of DetectionModel.
YOLOV5_MODEL_CLASSES = ("models.yolo.DetectionModel", "models.yolo.Model")
_MODULE_CLASSES = (
    *YOLOV5_MODEL_CLASSES,
    "models.yolo.Detect",
    "models.common.Conv",
    "models.common.C3",
    "models.common.Bottleneck",
    "models.common.SPPF",
    "models.common.Concat",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.batchnorm.BatchNorm2d",
    "torch.nn.modules.activation.SiLU",
    "torch.nn.modules.linear.Identity",
    "torch.nn.modules.pooling.MaxPool2d",
    "torch.nn.modules.upsampling.Upsample",
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.container.ModuleList",
)
# Our class for each record class, to check the imported structure block by block.
_OUR_CLASS_NAME = {"DetectionModel": "Model"}

_RECORD_CLASSES = {name: record_class(name) for name in _MODULE_CLASSES}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed globals above; everything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{MODULE_ALIASES.get(module, module)}.{name}"
        if qualified in SAFE_CALLABLES:
            return SAFE_CALLABLES[qualified]
        if qualified in _RECORD_CLASSES:
            return _RECORD_CLASSES[qualified]
        raise RefusedGlobal(f"{module}.{name}")


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return RestrictedUnpickler(file, **kwargs).load()


# torch.load(pickle_module=...) needs an object with Unpickler and load (the latter for the legacy format).
RESTRICTED_PICKLE = types.SimpleNamespace(
    __name__="yolov5_restricted_pickle", Unpickler=RestrictedUnpickler, load=_restricted_load
)


def read_restricted(path: str | Path) -> Any:
    """Unpickle a torch checkpoint with the restricted unpickler; raise UserError if it names anything else."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=RESTRICTED_PICKLE)
    except RefusedGlobal as e:
        raise UserError(
            f"{path}: refused: the file names {e.qualified_name}, which is neither a tensor, a plain value nor a "
            "YOLOv5 detection block (checkpoints never run code here)"
        ) from e
    except pickle.UnpicklingError as e:
        raise UserError(f"{path}: refused: {describe(e)}") from e
    except MALFORMED_FILE_ERRORS as e:
        raise UserError(f"{path}: not a readable checkpoint ({describe(e)})") from e


def _names_list(names: Any, nc: int, path: Path) -> list[str]:
    if isinstance(names, dict):
        try:
            names = [names[i] for i in range(len(names))]
        except KeyError as e:
            raise UserError(f"{path}: class names are not indexed 0..{len(names) - 1}") from e
    if not isinstance(names, (list, tuple)):
        return [str(i) for i in range(nc)]
    if len(names) != nc:
        raise UserError(f"{path}: {len(names)} class names for {nc} classes")
    return [str(n) for n in names]


def _check_structure(model: torch.nn.Module, record: ModuleRecord, path: Path) -> None:
    """Every module of ours has a record of the same class at the same place, and the other way round."""
    ours = dict(model.named_modules())
    theirs = named_records(record)
    for name in sorted(set(ours) | set(theirs)):
        mine, rec = ours.get(name), theirs.get(name)
        where = name or "the model"
        if mine is None or rec is None:
            missing = "in the file" if rec is None else "in the model built from its YAML"
            raise UserError(
                f"{path}: layer {where} ({type(mine).__name__ if mine is not None else rec.short_name if rec is not None else '?'}) "
                f"is missing {missing}; is the model fused or modified?"
            )
        expected = _OUR_CLASS_NAME.get(rec.short_name, rec.short_name)
        if type(mine).__name__ != expected:
            raise UserError(f"{path}: layer {where} is {rec.class_name} in the file but {type(mine).__name__} here")
        if isinstance(mine, torch.nn.BatchNorm2d):
            eps, momentum = rec.attrs.get("eps"), rec.attrs.get("momentum")
            if eps is not None and abs(float(eps) - mine.eps) > 1e-12:
                raise UserError(f"{path}: layer {where}: BatchNorm eps {eps} differs from this project's {mine.eps}")
            if momentum is not None:
                mine.momentum = float(momentum)


def _model_from_record(record: Any, path: Path, role: str) -> tuple[torch.nn.Module, list[str]]:
    """Build our model from a DetectionModel record and load its tensors; every tensor must match."""
    if not isinstance(record, ModuleRecord) or record.class_name not in YOLOV5_MODEL_CLASSES:
        found = record.class_name if isinstance(record, ModuleRecord) else type(record).__name__
        raise UserError(f"{path}: '{role}' is {found}, not a YOLOv5 detection model")
    cfg = plain(record.attrs.get("yaml"))
    if not isinstance(cfg, dict) or not all(k in cfg for k in ("nc", "anchors", "backbone", "head")):
        raise UserError(f"{path}: '{role}' has no model YAML (nc, anchors, backbone, head)")
    if cfg.get("activation") not in (None, "nn.SiLU()"):
        raise UserError(f"{path}: activation {cfg['activation']!r} is not supported (only the default SiLU)")
    cfg = {k: v for k, v in cfg.items() if k != "activation"}
    if isinstance(record.attrs.get("yaml_file"), str):
        cfg["yaml_file"] = record.attrs["yaml_file"]
    try:
        model = Model(cfg)
    except UserError as e:
        raise UserError(f"{path}: '{role}': {e}") from e
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise UserError(f"{path}: '{role}': its model YAML does not build ({e.__class__.__name__}: {e})") from e
    nc = int(record.attrs.get("nc", cfg["nc"]))
    if nc != model.nc:
        raise UserError(f"{path}: the model says nc={nc} but its YAML builds nc={model.nc}")
    names = _names_list(plain(record.attrs.get("names")), nc, path)
    _check_structure(model, record, path)

    state = record_state_dict(record)
    head_key = f"model.{len(model.model) - 1}"
    head = named_records(record).get(head_key)
    stride = head.attrs.get("stride") if isinstance(head, ModuleRecord) else None
    if stride is None:
        stride = record.attrs.get("stride")
    if not isinstance(stride, torch.Tensor) or stride.shape != model.stride.shape:
        raise UserError(f"{path}: '{role}' has no Detect strides for {model.model[-1].nl} levels")
    if not torch.equal(stride.float(), model.stride):
        raise UserError(f"{path}: strides {stride.tolist()} differ from {model.stride.tolist()} of its YAML")
    state[f"{head_key}.stride"] = stride  # a plain attribute in YOLOv5, a buffer here

    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong_shape:
        problems = [
            f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
            if keys
        ]
        raise UserError(f"{path}: '{role}' tensors do not match the model built from its YAML ({'; '.join(problems)})")
    floating = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(floating, strict=True)
    model.names = names
    return model, names


def is_yolov5_checkpoint(raw: Any) -> bool:
    return isinstance(raw, dict) and isinstance(raw.get("model"), ModuleRecord)


def convert_yolov5(raw: Any, path: str | Path) -> dict[str, Any]:
    """Our checkpoint dict (``model_cfg``, ``model``, ``ema`` or None, ``names``, ``source``) from a restricted read."""
    path = Path(path)
    if not is_yolov5_checkpoint(raw):
        raise UserError(f"{path}: not a checkpoint of this project nor a YOLOv5 detection checkpoint")
    model, names = _model_from_record(raw["model"], path, "model")
    ema = None
    if raw.get("ema") is not None:
        ema_model, _ = _model_from_record(raw["ema"], path, "ema")
        ema = cpu_fp32_state(ema_model)
    dtype = next(iter(record_state_dict(raw["model"]).values())).dtype
    meta = {
        k: plain(raw.get(k))
        for k in ("epoch", "best_fitness", "updates", "opt", "train_args", "git", "date")
        if k in raw
    }
    n_tensors = len(model.state_dict())
    built: Any = model  # a Model: yaml, nc and its layers are untyped nn.Module attributes
    LOGGER.info(
        f"{path}: YOLOv5 checkpoint imported ({built.yaml.get('yaml_file', 'model')}, {built.nc} classes, "
        f"{built.model[-1].nl} levels, {str(dtype).replace('torch.', '')}, {n_tensors}/{n_tensors} tensors "
        f"matched{', with EMA' if ema is not None else ''}); nothing in it was executed"
    )
    return {
        "model_cfg": model.yaml,
        "names": names,
        "model": cpu_fp32_state(model),
        "ema": ema,
        "source": YOLOv5Importer.source,  # resuming refuses it: YOLOv5's training state is not ours
        YOLOv5Importer.source: meta,  # its record; trained_imgsz reads its 'opt'
    }


def load_yolov5_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a YOLOv5 ``.pt`` safely and return it as a checkpoint dict of this project."""
    return convert_yolov5(read_restricted(path), path)


class YOLOv5Importer(CheckpointImporter):
    """YOLOv5's checkpoints; tried last, it reads any file no other importer took and refuses, naming it, the first
    global outside its allow-list (what a payload names)."""

    source = "yolov5"
    title = "YOLOv5"
    possessive = "YOLOv5's"
    catch_all = True

    def read(self, path: Path, families: Sequence[Family]) -> dict[str, Any]:
        ckpt = load_yolov5_checkpoint(path)
        ckpt["model_cfg"]["family"] = families[0].name  # the one family this importer reads
        return ckpt


YOLOV5_IMPORTER = YOLOv5Importer()
