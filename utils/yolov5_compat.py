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

import collections
import pickle
import types
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
import torch

from models.yolo import Model
from utils.errors import UserError
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
_MODULE_ALIASES = {"__builtin__": "builtins", "copy_reg": "copyreg", "numpy._core.multiarray": "numpy.core.multiarray",
                   "pathlib._local": "pathlib"}
_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex: never objects, strings or records


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list."""

    def __init__(self, qualified_name: str):
        super().__init__(qualified_name)
        self.qualified_name = qualified_name


class ModuleRecord:
    """An inert stand-in for a pickled ``nn.Module``: the class it named and its attribute dict."""

    class_name = "?"

    def __new__(cls, *args: Any) -> ModuleRecord:
        if args:
            raise pickle.UnpicklingError(f"{cls.class_name}: unexpected constructor arguments")
        record = object.__new__(cls)
        record.attrs = {}
        return record

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.class_name}: state is not a dict")
        self.attrs = state

    @property
    def short_name(self) -> str:
        return self.class_name.rsplit(".", 1)[-1]

    def children(self) -> dict[str, ModuleRecord]:
        return {k: v for k, v in self.attrs.get("_modules", {}).items() if v is not None}

    def __repr__(self) -> str:
        return f"ModuleRecord({self.class_name})"


def _record_class(qualified_name: str) -> type[ModuleRecord]:
    return type(qualified_name.rsplit(".", 1)[-1], (ModuleRecord,), {"class_name": qualified_name})


_RECORD_CLASSES = {name: _record_class(name) for name in _MODULE_CLASSES}


class NumpyDtypeRecord:
    """``numpy.dtype(spec, align, copy)`` and its pickled state, turned into a dtype only for numeric kinds."""

    def __init__(self, *args: Any):
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def to_numpy(self) -> np.dtype:
        spec = self.args[0] if self.args else None
        if not isinstance(spec, str) or len(spec) > 8:
            raise pickle.UnpicklingError(f"numpy dtype {spec!r} refused")
        dtype = np.dtype(spec)
        if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None:
            raise pickle.UnpicklingError(f"numpy dtype {spec!r} refused: only numeric dtypes are read")
        order = self.state[1] if isinstance(self.state, tuple) and len(self.state) > 1 else "="
        return dtype.newbyteorder(order) if order in ("<", ">") else dtype


class NumpyArrayRecord:
    """A pickled numeric ``numpy.ndarray``: its shape, dtype and raw bytes."""

    def __init__(self) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def to_numpy(self) -> np.ndarray:
        if not isinstance(self.state, tuple) or len(self.state) != 5:
            raise pickle.UnpicklingError("numpy array: unexpected state")
        _, shape, dtype, fortran, raw = self.state
        if not isinstance(dtype, NumpyDtypeRecord) or not isinstance(raw, bytes) or not isinstance(shape, tuple):
            raise pickle.UnpicklingError("numpy array: only numeric arrays stored as bytes are read")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise pickle.UnpicklingError("numpy array: bad shape")
        values = np.frombuffer(raw, dtype=dtype.to_numpy())
        return values.reshape(shape, order="F" if fortran else "C").copy()


_NDARRAY_CLASS = object()  # what ("numpy", "ndarray") resolves to: only _reconstruct accepts it


def _ndarray_reconstruct(cls: Any, shape: Any, code: Any) -> NumpyArrayRecord:
    if cls is not _NDARRAY_CLASS:
        raise pickle.UnpicklingError("numpy _reconstruct: only plain ndarrays are read")
    return NumpyArrayRecord()


def _numpy_scalar(dtype: Any, data: Any = None) -> int | float | complex | bool:
    if not isinstance(dtype, NumpyDtypeRecord) or not isinstance(data, bytes):
        raise pickle.UnpicklingError("numpy scalar: only numeric scalars are read")
    dt = dtype.to_numpy()
    if len(data) != dt.itemsize:
        raise pickle.UnpicklingError("numpy scalar: wrong byte count")
    return np.frombuffer(data, dtype=dt)[0].item()


def _posix_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("pathlib path: parts must be strings")
    return str(PurePosixPath(*parts))


def _windows_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("pathlib path: parts must be strings")
    return str(PureWindowsPath(*parts))


def _latin1_bytes(text: Any, encoding: Any = "utf-8") -> bytes:
    # Pickle protocol 2 (torch.save's default) writes bytes objects as _codecs.encode(str, 'latin1').
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode: only latin1 text is read")
    return text.encode("latin1")


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None,
            metadata: Any = None) -> torch.Tensor:
    # Backward hooks and tensor metadata from the file are dropped: only the values are needed.
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError("tensor: storage expected")
    if not isinstance(offset, int) or not isinstance(size, tuple) or not isinstance(stride, tuple):
        raise pickle.UnpicklingError("tensor: bad offset, size or stride")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, collections.OrderedDict())


def _parameter(data: Any, requires_grad: Any = False, hooks: Any = None, state: Any = None) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("parameter: tensor expected")
    return data


def _set(*args: Any) -> set:
    return set(*args)


def _frozenset(*args: Any) -> frozenset:
    return frozenset(*args)


_CALLABLES: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": _set,
    "builtins.frozenset": _frozenset,
    "_codecs.encode": _latin1_bytes,
    "torch._utils._rebuild_tensor_v2": _tensor,
    "torch._utils._rebuild_parameter": _parameter,
    "torch._utils._rebuild_parameter_with_state": _parameter,
    "pathlib.Path": _posix_path,
    "pathlib.PosixPath": _posix_path,
    "pathlib.PurePosixPath": _posix_path,
    "pathlib.WindowsPath": _windows_path,
    "pathlib.PureWindowsPath": _windows_path,
    "numpy.dtype": NumpyDtypeRecord,
    "numpy.ndarray": _NDARRAY_CLASS,
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy.core.multiarray._reconstruct": _ndarray_reconstruct,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed globals above; everything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{_MODULE_ALIASES.get(module, module)}.{name}"
        if qualified in _CALLABLES:
            return _CALLABLES[qualified]
        if qualified in _RECORD_CLASSES:
            return _RECORD_CLASSES[qualified]
        raise RefusedGlobal(f"{module}.{name}")


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return RestrictedUnpickler(file, **kwargs).load()


# torch.load(pickle_module=...) needs an object with Unpickler and load (the latter for the legacy format).
RESTRICTED_PICKLE = types.SimpleNamespace(__name__="yolov5_restricted_pickle", Unpickler=RestrictedUnpickler,
                                          load=_restricted_load)


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
        raise UserError(f"{path}: refused: {e}") from e
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a readable checkpoint ({e.__class__.__name__}: {str(e).splitlines()[0]})") from e


# ---- records -> plain values -----------------------------------------------------------------------------

def plain(value: Any) -> Any:
    """Containers, numbers, strings and tensors as they are; numpy records as lists or numbers.

    Module records are refused: they belong in ``model``/``ema`` only. The result is safe for
    ``torch.save`` and loads back with ``weights_only=True``.
    """
    if isinstance(value, (str, int, float, bool, type(None), torch.Tensor, bytes)):
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, NumpyArrayRecord):
        array = value.to_numpy()
        return array.item() if array.size == 1 else array.tolist()
    if isinstance(value, NumpyDtypeRecord):
        return str(value.to_numpy())
    raise pickle.UnpicklingError(f"unexpected {type(value).__name__} outside the model")


def record_state_dict(record: ModuleRecord, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state_dict a module record would have: parameters and persistent buffers, recursively by name."""
    state: dict[str, torch.Tensor] = {}
    non_persistent = record.attrs.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        entries = record.attrs.get(group) or {}
        if not isinstance(entries, dict):
            raise pickle.UnpicklingError(f"{prefix or 'model'}: {group} is not a dict")
        for name, tensor in entries.items():
            if tensor is None or (group == "_buffers" and name in non_persistent):
                continue
            if not isinstance(tensor, torch.Tensor):
                raise pickle.UnpicklingError(f"{prefix}{name}: not a tensor")
            state[f"{prefix}{name}"] = tensor
    for name, child in record.children().items():
        if not isinstance(child, ModuleRecord):
            raise pickle.UnpicklingError(f"{prefix}{name}: not a module")
        state.update(record_state_dict(child, f"{prefix}{name}."))
    return state


def _named_records(record: ModuleRecord, prefix: str = "") -> dict[str, ModuleRecord]:
    out = {prefix: record}
    for name, child in record.children().items():
        out.update(_named_records(child, f"{prefix}.{name}" if prefix else name))
    return out


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
    theirs = _named_records(record)
    for name in sorted(set(ours) | set(theirs)):
        mine, rec = ours.get(name), theirs.get(name)
        where = name or "the model"
        if mine is None or rec is None:
            missing = "in the file" if rec is None else "in the model built from its YAML"
            raise UserError(f"{path}: layer {where} ({type(mine).__name__ if mine else rec.short_name}) "
                            f"is missing {missing}; is the model fused or modified?")
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
    head = _named_records(record).get(head_key)
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
        problems = [f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                    for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
                    if keys]
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
    meta = {k: plain(raw.get(k)) for k in ("epoch", "best_fitness", "updates", "opt", "train_args", "git", "date")
            if k in raw}
    n_tensors = len(model.state_dict())
    LOGGER.info(f"{path}: YOLOv5 checkpoint imported ({model.yaml.get('yaml_file', 'model')}, {model.nc} classes, "
                f"{model.model[-1].nl} levels, {str(dtype).replace('torch.', '')}, {n_tensors}/{n_tensors} tensors "
                f"matched{', with EMA' if ema is not None else ''}); nothing in it was executed")
    return {
        "model_cfg": model.yaml,
        "names": names,
        "model": cpu_fp32_state(model),
        "ema": ema,
        "source": "yolov5",  # utils/checkpoint.py's resume rules read it: YOLOv5's training state is not ours
        "yolov5": meta,
    }


def load_yolov5_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a YOLOv5 ``.pt`` safely and return it as a checkpoint dict of this project."""
    return convert_yolov5(read_restricted(path), path)
