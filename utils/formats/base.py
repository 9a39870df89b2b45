"""The format seam: what one export format provides, and what export.py, val.py and detect.py ask of it.

A format is one module in ``utils/formats/`` that defines ``FORMAT``, an instance of a :class:`Format` subclass:

* ``name`` (``--include`` takes it), ``suffix`` (``".onnx"``; a folder format's ends in ``_model``, as
  ``"_openvino_model"``), ``precisions`` it writes (of ``fp32``, ``fp16``, ``int8``) and ``packages`` it imports;
* ``write(job: ExportJob) -> str``: write ``job.path`` (a file, or a folder for folder formats) with its metadata
  (``job.meta``), at ``job.precision``; INT8 reads calibration images from ``job.calibration``. Returns a short
  note for the log (``"opset 20, simplified by onnxslim 0.1.98"``);
* ``open(path, device) -> Runner``: a runner with the file's metadata (``runner.meta``);
* optionally ``recognizes(path)`` when a path's name alone does not say (the default: the suffix, or a folder
  named ``*<suffix>``), ``unavailable()`` when a package is missing, and ``check_request(options, precision)``.

The registry (``utils/formats/__init__.py``) finds the modules; nothing else names a format.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.families import Family, Int8Scope
from utils.errors import UserError
from utils.formats.metadata import ModelMeta

# Where Ultralytics writes fp16 under the fp32 name, a tag keeps each precision's file apart.
PRECISION_TAGS = {"fp32": "", "fp16": "_fp16", "int8": "_int8"}


class Runner:
    """An exported file (or a .pt) called like the PyTorch model's predictions: images (B, 3, H, W) in [0, 1] as a
    tensor of ``input_dtype`` in, ``output0`` (in ``meta.layout``, input pixels) as a float tensor out.

    A format implements ``run`` for batches of exactly ``meta.batch`` images when the file fixes its batch (any
    batch otherwise); ``__call__`` splits larger batches and pads the last one with blank images.
    """

    meta: ModelMeta
    device: torch.device = torch.device("cpu")
    input_dtype: torch.dtype = torch.float32
    # A runtime with its own thread pool (onnxruntime, OpenVINO, ...) rather than PyTorch's: PyTorch's threads then
    # only pre- and post-process, and are kept to one so that they never spin on the cores the runtime computes on.
    own_threads: bool = True
    # Inputs in channels-last layout: a PyTorch model whose convolutions use it (faster on CPUs and GPUs alike).
    channels_last: bool = False

    def run(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != self.input_dtype:
            images = images.to(self.input_dtype)
        size = self.meta.batch
        if not size or len(images) == size:
            return self.run(images)
        outputs = []
        for chunk in images.split(size):
            n = len(chunk)
            if n < size:
                chunk = torch.cat([chunk, chunk.new_zeros(size - n, *chunk.shape[1:])])
            outputs.append(self.run(chunk)[:n])
        return torch.cat(outputs)

    def use_end2end(self, path: Path | str) -> None:
        """``--end2end``: the NMS-free output. An exported file must have been exported with it."""
        if self.meta.layout != "end2end":
            raise UserError(
                f"--end2end: {path} was exported with the {self.meta.layout} output; export it with --end2end"
            )

    def warmup(self, shape: tuple[int, int]) -> None:
        """One run on blank images, so that start-up costs stay out of timings."""
        self(torch.zeros(self.meta.batch or 1, 3, *shape, dtype=self.input_dtype, device=self.device))


@dataclass(frozen=True)
class NmsSpec:
    """NMS inside an exported graph (ONNX ``--nms``): output (B, max_det, 6) = x1 y1 x2 y2 score class."""

    conf: float
    iou: float
    max_det: int

    def as_dict(self) -> dict[str, float]:
        return {"conf": self.conf, "iou": self.iou, "max_det": self.max_det}


@dataclass(frozen=True)
class ExportOptions:
    """The options of one export.py call that formats read (each ignores those that do not apply to it)."""

    opset: int = 20
    dynamic: bool = False
    simplify: bool = True
    nms: NmsSpec | None = None
    end2end: bool = False  # the end-to-end output (--end2end), for formats whose runtime lacks its top-k


@dataclass
class Calibration:
    """INT8 calibration data, from the data YAML's train split (never its val split, which the gate reads).

    ``images(n)`` yields up to ``n`` letterboxed images, each a float32 array (1, 3, H, W) in [0, 1] at the
    exported input size, chosen deterministically and outside the held-out slice. ``holdout_map(runner)`` is
    mAP50-95 of a runner on the held-out slice of train (stable by path hash, as ``val: 0.1`` is), for any
    accuracy-aware search; None when the split is too small to hold one out.
    """

    images: Callable[[int], Iterator[np.ndarray]]
    holdout_map: Callable[[Runner], float] | None = None
    size: int = 300  # the number of images a format should ask for by default


@dataclass
class ExportJob:
    """One file to write: the family's export module (images in [0, 1] to ``output0``, fp32, eval, no grads) with
    an example input, where to write it and at which precision."""

    module: nn.Module
    model: nn.Module  # the underlying detector (module names for ``int8_scope``)
    family: Family  # ``candidates`` for NMS in the graph
    example: torch.Tensor  # (B, 3, H, W) float32 in [0, 1]
    meta: ModelMeta  # what the file says about itself (precision, batch, nms set for this file)
    path: Path
    precision: str
    options: ExportOptions = field(default_factory=ExportOptions)
    int8_scope: Int8Scope | None = None
    calibration: Calibration | None = None

    @property
    def export_batch(self) -> int:
        return int(self.example.shape[0])

    def module_in(self, precision: str) -> tuple[nn.Module, torch.Tensor]:
        """The module and example in fp16 (traced so on any device, fp16 kernels of the CPU included) or fp32."""
        if precision == "fp16":  # a copy: the job's module stays fp32 for the other files of the call
            return copy.deepcopy(self.module).half(), self.example.half()
        return self.module, self.example


class Format:
    """One export format; see the module docstring. Subclasses set the class attributes and write/open."""

    name: str = ""
    suffix: str = ""  # ".onnx", or "_openvino_model" for a folder
    precisions: tuple[str, ...] = ("fp32",)
    packages: tuple[str, ...] = ()  # what write and open import (named in the one line when missing)
    description: str = ""  # a few words for --help

    @property
    def is_folder(self) -> bool:
        return self.suffix.endswith("_model")

    def output_path(self, weights: Path, precision: str) -> Path:
        """``best.onnx``, ``best_fp16.onnx``, ``best_int8.onnx``; ``best_openvino_model``, ``best_int8_openvino_model``."""
        tag = PRECISION_TAGS[precision]
        return weights.with_name(f"{weights.stem}{tag}{self.suffix}")

    def recognizes(self, path: Path) -> bool:
        if self.is_folder:
            return path.is_dir() and path.name.endswith(self.suffix)
        return path.suffix.lower() == self.suffix

    def unavailable(self) -> str | None:
        """Why this format cannot run here (a missing package, in one line), or None."""
        missing = [p for p in self.packages if importlib.util.find_spec(p) is None]
        if missing:
            return f"{self.name} needs {' and '.join(missing)} (pip install {' '.join(missing)})"
        return None

    def check_request(self, options: ExportOptions, precision: str) -> None:
        """Refuse in one line what this format cannot write."""
        if precision not in self.precisions:
            raise UserError(
                f"--include {self.name}: no {precision} files ({self.name} writes {', '.join(self.precisions)})"
            )
        if options.nms is not None:
            raise UserError(f"--nms: NMS inside the graph is written for ONNX only, not {self.name}")

    def write(self, job: ExportJob) -> str:
        raise NotImplementedError

    def open(self, path: Path, device: torch.device) -> Runner:
        raise NotImplementedError

    def reference_module(self, job: ExportJob) -> nn.Module:
        """What PyTorch computes for this file (the numeric check's reference): the job's module in the file's
        precision; a format that adds to the graph (ONNX's NMS) adds it here too."""
        return job.module_in(job.precision)[0]


def file_size(path: Path) -> int:
    """Bytes of a file, or of every file in a folder."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def missing_package(path: Path | str, package: str, what: str) -> UserError:
    return UserError(f"{path}: {what} needs the {package} package (pip install {package})")


def as_numpy(images: torch.Tensor, dtype: Any) -> np.ndarray:
    """A runtime's input array without a copy where the tensor already is one (contiguous, CPU, that dtype)."""
    array = images.detach().cpu().numpy()
    return np.ascontiguousarray(array, dtype=dtype)
