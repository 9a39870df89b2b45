"""One inference interface over the weight files detect.py and val.py accept.

* ``.pt``: a checkpoint of this project or a YOLOv5 v6+ checkpoint (imported safely), run with PyTorch;
* ``.onnx``: written by export.py, run with onnxruntime (imported only when such a file is given);
* ``.torchscript``: written by export.py, run with ``torch.jit.load``.

Every backend returns the decoded predictions ``(batch, anchors, 5 + nc)`` in input pixels, the tensor NMS takes.
Exported files carry their metadata (class names, stride, input shape, whether the batch is dynamic), so a
file is self-describing, as YOLOv5's are.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from utils.errors import UserError

METADATA_FILE = "config.txt"  # the TorchScript extra file holding the metadata (YOLOv5's name for it)
SUFFIXES = (".pt", ".onnx", ".torchscript")


@dataclass
class ModelMeta:
    """What an inference caller needs besides the network."""

    names: list[str]
    stride: int
    kind: str  # "pytorch", "onnx" or "torchscript"
    imgsz: tuple[int, int] | None = None  # (h, w) the file only accepts, None when any multiple of the stride fits
    batch: int | None = None  # the batch size the file only accepts, None when any
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nc(self) -> int:
        return len(self.names)

    def to_json(self) -> str:
        return json.dumps({"names": self.names, "stride": self.stride, "imgsz": self.imgsz, "batch": self.batch,
                           "producer": "yolo-train export.py", **self.extra})

    @classmethod
    def from_json(cls, text: str, kind: str, path: Path) -> ModelMeta:
        try:
            raw = json.loads(text)
            names, stride = [str(n) for n in raw["names"]], int(raw["stride"])
            imgsz = tuple(int(v) for v in raw["imgsz"]) if raw.get("imgsz") else None
            batch = int(raw["batch"]) if raw.get("batch") else None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: metadata unreadable ({e.__class__.__name__}: {e}); re-export it with export.py")
        return cls(names=names, stride=stride, kind=kind, imgsz=imgsz, batch=batch)


class PredictionsOnly(nn.Module):
    """A detector's decoded predictions alone: what is exported (YOLOv5 exports the same single output)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]


class OnnxRuntimeModel(nn.Module):
    """An ONNX file run by onnxruntime, called like a module: float tensor in, predictions tensor out."""

    def __init__(self, path: Path, device: torch.device):
        super().__init__()
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise UserError(f"{path}: running ONNX files needs onnxruntime (pip install onnxruntime)") from e
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = ort.InferenceSession(str(path), providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for bad files  # noqa: BLE001
            raise UserError(f"{path}: onnxruntime cannot open it ({e.__class__.__name__}: {str(e).splitlines()[0]})")
        self.input_name = self.session.get_inputs()[0].name
        self.metadata = self.session.get_modelmeta().custom_metadata_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (out,) = self.session.run(None, {self.input_name: x.detach().cpu().float().numpy()})[:1]
        return torch.from_numpy(np.asarray(out)).to(x.device)


class TorchScriptModel(nn.Module):
    """A traced TorchScript file; its metadata comes from the extra file export.py stores in it."""

    def __init__(self, path: Path, device: torch.device):
        super().__init__()
        extra = {METADATA_FILE: ""}
        try:
            with warnings.catch_warnings():  # torch.jit is deprecated, but TorchScript files need it
                warnings.simplefilter("ignore", FutureWarning)
                self.module = torch.jit.load(str(path), map_location=device, _extra_files=extra)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"{path}: not a readable TorchScript file ({str(e).splitlines()[0]})") from e
        self.metadata = extra[METADATA_FILE]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class FixedBatch(nn.Module):
    """Run a file exported for batch ``size`` on any batch: split larger ones, pad the last with blank images."""

    def __init__(self, runner: nn.Module, size: int):
        super().__init__()
        self.runner, self.size = runner, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk in x.split(self.size):
            n = len(chunk)
            if n < self.size:
                chunk = torch.cat([chunk, chunk.new_zeros(self.size - n, *chunk.shape[1:])])
            outputs.append(self.runner(chunk)[:n])
        return torch.cat(outputs)


def load_for_inference(weights: str | Path, device: torch.device | str = "cpu",
                       fuse: bool = True) -> tuple[nn.Module, ModelMeta]:
    """The model behind ``weights`` in eval mode and its metadata. PyTorch models keep returning (pred, raw)."""
    path, device = Path(weights), torch.device(device)
    if not path.is_file():
        raise UserError(f"{path}: weights file not found")
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        model = OnnxRuntimeModel(path, device)
        if not model.metadata.get("names"):
            raise UserError(f"{path}: no class names in its metadata; export it with export.py")
        meta = ModelMeta.from_json(json.dumps({k: json.loads(v) for k, v in model.metadata.items()
                                               if k in ("names", "stride", "imgsz", "batch")}), "onnx", path)
        return (FixedBatch(model, meta.batch) if meta.batch else model).eval(), meta
    if suffix == ".torchscript":
        model = TorchScriptModel(path, device)
        if not model.metadata:
            raise UserError(f"{path}: no metadata ({METADATA_FILE}) in it; export it with export.py")
        meta = ModelMeta.from_json(model.metadata, "torchscript", path)
        return (FixedBatch(model, meta.batch) if meta.batch else model).eval(), meta
    if suffix != ".pt":
        raise UserError(f"{path}: unknown weights format (expected {', '.join(SUFFIXES)})")
    from models.loading import load_model

    model, _ = load_model(path, device)
    model = model.float()
    if fuse:
        model.fuse()
    return model.eval(), ModelMeta(names=list(model.names), stride=int(model.stride.max()), kind="pytorch")


def predictions(output: Any) -> torch.Tensor:
    """The decoded predictions from any backend's output: a tensor, or PyTorch's (pred, raw) pair."""
    return output[0] if isinstance(output, (tuple, list)) else output
