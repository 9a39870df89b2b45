"""PyTorch checkpoints (``.pt``): this project's, YOLOv5's v6+ and Ultralytics' detection checkpoints, imported without
running pickled code. The source of every export, and a runner like any other format's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.families import family_of
from utils.errors import UserError
from utils.formats.base import ExportJob, Format, Runner
from utils.formats.metadata import ModelMeta


class PytorchRunner(Runner):
    """A detector in eval mode. ``model`` returns (predictions, raw level outputs), which losses and test-time
    augmentation need; calling the runner returns the predictions only, as every format's runner does."""

    own_threads = False  # PyTorch computes it

    def __init__(self, model: nn.Module, meta: ModelMeta, device: torch.device):
        self.model, self.meta, self.device = model, meta, device

    @property
    def input_dtype(self) -> torch.dtype:  # type: ignore[override]
        first = next(self.model.parameters(), None)
        return first.dtype if first is not None else torch.float32

    @property
    def channels_last(self) -> bool:  # type: ignore[override]
        weight = next((p for p in self.model.parameters() if p.dim() == 4), None)
        return weight is not None and weight.is_contiguous(memory_format=torch.channels_last)

    def run(self, images: torch.Tensor) -> torch.Tensor:
        out = self.model(images)
        return out[0] if isinstance(out, (tuple, list)) else out

    def half(self) -> None:
        """Compute in fp16 (val.py and detect.py ``--half`` on a CUDA device)."""
        self.model.half()
        self.meta.precision = "fp16"

    def use_end2end(self, path: Path | str) -> None:
        family = family_of(self.model)
        family.use_end_to_end(self.model, path)
        self.meta.layout = family.layout(self.model)


def load_pytorch(path: Path, device: torch.device, fuse: bool = True) -> PytorchRunner:
    """The checkpoint's model (EMA weights when present) in fp32 eval mode, BatchNorm folded, with its metadata."""
    from models.loading import load_model
    from utils.checkpoint import trained_imgsz

    loaded, ckpt = load_model(path, device)
    model: Any = loaded.float()  # a Model or a DETR detector: names and stride are untyped attributes
    if fuse:
        model.fuse()
    hooks = family_of(model)
    meta = ModelMeta(
        names=list(model.names),
        stride=int(model.stride.max()),
        kind="pytorch",
        family=hooks.name,
        layout=hooks.layout(model),
        trained_imgsz=trained_imgsz(ckpt),
    )
    return PytorchRunner(model.eval(), meta, device)


class PytorchFormat(Format):
    name = "pytorch"
    suffix = ".pt"
    precisions = ("fp32",)
    description = "PyTorch checkpoint (the source of exports)"

    def recognizes(self, path: Path) -> bool:
        """Ours (``.pt``), the official DETRs' ``.pth`` and Hugging Face folders (``config.json`` +
        ``model.safetensors``): checkpoints the families' importers read."""
        if path.is_dir():
            return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        return path.suffix.lower() in (".pt", ".pth")

    def write(self, job: ExportJob) -> str:
        raise UserError("export.py starts from a .pt checkpoint; it does not write one")

    def open(self, path: Path, device: torch.device) -> Runner:
        runner = load_pytorch(path, device)
        runner.model.to(memory_format=torch.channels_last)  # as training computes; faster (docs/benchmarks.md)
        return runner


FORMAT = PytorchFormat()
