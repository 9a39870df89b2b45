"""ONNX (``best.onnx``, ``best_fp16.onnx``, ``best_int8.onnx``): written with torch.onnx's TorchScript-based
exporter, simplified by onnxslim, run with onnxruntime. Metadata in the file's ``metadata_props``. ``--nms`` puts
NMS inside the graph (``onnx_nms.py``): the output becomes (B, max_det, 6), the end-to-end layout. INT8 is a QDQ
graph quantized from the fp32 one (``onnx_int8.py``)."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.errors import UserError, describe
from utils.formats.base import ExportJob, ExportOptions, Format, Runner, as_numpy, missing_package
from utils.formats.metadata import ModelMeta
from utils.log import LOGGER

# The TorchScript-based exporter used here writes opsets up to 20; onnxruntime 1.16+ runs opset 20.
DEFAULT_OPSET = 20


def _simplify(path: Path) -> str:
    import onnx
    import onnxslim

    onnx.save(onnxslim.slim(onnx.load(str(path))), str(path))
    return f"simplified by onnxslim {getattr(onnxslim, '__version__', '')}".rstrip()


def _store_metadata(path: Path, meta: ModelMeta, export_batch: int) -> None:
    import onnx

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    for key, value in meta.onnx_props(export_batch=export_batch).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def trace_to_onnx(module: torch.nn.Module, example: torch.Tensor, path: Path, opset: int, dynamic: bool) -> None:
    """torch.onnx's TorchScript-based exporter: input ``images``, output ``output0``."""
    dynamic_axes = {"images": {0: "batch"}, "output0": {0: "batch"}} if dynamic else None
    with warnings.catch_warnings():  # the TorchScript-based exporter is deprecated, not removed; it needs no onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the head's shape arithmetic, fixed in the trace
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            opset_version=opset,
            do_constant_folding=True,
            input_names=["images"],
            output_names=["output0"],
            dynamic_axes=dynamic_axes,
        )


class OnnxRunner(Runner):
    """An ONNX file run by onnxruntime."""

    def __init__(self, path: Path, device: torch.device):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise missing_package(path, "onnxruntime", "running ONNX files") from e
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = ort.InferenceSession(str(path), session_options(ort), providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for bad files  # noqa: BLE001
            raise UserError(f"{path}: onnxruntime cannot open it ({describe(e)})") from None
        first = self.session.get_inputs()[0]
        self.input_name = first.name
        self.input_dtype = torch.float16 if first.type == "tensor(float16)" else torch.float32
        self._np_dtype = np.float16 if self.input_dtype == torch.float16 else np.float32
        self.output_name = self.session.get_outputs()[0].name
        self.device = device
        self.meta = ModelMeta.from_onnx_props(self.session.get_modelmeta().custom_metadata_map, path)

    def run(self, images: torch.Tensor) -> torch.Tensor:
        (out,) = self.session.run([self.output_name], {self.input_name: as_numpy(images, self._np_dtype)})
        out = torch.from_numpy(out)
        return (out if out.dtype == torch.float32 else out.float()).to(images.device)


def session_options(ort: Any) -> Any:  # onnxruntime and its SessionOptions
    """As many intra-op threads as PyTorch's (the process's share of the cores, set once at start-up), so the two
    runtimes never ask for more cores than the process has."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = torch.get_num_threads()
    return options


class OnnxFormat(Format):
    name = "onnx"
    suffix = ".onnx"
    precisions = ("fp32", "fp16", "int8")
    packages = ("onnx", "onnxruntime")
    description = "ONNX (onnxruntime, OpenCV DNN, TensorRT, ...)"

    def check_request(self, options: ExportOptions, precision: str) -> None:
        if precision not in self.precisions:
            raise UserError(
                f"--include onnx: no {precision} files in this version (onnx writes {', '.join(self.precisions)})"
            )
        if options.simplify and importlib.util.find_spec("onnxslim") is None:
            LOGGER.warning(
                "WARNING --include onnx: onnxslim is not installed, the graph is written as traced, "
                "not simplified (pip install onnxslim; --no-simplify to ask for that)"
            )

    def reference_module(self, job: ExportJob) -> torch.nn.Module:
        module = job.module_in(job.precision)[0]
        if job.options.nms is None:
            return module
        from utils.formats.onnx_nms import InGraphNms

        return InGraphNms(module, job.family.candidates, job.options.nms)

    def write(self, job: ExportJob) -> str:
        module, example = self.reference_module(job), job.module_in(job.precision)[1]
        notes = [f"opset {job.options.opset}"]
        if job.options.nms is not None:
            notes.append(
                f"NMS in the graph (conf {job.options.nms.conf:g}, IoU {job.options.nms.iou:g}, "
                f"max_det {job.options.nms.max_det})"
            )
        if job.options.dynamic:
            notes.append("dynamic batch")
        if job.precision == "int8":  # the fp32 graph first, quantized into job.path
            from utils.formats.onnx_int8 import quantize

            with tempfile.TemporaryDirectory(dir=job.path.parent) as tmp:
                float_path = Path(tmp) / "float.onnx"
                notes.append(self._trace(module, example, float_path, job.options))
                notes.append(quantize(float_path, module, job))
        else:
            notes.append(self._trace(module, example, job.path, job.options))
        _store_metadata(job.path, job.meta, job.export_batch)
        LOGGER.debug(f"{job.path}: written")
        return ", ".join(notes)

    @staticmethod
    def _trace(module: torch.nn.Module, example: torch.Tensor, path: Path, options: ExportOptions) -> str:
        """The traced graph at ``path``, simplified unless asked not to be; returns the note on simplification."""
        trace_to_onnx(module, example, path, options.opset, options.dynamic)
        if not options.simplify:
            return "not simplified (--no-simplify)"
        if importlib.util.find_spec("onnxslim") is None:
            return "not simplified (onnxslim not installed)"
        return _simplify(path)

    def open(self, path: Path, device: torch.device) -> Runner:
        return OnnxRunner(path, device)


FORMAT = OnnxFormat()
