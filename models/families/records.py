"""Reading pickled checkpoints of other tools as inert records: the pieces every importer shares.

A checkpoint of YOLOv5 or Ultralytics pickles its model as objects of that tool's classes. Importers here never
let the unpickler create them: each allowed global resolves to an inert stand-in. Module classes become
:class:`ModuleRecord` objects (a class name and an attribute dict, nothing callable); tensors are rebuilt from the
file's storages as plain tensors; ``pathlib`` paths become strings, numpy scalars Python numbers and numeric numpy
arrays inert records (``SAFE_CALLABLES``). :func:`plain` and :func:`record_state_dict` then turn records into plain
values and a state_dict. Which names each tool's files may use is the importer's allow-list
(models/families/yolov5_import.py, models/families/ultralytics_import.py).
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
import torch

MODULE_ALIASES = {
    "__builtin__": "builtins",
    "copy_reg": "copyreg",
    "numpy._core.multiarray": "numpy.core.multiarray",
    "pathlib._local": "pathlib",
}
# What torch.load, its weights-only unpickler and pickletools raise for a file that is not a well-formed
# checkpoint (an empty or truncated pickle, pickle protocol 0 text, a cut zip, an opcode stream that means nothing):
# each is the user's broken file, reported in one line, never a traceback. torch asserts on the persistent ids of a
# pickle written with protocol 0, hence AssertionError.
MALFORMED_FILE_ERRORS = (
    pickle.UnpicklingError,
    AssertionError,
    EOFError,
    IndexError,
    KeyError,
    struct.error,
    ValueError,
    TypeError,
    AttributeError,
    RuntimeError,
    OSError,
    OverflowError,
    RecursionError,
    NotImplementedError,
    zipfile.BadZipFile,
    MemoryError,
)
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


def record_class(qualified_name: str) -> type[ModuleRecord]:
    return type(qualified_name.rsplit(".", 1)[-1], (ModuleRecord,), {"class_name": qualified_name})


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
        return dtype.newbyteorder("<" if order == "<" else ">") if order in ("<", ">") else dtype


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


def _tensor(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    hooks: Any = None,
    metadata: Any = None,
) -> torch.Tensor:
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


SAFE_CALLABLES: dict[str, Any] = {
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


def named_records(record: ModuleRecord, prefix: str = "") -> dict[str, ModuleRecord]:
    out = {prefix: record}
    for name, child in record.children().items():
        if isinstance(child, ModuleRecord):
            out.update(named_records(child, f"{prefix}.{name}" if prefix else name))
    return out
