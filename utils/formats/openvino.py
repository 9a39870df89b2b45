"""OpenVINO IR (``best_openvino_model/``, ``best_fp16_openvino_model/``, ``best_int8_openvino_model/``): a folder
holding ``best.xml`` and ``best.bin``, converted from the PyTorch module by ``openvino.convert_model``, and
``metadata.yaml`` as Ultralytics writes it. fp16 stores the weights in fp16 (``compress_to_fp16``); INT8 is
quantized by NNCF (MIXED preset: symmetric weights, asymmetric activations) on train images, with what the
family's ``Int8Scope`` names kept float. ``--dynamic`` leaves the batch open.

The runner compiles for the CPU with the inference precision pinned to f32: on CPUs with bf16 or fp16 units
OpenVINO otherwise computes float layers in those, silently.
"""

from __future__ import annotations

import copy
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from utils.errors import UserError, first_line
from utils.formats.base import PRECISION_TAGS, ExportJob, Format, Runner, as_numpy, missing_package
from utils.formats.int8 import ScopeMatcher, calibration_batches, openvino_owner
from utils.formats.metadata import ModelMeta

# OpenVINO operation types of the ONNX operator types an Int8Scope names (its op_types).
OV_TYPES = {
    "Sigmoid": "Sigmoid",
    "Softmax": "SoftMax",
    "Add": "Add",
    "Sub": "Subtract",
    "Mul": "Multiply",
    "Div": "Divide",
    "Pow": "Power",
    "Concat": "Concat",
}


def _import_openvino(path: Path | str) -> ModuleType:
    try:
        import openvino
    except ImportError as e:
        raise missing_package(path, "openvino", "OpenVINO") from e
    return openvino


def convert(job: ExportJob) -> Any:  # an openvino.Model
    """The job's fp32 module as an OpenVINO model, batch open with ``--dynamic``, by OpenVINO's PyTorch front end:
    it turns ``chunk`` into one split, where the graph traced to ONNX has a slice per part, each of which INT8 would
    quantize on its own (more FakeQuantize operations, a slower file)."""
    ov = _import_openvino(job.path)
    shape = list(job.example.shape)
    if job.options.dynamic:
        shape[0] = -1
    with warnings.catch_warnings():  # the tracer's warnings on the decoding's shape arithmetic, as ONNX's
        warnings.simplefilter("ignore")
        try:  # what convert_model does, less its empty pre-processing step, which alone takes seconds
            from openvino._offline_transformations import apply_moc_transformations
            from openvino.frontend import FrontEndManager
            from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder
        except ImportError:
            return ov.convert_model(job.module, example_input=job.example, input=[ov.PartialShape(shape)])
        front_end = FrontEndManager().load_by_framework("pytorch")
        # torch.jit.trace's own check runs the model twice more and compares: export.py checks the file instead
        decoder = TorchScriptPythonDecoder(  # alive until converted
            job.module, example_input=(job.example,), trace_kwargs={"check_trace": False}
        )
        model = front_end.convert(front_end.load(decoder))
    model.reshape(ov.PartialShape(shape))
    apply_moc_transformations(model, cf=False)
    return model


def float_ops(model: Any, job: ExportJob) -> list[str]:  # an openvino.Model
    """Friendly names of the operations the family's Int8Scope keeps float, its ONNX ``op_types`` by their
    OpenVINO names."""
    # The logits quantized: NNCF's asymmetric activation ranges keep them as accurate as float (docs/benchmarks.md).
    assert job.int8_scope is not None  # set for INT8 jobs
    matcher = ScopeMatcher.of(job.int8_scope, job.module, job.model, logits=False)
    matcher = ScopeMatcher(matcher.whole, matcher.own, tuple(OV_TYPES[t] for t in matcher.op_types if t in OV_TYPES))
    return [
        op.get_friendly_name()
        for op in model.get_ordered_ops()
        if matcher.keeps_float(openvino_owner(op.get_friendly_name()), op.get_type_name())
    ]


def quantize(model: Any, job: ExportJob) -> tuple[object, str]:  # an openvino.Model
    """NNCF post-training quantization of ``model`` on the job's calibration images; (model, note)."""
    try:
        import nncf
    except ImportError as e:
        raise missing_package(job.path, "nncf", "OpenVINO INT8") from e
    assert job.calibration is not None  # INT8 jobs carry their calibration images
    batches = _Batches(job)
    kept = float_ops(model, job) if job.int8_scope is not None else []
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.WARNING)  # not a line per operation kept float; restored after
    try:
        quantized = nncf.quantize(
            model,
            nncf.Dataset(batches),
            preset=nncf.QuantizationPreset.MIXED,
            subset_size=max(1, job.calibration.size // batches.size),
            fast_bias_correction=True,
            ignored_scope=nncf.IgnoredScope(names=kept, validate=False),
        )
    finally:
        nncf_log.setLevel(level)
    return quantized, (
        f"INT8 by NNCF {nncf.__version__} (MIXED preset, {len(kept)} operations of the head kept "
        f"float), calibrated on {batches.images} train images"
    )


class _Batches:
    """The calibration batches, read again on each pass NNCF makes (not all held in memory: 300 images at 640 px
    are 1.5 GB)."""

    def __init__(self, job: ExportJob):
        self.job, self.images = job, 0
        self.size = job.export_batch if job.meta.batch else 1  # images per batch

    def __iter__(self) -> Iterator[np.ndarray]:
        seen = 0
        for batch in calibration_batches(self.job):
            seen += len(batch)
            self.images = max(self.images, seen)  # NNCF may stop reading before the end
            yield batch


class Fp16Weights(nn.Module):
    """What an fp16 IR computes on the CPU: fp32 arithmetic on weights rounded to fp16 (input cast to fp32)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = copy.deepcopy(module)
        for p in self.module.parameters():
            p.data = p.data.half().float()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.module(images.float())


class OpenVinoRunner(Runner):
    """An OpenVINO IR folder compiled for the CPU, f32 inference pinned, with PyTorch's share of threads."""

    def __init__(self, path: Path, device: torch.device):
        ov = _import_openvino(path)
        xml = model_file(path)
        self.meta = ModelMeta.from_yaml(path, "openvino")
        core = ov.Core()
        try:
            model = core.read_model(str(xml))
        except RuntimeError as e:
            raise UserError(f"{xml}: OpenVINO cannot read it ({first_line(e)})") from e
        config = {
            "INFERENCE_PRECISION_HINT": "f32",
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "PERFORMANCE_HINT": "LATENCY",
        }
        self.compiled = core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.device = torch.device("cpu") if device.type != "cpu" else device

    def run(self, images: torch.Tensor) -> torch.Tensor:
        out = self.request.infer({0: as_numpy(images, np.float32)})[self.compiled.output(0)]
        return torch.from_numpy(np.array(out, dtype=np.float32, copy=True)).to(images.device)


def model_file(folder: Path) -> Path:
    """The one ``.xml`` of an IR folder."""
    found = sorted(Path(folder).glob("*.xml"))
    if len(found) != 1:
        raise UserError(f"{folder}: expected one OpenVINO .xml in it, found {len(found)}")
    return found[0]


def weights_stem(folder: Path, precision: str) -> str:
    """``best`` for ``best_int8_openvino_model``: the IR files inside are named after the weights, as Ultralytics'."""
    stem = folder.name[: -len(FORMAT.suffix)]
    tag = PRECISION_TAGS[precision]
    return stem[: -len(tag)] if tag and stem.endswith(tag) else stem


class OpenVinoFormat(Format):
    name = "openvino"
    suffix = "_openvino_model"
    precisions = ("fp32", "fp16", "int8")
    packages = ("openvino",)
    description = "OpenVINO IR (Intel CPUs, GPUs and NPUs)"

    def recognizes(self, path: Path) -> bool:
        return path.is_dir() and (path.name.endswith(self.suffix) or any(path.glob("*.xml")))

    def reference_module(self, job: ExportJob) -> nn.Module:
        return Fp16Weights(job.module) if job.precision == "fp16" else job.module

    def write(self, job: ExportJob) -> str:
        ov = _import_openvino(job.path)
        model = convert(job)
        notes = ["dynamic batch" if job.options.dynamic else f"batch {job.export_batch}"]
        if job.precision == "int8":
            model, note = quantize(model, job)
            notes.append(note)
        elif job.precision == "fp16":
            notes.append("fp16 weights, fp32 arithmetic on CPUs")
        partial = job.path.with_name(job.path.name + ".partial")  # a folder complete or absent, never half-written
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        ov.save_model(
            model,
            str(partial / f"{weights_stem(job.path, job.precision)}.xml"),
            compress_to_fp16=job.precision == "fp16",
        )
        job.meta.write_yaml(partial, export_batch=job.export_batch)
        if job.path.exists():
            shutil.rmtree(job.path)
        partial.rename(job.path)
        return f"OpenVINO {ov.__version__.split('-')[0]}, " + ", ".join(notes)

    def open(self, path: Path, device: torch.device) -> Runner:
        return OpenVinoRunner(path, device)


FORMAT = OpenVinoFormat()
