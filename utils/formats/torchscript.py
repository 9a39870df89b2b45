"""TorchScript (``best.torchscript``, ``best_fp16.torchscript``): traced at one input shape and batch, run with
``torch.jit.load``. Metadata in the ``config.txt`` extra file (the name YOLOv5's and Ultralytics' exports use)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from utils.errors import UserError, first_line
from utils.formats.base import ExportJob, Format, Runner
from utils.formats.metadata import ModelMeta

METADATA_FILE = "config.txt"


class TorchScriptRunner(Runner):
    own_threads = False  # PyTorch computes it

    def __init__(self, path: Path, device: torch.device):
        extra = {METADATA_FILE: ""}
        try:
            with warnings.catch_warnings():  # torch.jit is deprecated, but TorchScript files need it
                warnings.simplefilter("ignore", FutureWarning)
                self.module = torch.jit.load(str(path), map_location=device, _extra_files=extra)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"{path}: not a readable TorchScript file ({first_line(e)})") from e
        if not extra[METADATA_FILE]:
            raise UserError(f"{path}: no metadata ({METADATA_FILE}) in it; export it with export.py")
        self.meta = ModelMeta.from_json(extra[METADATA_FILE], "torchscript", path)
        self.device = device
        first = next(iter(self.module.parameters()), None)
        self.input_dtype = first.dtype if first is not None else torch.float32

    def run(self, images: torch.Tensor) -> torch.Tensor:
        return self.module(images).float()


class TorchScriptFormat(Format):
    name = "torchscript"
    suffix = ".torchscript"
    precisions = ("fp32", "fp16")
    description = "TorchScript (PyTorch's C++ runtime, LibTorch)"

    def write(self, job: ExportJob) -> str:
        module, example = job.module_in(job.precision)
        with (
            warnings.catch_warnings()
        ):  # tracing is deprecated in favour of torch.export, but is what TorchScript needs
            warnings.simplefilter("ignore", FutureWarning)
            traced = torch.jit.trace(module, example, strict=False, check_trace=False)
        meta = job.meta.copy(batch=job.export_batch)  # a trace takes its batch only
        traced.save(str(job.path), _extra_files={METADATA_FILE: meta.to_json(export_batch=job.export_batch)})
        return "traced"

    def open(self, path: Path, device: torch.device) -> Runner:
        return TorchScriptRunner(path, device)


FORMAT = TorchScriptFormat()
