"""Import Ultralytics detection checkpoints (of the families that name this importer) without running anything.

An Ultralytics ``.pt`` pickles its model as objects (``ultralytics.nn.tasks.DetectionModel`` holding
``ultralytics.nn.modules.*`` blocks and torch.nn layers), in fp16: the published, stripped form under ``model``,
a checkpoint saved during training under ``ema`` (``model`` None) with the optimizer beside it. Reading it:

1. ``torch.serialization.get_unsafe_globals_in_checkpoint`` lists every global the pickle names, without
   unpickling. Each must be on the allow-list below, else the file is refused in one line naming it (a payload
   such as ``os.system`` or ``builtins.exec`` never reaches the unpickler);
2. ``torch.load(weights_only=True)`` reads the file with those names bound to inert stand-ins: every module
   class becomes a :class:`ModuleRecord` (a class name and an attribute dict; no constructor arguments, nothing
   callable), the argument namespace a dict, paths strings, numpy scalars numbers;
3. the records give the model's own description (its ``yaml`` dict: family, scale, classes), its class names
   and its tensors; our model is built from that description and every tensor must match by name and shape.

Checkpoints of other tasks (segment, pose, OBB, classify, ...) and other detector variants (P2/P6 heads, YOLOv10,
RT-DETR, ...) are refused in one line until they are supported. Ultralytics' training state (optimizer,
epoch) is not ours: such a checkpoint is fine-tuned from (``--weights``), never resumed. Which families' checkpoints
are read is theirs to say (``Family.importers``); the dispatcher (models/families/__init__.py) passes them in.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from models.families.base import CheckpointImporter, Family
from models.families.records import (
    MALFORMED_FILE_ERRORS,
    SAFE_CALLABLES,
    ModuleRecord,
    named_records,
    plain,
    record_state_dict,
)
from models.yolo import build_model
from utils.errors import UserError, describe
from utils.log import LOGGER
from utils.torch_utils import cpu_fp32_state

RELEASES_URL = "https://github.com/ultralytics/assets/releases"

# torch.nn layers an Ultralytics detection model contains (and a pickled loss: BCEWithLogitsLoss).
_TORCH_MODULES = frozenset(
    f"torch.nn.modules.{name}"
    for name in (
        "conv.Conv2d",
        "batchnorm.BatchNorm2d",
        "activation.SiLU",
        "linear.Identity",
        "pooling.MaxPool2d",
        "upsampling.Upsample",
        "container.Sequential",
        "container.ModuleList",
        "loss.BCEWithLogitsLoss",
    )
)
# Module trees: the model, its blocks and head, under the current and the pre-8.1 layout (ultralytics.nn.modules
# was one file); a loss and its assigner pickled with old models, under ultralytics.yolo.* before 8.0.44.
_RECORD_PREFIXES = (
    "ultralytics.nn.",
    "ultralytics.models.loss.",
    "ultralytics.utils.tal.",
    "ultralytics.yolo.models.loss.",
    "ultralytics.yolo.utils.tal.",
)
_NAMESPACES = frozenset({"ultralytics.utils.IterableSimpleNamespace", "ultralytics.yolo.utils.IterableSimpleNamespace"})
_SAFE_CALLABLES = {  # inert readers of paths and numpy scalars
    **{
        f"{module}.{cls}": SAFE_CALLABLES[f"pathlib.{cls}"]
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath")
    },
    "numpy.dtype": SAFE_CALLABLES["numpy.dtype"],
    "numpy.core.multiarray.scalar": SAFE_CALLABLES["numpy.core.multiarray.scalar"],
    "numpy._core.multiarray.scalar": SAFE_CALLABLES["numpy.core.multiarray.scalar"],
}
# Ultralytics model classes of tasks and variants not supported yet, and what to call them.
_OTHER_MODELS = {
    "SegmentationModel": "a segmentation (segment) model",
    "PoseModel": "a pose model",
    "OBBModel": "an OBB model",
    "ClassificationModel": "a classification (classify) model",
    "RTDETRDetectionModel": "an RT-DETR model",
    "WorldModel": "a YOLO-World model",
    "YOLOEModel": "a YOLOE model",
    "YOLOESegModel": "a YOLOE segmentation model",
    "YOLOv10DetectionModel": "a YOLOv10 model",
    "SemanticSegmentationModel": "a semantic segmentation model",
    "DepthModel": "a depth model",
}
# Ultralytics' released weights: <family name><scale>[-<task or variant>].pt for the families read here, and
# its anchor-free YOLOv5 retrain (yolov5su.pt; yolov5s.pt is YOLOv5's own).
_RELEASE_STEM = r"({families})[nsmlx]|yolov5[nsmlx]6?u"
_RELEASE_SUFFIX = r"(-(seg|pose|obb|cls|p2|p6|oiv7))?\.pt"
# What Ultralytics' own non-detection checkpoints name besides their model classes: such a file is reported as
# the task it is rather than as a refused global.
_OTHER_TASK_GLOBALS = frozenset({"builtins.getattr", "__builtin__.getattr"})


class NamespaceRecord(dict):
    """Ultralytics' pickled argument namespace (IterableSimpleNamespace), read as a plain dict."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError("namespace state is not a dict")
        self.update(state)


def _stand_in(qualified_name: str) -> Any:
    """The inert object an allowed global is read as, or None when the name is not allowed."""
    if qualified_name in _SAFE_CALLABLES:
        return _SAFE_CALLABLES[qualified_name]
    if qualified_name in _NAMESPACES:
        return NamespaceRecord
    short = qualified_name.rsplit(".", 1)[-1]
    allowed_record = qualified_name in _TORCH_MODULES or (
        qualified_name.startswith(_RECORD_PREFIXES) and short.isidentifier() and not short.startswith("_")
    )
    if allowed_record:
        return type(short, (ModuleRecord,), {"class_name": qualified_name})
    return None


def pickled_globals(path: Path) -> list[str]:
    """Every global the checkpoint's pickle names (the ones torch does not already allow), read without unpickling."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except MALFORMED_FILE_ERRORS as e:
        raise UserError(f"{path}: not a readable checkpoint ({describe(e)})") from e


def ultralytics_globals(path: Path) -> list[str] | None:
    """The globals a checkpoint names when it names any of Ultralytics' (it is then read here), else None."""
    try:
        names = pickled_globals(path)
    except UserError:  # not a zip checkpoint: not Ultralytics' (the YOLOv5 reader also reads the legacy format)
        return None
    return names if any(n.startswith("ultralytics.") for n in names) else None


def _refuse_other_tasks(path: Path, names: list[str], families: Sequence[Family]) -> None:
    for name in names:
        if name.startswith("ultralytics.nn.tasks.") and name.rsplit(".", 1)[-1] in _OTHER_MODELS:
            what = _OTHER_MODELS[name.rsplit(".", 1)[-1]]
            raise UserError(
                f"{path}: {what} ({name}); only Ultralytics detection checkpoints "
                f"({', '.join(f.title for f in families)}) are supported so far"
            )


def _refuse(path: Path, refused: list[str]) -> NoReturn:
    verb = "is" if len(refused) == 1 else "are"
    raise UserError(
        f"{path}: refused: the file names {', '.join(refused)}, which {verb} not part of an Ultralytics "
        "detection checkpoint (checkpoints never run code here)"
    )


def read_ultralytics(path: str | Path, families: Sequence[Family], names: list[str] | None = None) -> dict[str, Any]:
    """The checkpoint dict with module records in place of Ultralytics' objects; refuses any other global."""
    path = Path(path)
    names = pickled_globals(path) if names is None else names
    refused = [n for n in names if _stand_in(n) is None]
    if not set(refused) <= _OTHER_TASK_GLOBALS:  # a payload is named as such, whatever model it is dressed as
        _refuse(path, refused)
    _refuse_other_tasks(path, names, families)
    if refused:
        _refuse(path, refused)
    stand_ins: list[Any] = [(_stand_in(n), n) for n in names]
    try:
        with torch.serialization.safe_globals(stand_ins):
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the weights_only unpickler raises several types for a malformed file  # noqa: BLE001
        raise UserError(f"{path}: refused: {describe(e)}") from e
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not an Ultralytics checkpoint (the file holds a {type(raw).__name__}, not a dict)")
    return raw


# ---- records -> our checkpoint --------------------------------------------------------------------------------


def _model_record(raw: dict[str, Any], path: Path) -> tuple[str, ModuleRecord]:
    """The model to import: the EMA during training (``model`` is None then), else the (stripped) model."""
    for slot in ("ema", "model"):
        record = raw.get(slot)
        if record is None:
            continue
        if not isinstance(record, ModuleRecord):
            raise UserError(f"{path}: '{slot}' is a {type(record).__name__}, not an Ultralytics model")
        if record.class_name != "ultralytics.nn.tasks.DetectionModel":
            raise UserError(f"{path}: '{slot}' is {record.class_name}; only detection models are supported so far")
        return slot, record
    raise UserError(f"{path}: no model in the checkpoint (both 'ema' and 'model' are empty)")


def _model_config(record: ModuleRecord, path: Path) -> dict[str, Any]:
    """The checkpoint's own model description, checked to be a detector of a supported layout."""
    try:
        cfg = plain(record.attrs.get("yaml"))
    except Exception as e:  # noqa: BLE001  (plain raises UnpicklingError for a module record in the YAML)
        raise UserError(f"{path}: its model description is not plain data ({e})") from e
    if not isinstance(cfg, dict) or not all(k in cfg for k in ("nc", "backbone", "head")):
        raise UserError(f"{path}: the model has no description (a 'yaml' dict with nc, backbone and head)")
    if "anchors" in cfg:
        raise UserError(f"{path}: an anchor-based model in an Ultralytics checkpoint is not supported")
    last = cfg["head"][-1] if cfg["head"] else None
    if not (isinstance(last, list) and len(last) == 4):
        raise UserError(f"{path}: its model description has no head layer")
    sources, head = last[0], str(last[2])
    if head != "Detect":
        raise UserError(
            f"{path}: its head is {head}, not Detect: other tasks and variants (segment, pose, OBB, "
            "classify, YOLOv10, ...) are not supported so far"
        )
    if not isinstance(sources, list) or len(sources) != 3:
        levels = len(sources) if isinstance(sources, list) else 1
        variant = {4: " (a P2 or P6 variant)"}.get(levels, "")
        raise UserError(
            f"{path}: its Detect head has {levels} levels{variant}; only P3-P5 detectors (3 levels) are "
            "supported so far"
        )
    if cfg.get("activation") not in (None, "nn.SiLU()"):
        raise UserError(f"{path}: activation {cfg['activation']!r} is not supported (only the default SiLU)")
    return cfg


def _names(record: ModuleRecord, nc: int, path: Path) -> list[str]:
    names = plain(record.attrs.get("names"))
    if isinstance(names, dict):
        try:
            names = [names[i] for i in range(len(names))]
        except KeyError as e:
            raise UserError(f"{path}: class names are not indexed 0..{len(names) - 1}") from e
    if names is None:
        return [str(i) for i in range(nc)]
    if not isinstance(names, list) or len(names) != nc:
        raise UserError(f"{path}: {len(names) if isinstance(names, list) else 'no'} class names for {nc} classes")
    return [str(n) for n in names]


def _build_and_load(cfg: dict[str, Any], record: ModuleRecord, names: list[str], path: Path) -> torch.nn.Module:
    """Our model from the checkpoint's description with the file's tensors; every tensor must match."""
    try:
        model = build_model(cfg)
    except UserError as e:
        raise UserError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
        raise UserError(f"{path}: its model description does not build here ({e.__class__.__name__}: {e})") from e
    head_key = f"model.{len(model.model) - 1}"
    records = named_records(record)
    head = records.get(head_key)
    if head is None or not head.class_name.endswith(".Detect"):
        raise UserError(f"{path}: layer {head_key} is not a Detect head in the file")
    for attr, ours in (("nc", model.model[-1].nc), ("reg_max", getattr(model.model[-1], "reg_max", None))):
        theirs = head.attrs.get(attr)
        if theirs is not None and int(theirs) != ours:
            raise UserError(f"{path}: the head has {attr}={theirs} but its description builds {attr}={ours}")
    stride = head.attrs.get("stride")
    if not isinstance(stride, torch.Tensor) or not torch.equal(stride.float().view(-1), model.stride.float().view(-1)):
        raise UserError(
            f"{path}: the head's strides {getattr(stride, 'tolist', lambda: stride)()} differ from "
            f"{model.stride.tolist()} of its description"
        )

    state = record_state_dict(record)
    own = model.state_dict()
    for key in own:
        if key not in state and key.startswith(f"{head_key}.") and key.rsplit(".", 1)[-1] == "stride":
            state[key] = stride  # a plain attribute in Ultralytics' head, a buffer in ours
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong_shape:
        problems = [
            f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
            if keys
        ]
        raise UserError(
            f"{path}: its tensors do not match the model built from its description ({'; '.join(problems)})"
        )
    modules = dict(model.named_modules())
    for name, rec in records.items():
        if rec.class_name.endswith(".BatchNorm2d"):
            mine, eps = modules.get(name), rec.attrs.get("eps")
            if not isinstance(mine, torch.nn.BatchNorm2d) or (eps is not None and abs(float(eps) - mine.eps) > 1e-12):
                raise UserError(
                    f"{path}: layer {name}: BatchNorm eps {eps} differs from this project's "
                    f"{getattr(mine, 'eps', None)}"
                )
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    model.names = names
    return model


def _family(cfg: dict[str, Any], families: Sequence[Family], path: Path) -> Family:
    """The family of a checkpoint's own description, among those read here (most specific first)."""
    for family in families:
        if family.recognizes(cfg):
            return family
    raise UserError(
        f"{path}: a detector of none of the families read from Ultralytics checkpoints here "
        f"({', '.join(f.title for f in families)})"
    )


def convert_ultralytics(raw: dict[str, Any], path: str | Path, families: Sequence[Family]) -> dict[str, Any]:
    """Our checkpoint dict (``model_cfg``, ``names``, fp32 ``model``, ``source``) from a :func:`read_ultralytics`."""
    path = Path(path)
    slot, record = _model_record(raw, path)
    cfg = _model_config(record, path)
    family = _family(cfg, families, path)
    cfg = {**cfg, "family": family.name}
    names = _names(record, int(cfg["nc"]), path)
    model = _build_and_load(cfg, record, names, path)
    dtype = next(iter(record_state_dict(record).values())).dtype
    meta = {k: plain(raw[k]) for k in ("version", "date", "epoch") if isinstance(raw.get(k), (str, int))}
    meta["slot"] = slot
    n = len(model.state_dict())
    LOGGER.info(
        f"{path}: Ultralytics {family.name} checkpoint imported (scale {cfg.get('scale', '?')}, {len(names)} "
        f"classes, '{slot}' weights, {str(dtype).replace('torch.', '')}, {n}/{n} tensors matched"
        f"{', Ultralytics ' + meta['version'] if 'version' in meta else ''}); nothing in it was executed"
    )
    return {
        "model_cfg": model.yaml,
        "names": names,
        "model": cpu_fp32_state(model),
        "ema": None,
        "source": UltralyticsImporter.source,  # resuming refuses it: Ultralytics' training state is not ours
        UltralyticsImporter.source: meta,
    }


class UltralyticsImporter(CheckpointImporter):
    """Ultralytics' detection checkpoints: files whose pickle names any of Ultralytics' globals."""

    source = "ultralytics"
    title = "Ultralytics"
    possessive = "Ultralytics'"

    def read(self, path: Path, families: Sequence[Family]) -> dict[str, Any] | None:
        names = ultralytics_globals(path)
        if names is None:
            return None
        return convert_ultralytics(read_ultralytics(path, families, names), path, families)

    def missing_file_hint(self, file_name: str, families: Sequence[Family]) -> str | None:
        stems = _RELEASE_STEM.format(families="|".join(re.escape(f.name) for f in families))
        if not re.fullmatch(f"({stems}){_RELEASE_SUFFIX}", file_name, re.IGNORECASE):
            return None
        return (
            f"nothing is downloaded here: {file_name} is one of Ultralytics' released weights, assets of "
            f"{RELEASES_URL}; download it yourself and pass its path"
        )

    def export_family(self, description: str, families: Sequence[Family]) -> Family:
        """The family of a file Ultralytics' exporter wrote, from the model name in its description ("Ultralytics
        YOLO11n model ..."): the family whose name, YOLO-cased, it holds; else the least specific of ``families``
        (listed most specific first; the anchor-free families decode alike)."""
        for family in families:
            if re.search(rf"\b{re.escape(family.name.replace('yolo', 'YOLO', 1))}[nsmlx]?\b", description):
                return family
        return families[-1]


ULTRALYTICS_IMPORTER = UltralyticsImporter()
