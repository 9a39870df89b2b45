"""What INT8 writers share: the family's ``Int8Scope`` mapped to the node names of a traced graph, and calibration
images grouped into the exported batch.

A scope names PyTorch modules of the detector (``model.23``, ``model.23.dfl``); a traced graph names its nodes
after the modules of the traced wrapper (``model.model.23``: the export module holds the detector as ``model``).
``ScopeMatcher`` takes the qualified name of the module that owns a node and says whether the node stays float.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch.nn as nn

from models.families import Int8Scope
from utils.errors import UserError
from utils.formats.base import ExportJob

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def prefix_of(traced: nn.Module, detector: nn.Module) -> str:
    """The qualified name of ``detector`` inside ``traced`` ('' when it is the traced module itself): the detector
    itself, or the one module of its class (an end-to-end export module holds a switched copy)."""
    same_class = []
    for name, module in traced.named_modules():
        if module is detector:
            return name
        if type(module) is type(detector):
            same_class.append(name)
    if len(same_class) != 1:
        raise ValueError(f"no single {type(detector).__name__} in the traced module to map the INT8 scope onto")
    return same_class[0]


@dataclass(frozen=True)
class ScopeMatcher:
    """Whether the operation owned by a module (qualified in the traced wrapper) stays float."""

    whole: tuple[str, ...]  # modules whose whole subtree stays float
    own: tuple[str, ...]  # modules whose own operations (outside their children) stay float
    op_types: tuple[str, ...]  # ONNX operator types kept float anywhere under ``own``

    @classmethod
    def of(cls, scope: Int8Scope, traced: nn.Module, detector: nn.Module, logits: bool) -> ScopeMatcher:
        """``logits``: whether the scope's logits (the head's prediction convolutions) stay float too."""
        prefix = prefix_of(traced, detector)
        full = lambda name: ".".join(part for part in (prefix, name) if part)  # noqa: E731 ('' is the detector)
        whole = (*scope.modules, *(scope.logits if logits else ()))
        return cls(tuple(map(full, whole)), tuple(map(full, scope.decoding)), tuple(scope.op_types))

    def keeps_float(self, owner: str, op_type: str | None = None) -> bool:
        under = lambda roots: any(owner == r or owner.startswith(r + ".") for r in roots)  # noqa: E731
        return owner in self.own or under(self.whole) or (op_type in self.op_types and under(self.own))


def onnx_owner(node_name: str, modules: dict[str, nn.Module]) -> str:
    """The qualified name of the module owning an ONNX node of torch.onnx's TorchScript-based exporter:
    '/model/model.23/cv2.0/cv2.0.2/conv/Conv' -> 'model.model.23.cv2.0.2.conv'. That exporter names each scope
    level relative to the nearest ancestor that is not a container (Sequential, ModuleList, ModuleDict)."""
    base = qualified = ""
    for part in node_name.strip("/").split("/")[:-1]:
        qualified = f"{base}.{part}" if base else part
        if not isinstance(modules.get(qualified), _CONTAINERS):
            base = qualified
    return qualified


def openvino_owner(friendly_name: str) -> str:
    """The qualified module name in an OpenVINO operation's friendly name after conversion from PyTorch:
    '__module.model.model.23.dfl.conv/aten::_convolution/Convolution' -> 'model.model.23.dfl.conv' ('' when the
    name carries none)."""
    if not friendly_name.startswith("__module."):
        return ""
    return friendly_name[len("__module.") :].split("/", 1)[0]


def calibration_batches(job: ExportJob, n: int | None = None) -> Iterator[np.ndarray]:
    """Calibration images (float32, [0, 1]) in batches the file accepts: the export batch when it is fixed, one
    image otherwise. A last incomplete batch is dropped."""
    if job.calibration is None:
        raise UserError(f"{job.path}: INT8 needs calibration images (export.py --int8 --data)")
    size = job.export_batch if job.meta.batch else 1
    pending: list[np.ndarray] = []
    for image in job.calibration.images(n or job.calibration.size):
        pending.append(image)
        if len(pending) == size:
            yield np.concatenate(pending)
            pending = []
