"""One inference interface over the weight files detect.py and val.py accept.

* ``.pt``: a checkpoint of this project, or a YOLOv5 v6+ or Ultralytics (YOLOv8 / YOLO11 / YOLO26) detection
  checkpoint (imported safely), run with PyTorch;
* ``.onnx``: written by export.py (or by Ultralytics' exporter), run with onnxruntime (imported only when such a
  file is given);
* ``.torchscript``: written by export.py, run with ``torch.jit.load``.

Every backend returns the decoded predictions in input pixels, in its model's layout (``ModelMeta.layout``):
``"yolov5"`` (batch, anchors, 5 + nc) with objectness; ``"anchor_free"`` (batch, 4 + nc, anchors), YOLOv8 / 11 /
26; ``"end2end"`` (batch, k, 6) = x1 y1 x2 y2 score class, YOLO26's NMS-free one-to-one head. :func:`detections`
turns any of them into boxes. Exported files carry their metadata (class names, stride, input shape, batch,
family, layout), with the keys and value forms Ultralytics' exporter writes (``names`` as ``{0: 'person', ...}``,
``stride``, ``task``, ``batch``, ``imgsz``, ``end2end``, ...) so apps written for its files read ours, and this
project's own record under ``yolo_train``.
"""
from __future__ import annotations

import ast
import json
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.families import (UNRECORDED_EXPORT_FAMILY, family_of, known_layouts, missing_weights_message,
                             ultralytics_export_family)
from utils.cli import INFERENCE_IMGSZ
from utils.errors import UserError

METADATA_FILE = "config.txt"  # the TorchScript extra file holding the metadata (YOLOv5's and Ultralytics' name)
OWN_METADATA_KEY = "yolo_train"  # this project's record among the exported metadata
SUFFIXES = (".pt", ".onnx", ".torchscript")
LAYOUTS = known_layouts()


@dataclass
class ModelMeta:
    """What an inference caller needs besides the network."""

    names: list[str]
    stride: int
    kind: str  # "pytorch", "onnx" or "torchscript"
    imgsz: tuple[int, int] | None = None  # (h, w) the file only accepts, None when any multiple of the stride fits
    batch: int | None = None  # the batch size the file only accepts, None when any
    family: str = UNRECORDED_EXPORT_FAMILY.name  # models/families/' name; for files exported before it was recorded
    layout: str = UNRECORDED_EXPORT_FAMILY.layouts[0]  # see LAYOUTS and the module docstring
    trained_imgsz: int | None = None  # the image size a .pt was trained at, when its checkpoint says
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nc(self) -> int:
        return len(self.names)

    def own_record(self) -> dict[str, Any]:
        return {"names": self.names, "stride": self.stride, "imgsz": self.imgsz, "batch": self.batch,
                "family": self.family, "layout": self.layout, "producer": "yolo-train export.py", **self.extra}

    def ultralytics_style(self, export_batch: int) -> dict[str, Any]:
        """The metadata keys and values Ultralytics' exporter writes for a detection model."""
        return {
            "description": f"{self.family} detection model exported by yolo-train export.py",
            "author": "yolo-train",
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "version": "yolo-train",
            "stride": self.stride,
            "task": "detect",
            "batch": export_batch,
            "imgsz": list(self.imgsz) if self.imgsz else None,
            "names": dict(enumerate(self.names)),
            "channels": 3,
            "end2end": self.layout == "end2end",
        }

    def to_json(self, export_batch: int = 1) -> str:
        """The TorchScript extra file: Ultralytics' keys (JSON, as its exporter writes them) and ours."""
        return json.dumps({**self.ultralytics_style(export_batch), OWN_METADATA_KEY: self.own_record()})

    def onnx_props(self, export_batch: int = 1) -> dict[str, str]:
        """ONNX metadata_props: Ultralytics' keys with values as ``str()`` of Python values (as it writes them,
        read back there with ``ast.literal_eval``), and ours as JSON."""
        props = {k: str(v) for k, v in self.ultralytics_style(export_batch).items()}
        return {**props, OWN_METADATA_KEY: json.dumps(self.own_record())}

    @classmethod
    def from_record(cls, raw: dict[str, Any], kind: str, path: Path) -> ModelMeta:
        """From this project's record, or the flat JSON of files exported before it had one (YOLOv5 layout)."""
        try:
            names, stride = [str(n) for n in raw["names"]], int(raw["stride"])
            imgsz = tuple(int(v) for v in raw["imgsz"]) if raw.get("imgsz") else None
            batch = int(raw["batch"]) if raw.get("batch") else None
            family = str(raw.get("family", UNRECORDED_EXPORT_FAMILY.name))
            layout = str(raw.get("layout", UNRECORDED_EXPORT_FAMILY.layouts[0]))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: metadata unreadable ({e.__class__.__name__}: {e}); re-export it with export.py")
        if layout not in LAYOUTS:
            raise UserError(f"{path}: unknown output layout {layout!r} in its metadata (known: {', '.join(LAYOUTS)})")
        return cls(names=names, stride=stride, kind=kind, imgsz=imgsz, batch=batch, family=family, layout=layout)

    @classmethod
    def from_json(cls, text: str, kind: str, path: Path) -> ModelMeta:
        """From a TorchScript file's JSON: our record; else Ultralytics' keys; else older exports' flat record."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise UserError(f"{path}: metadata unreadable ({e}); re-export it with export.py") from e
        if not isinstance(raw, dict):
            raise UserError(f"{path}: metadata unreadable (not a JSON object); re-export it with export.py")
        if OWN_METADATA_KEY in raw:
            return cls.from_record(raw[OWN_METADATA_KEY], kind, path)
        return cls.from_ultralytics(raw, kind, path) if "task" in raw else cls.from_record(raw, kind, path)

    @classmethod
    def from_onnx_props(cls, props: dict[str, str], path: Path) -> ModelMeta:
        """From our record; else the flat JSON values of older exports; else Ultralytics' own props."""
        if OWN_METADATA_KEY in props:
            return cls.from_json(props[OWN_METADATA_KEY], "onnx", path)
        if not props.get("names"):
            raise UserError(f"{path}: no class names in its metadata; export it with export.py")
        try:
            return cls.from_record({k: json.loads(v) for k, v in props.items()
                                    if k in ("names", "stride", "imgsz", "batch")}, "onnx", path)
        except ValueError:  # not JSON: Ultralytics' exporter writes Python literals
            pass
        try:  # literal_eval reads literals only, never calls anything
            values = {k: ast.literal_eval(v) if k in ("names", "imgsz", "end2end", "args") else v
                      for k, v in props.items()}
        except (ValueError, SyntaxError) as e:
            raise UserError(f"{path}: metadata unreadable ({e.__class__.__name__}: {e})") from e
        return cls.from_ultralytics(values, "onnx", path)

    @classmethod
    def from_ultralytics(cls, values: dict[str, Any], kind: str, path: Path) -> ModelMeta:
        """From the metadata Ultralytics' exporter writes, its values already parsed."""
        task = values.get("task", "detect")
        if task != "detect":
            raise UserError(f"{path}: an Ultralytics {task} model; only detection models are supported")
        names = values.get("names")
        if isinstance(names, dict):  # {0: 'person', ...}; JSON makes the keys strings
            names = [names[k] for k in sorted(names, key=int)]
        args = values.get("args") if isinstance(values.get("args"), dict) else {}
        family = ultralytics_export_family(str(values.get("description", ""))).name
        return cls.from_record({"names": names, "stride": values.get("stride", 32), "imgsz": values.get("imgsz"),
                                "batch": None if args.get("dynamic") else values.get("batch"), "family": family,
                                "layout": "end2end" if values.get("end2end") in (True, "True") else "anchor_free"},
                               kind, path)


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
        self.input_dtype = np.float16 if self.session.get_inputs()[0].type == "tensor(float16)" else np.float32
        self.metadata = self.session.get_modelmeta().custom_metadata_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (out,) = self.session.run(None, {self.input_name: x.detach().cpu().numpy().astype(self.input_dtype)})[:1]
        return torch.from_numpy(np.asarray(out)).float().to(x.device)  # an fp16 file (export --half) too


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


def output_layout(model: nn.Module) -> str:
    """A PyTorch model's prediction layout (see LAYOUTS) as it is set now."""
    return family_of(model).layout(model)


def use_end_to_end_head(model: nn.Module, weights: str | Path) -> None:
    """Switch a model to its NMS-free output (B, 300, 6); one line for a family that has none."""
    family_of(model).use_end_to_end(model, weights)


def load_for_inference(weights: str | Path, device: torch.device | str = "cpu", fuse: bool = True,
                       end2end: bool = False) -> tuple[nn.Module, ModelMeta]:
    """The model behind ``weights`` in eval mode and its metadata. PyTorch models keep returning (pred, raw).

    ``end2end``: YOLO26's NMS-free output (a .pt is switched to it; an exported file must have been exported so).
    """
    path, device = Path(weights), torch.device(device)
    if not path.is_file():
        raise UserError(missing_weights_message(path, "weights file"))
    suffix = path.suffix.lower()
    if suffix in (".onnx", ".torchscript"):
        if suffix == ".onnx":
            model = OnnxRuntimeModel(path, device)
            meta = ModelMeta.from_onnx_props(model.metadata, path)
        else:
            model = TorchScriptModel(path, device)
            if not model.metadata:
                raise UserError(f"{path}: no metadata ({METADATA_FILE}) in it; export it with export.py")
            meta = ModelMeta.from_json(model.metadata, "torchscript", path)
        if end2end and meta.layout != "end2end":
            raise UserError(f"--end2end: {path} was exported with the {meta.layout} output; export it with --end2end")
        return (FixedBatch(model, meta.batch) if meta.batch else model).eval(), meta
    if suffix != ".pt":
        raise UserError(f"{path}: unknown weights format (expected {', '.join(SUFFIXES)})")
    from models.loading import load_model

    from utils.checkpoint import trained_imgsz

    model, ckpt = load_model(path, device)
    model = model.float()
    if end2end:
        use_end_to_end_head(model, path)
    if fuse:
        model.fuse()
    return model.eval(), ModelMeta(names=list(model.names), stride=int(model.stride.max()), kind="pytorch",
                                   family=family_of(model).name, layout=output_layout(model),
                                   trained_imgsz=trained_imgsz(ckpt))


def detections(meta: ModelMeta, pred: torch.Tensor, conf_thres: float, iou_thres: float | None = None, *,
               classes: list[int] | None = None, agnostic: bool = False, multi_label: bool = False,
               max_det: int = 300) -> list[torch.Tensor]:
    """Per image (n, 6) = x1 y1 x2 y2 conf cls, best first: the family's decoding of predictions (NMS, or only a
    confidence filter for an end-to-end output), at ``iou_thres`` or the family's detect.py default."""
    family = family_of(meta.family)
    iou = family.detect_iou if iou_thres is None else iou_thres
    return family.detections(pred, conf_thres, iou, classes=classes, agnostic=agnostic, multi_label=multi_label,
                             max_det=max_det)


def default_imgsz(meta: ModelMeta) -> tuple[int, str]:
    """The inference size when --imgsz is left out, and where it comes from (for the one log line)."""
    if meta.imgsz is not None:
        return max(meta.imgsz), "from the exported file"
    if meta.trained_imgsz is not None:
        return meta.trained_imgsz, "from the checkpoint"
    return INFERENCE_IMGSZ, "the default; the checkpoint does not record its training size"


def predictions(output: Any) -> torch.Tensor:
    """The decoded predictions from any backend's output: a tensor, or PyTorch's (pred, raw) pair."""
    return output[0] if isinstance(output, (tuple, list)) else output
