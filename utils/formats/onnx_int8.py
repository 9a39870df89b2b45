"""ONNX INT8 (``best_int8.onnx``): a QDQ graph (QuantizeLinear / DequantizeLinear pairs around float operators),
the form TensorRT's explicit quantization and onnxruntime read. Written by onnxruntime's static quantization from
the fp32 graph:

* signed INT8 activations and weights, symmetric (zero points 0), weights per output channel; activation ranges
  from a histogram over the calibration images (train split, ``job.calibration``), at onnxruntime's percentile
  (99.999%): the rare extreme values MinMax would fit the range to are clipped, and every other value gets a finer
  step (what each choice gained: docs/benchmarks.md); biases stay float (onnxruntime's
  default, INT32 biases behind a DequantizeLinear, is what TensorRT's ONNX parser refuses: it dequantizes activation
  types only);
* only convolutions and matrix products are quantized (``Conv``, ``MatMul``, ``Gemm``): elementwise operators
  between them (SiLU's sigmoid and product, additions, concatenations, resizes) compute in float on dequantized
  tensors, which kept mAP50-95 within a few thousandths where quantizing every operator did not;
* what the family's ``Int8Scope`` names stays float: the head's prediction convolutions (the logits), its decoding
  (grids, strides, sigmoid, concatenation of pixels with scores) and DFL; the head's other convolutions are
  quantized.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn as nn

from utils.formats.base import ExportJob
from utils.formats.int8 import ScopeMatcher, calibration_batches, onnx_owner
from utils.log import LOGGER

QUANTIZED_OPS = ["Conv", "MatMul", "Gemm"]


class _Reader:
    """onnxruntime's calibration data reader over the job's calibration batches."""

    def __init__(self, batches: Iterator[np.ndarray], input_name: str):
        self.batches, self.input_name = batches, input_name
        self.count = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        if batch is None:
            return None
        self.count += len(batch)
        return {self.input_name: batch}

    def rewind(self) -> None:  # one pass is all the histogram needs
        pass


def float_nodes(model: Any, traced: nn.Module, job: ExportJob) -> list[str]:  # an onnx.ModelProto
    """Names of the nodes the family's Int8Scope keeps float."""
    if job.int8_scope is None:
        return []
    matcher = ScopeMatcher.of(job.int8_scope, traced, job.model, logits=True)  # symmetric activations
    modules = dict(traced.named_modules())
    return [n.name for n in model.graph.node if matcher.keeps_float(onnx_owner(n.name, modules), n.op_type)]


def quantize(float_path: Path, traced: nn.Module, job: ExportJob) -> str:
    """``float_path`` (an fp32 ONNX traced from ``traced``) quantized into ``job.path``; returns a note for the log."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(dir=job.path.parent) as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(str(float_path), str(prepared), skip_optimization=False, skip_symbolic_shape=True)
        model = onnx.load(str(prepared))
        kept_float = float_nodes(model, traced, job)
        reader = _Reader(calibration_batches(job), model.graph.input[0].name)
        quantize_static(
            str(prepared),
            str(job.path),
            reader,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            calibrate_method=CalibrationMethod.Percentile,
            op_types_to_quantize=QUANTIZED_OPS,
            nodes_to_exclude=kept_float,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
        )
    LOGGER.debug(f"{job.path}: {len(kept_float)} nodes kept float by the family's INT8 scope")
    return (
        f"INT8 QDQ (symmetric, per-channel weights; {'/'.join(QUANTIZED_OPS)} quantized, "
        f"{len(kept_float)} nodes of the head kept float), ranges at the 99.999th percentile of {reader.count} "
        f"train images"
    )
