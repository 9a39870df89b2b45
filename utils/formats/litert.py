"""LiteRT, formerly TensorFlow Lite (``best.tflite``, ``best_fp16.tflite``, ``best_int8.tflite``): converted by
litert-torch, fp16 and INT8 by ai-edge-quantizer, run with ai-edge-litert's interpreter (for Android and edge
runtimes).

As in Ultralytics' LiteRT files, the graph's input and output stay float32 whatever the precision inside, and box
coordinates of the YOLOv5 and anchor-free layouts leave the graph divided by the input width and height: an INT8
tensor holding pixels and class scores at one scale cannot resolve the scores. The end-to-end layout keeps pixels.
The runner multiplies them back. The metadata is a ``metadata.json`` entry of a zip archive appended to the file
(the flatbuffer reader ignores it), where Ultralytics' LiteRT reader looks for it.

fp16: weights stored in fp16, computed in fp32. INT8: ai-edge-quantizer's static recipe (int8 weights per channel,
int8 activations), calibrated on ``job.calibration``; what the family's ``Int8Scope`` names, the head's prediction
convolutions (whose int8 output would be the logits themselves), the box normalisation and the op writing the output
stay float.
"""

from __future__ import annotations

import importlib.util
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.families import Int8Scope
from utils.errors import UserError, first_line
from utils.files import atomic_output
from utils.formats.base import ExportJob, Format, Runner, as_numpy
from utils.formats.metadata import ModelMeta
from utils.log import LOGGER

METADATA_ENTRY = "metadata.json"  # in the zip archive appended to the .tflite, as Ultralytics writes it
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
PIP_NAMES = {
    "litert_torch": "litert-torch",
    "ai_edge_litert": "ai-edge-litert",
    "ai_edge_quantizer": "ai-edge-quantizer",
}


class NormalisedBoxes(nn.Module):
    """The export module with x, w divided by the input width and y, h by its height (YOLOv5 and anchor-free
    layouts; an end-to-end output passes unchanged)."""

    scale: torch.Tensor  # a buffer: width, height, width, height

    def __init__(self, module: nn.Module, layout: str, size: tuple[int, int]):
        super().__init__()
        self.module, self.layout = module, layout
        height, width = size
        self.register_buffer("scale", torch.tensor([width, height, width, height], dtype=torch.float32))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.module(images)
        if self.layout == "anchor_free":  # (B, 4 + nc, A)
            return torch.cat((out[:, :4] / self.scale.view(1, 4, 1), out[:, 4:]), 1)
        if self.layout == "end2end":
            return out
        return torch.cat((out[..., :4] / self.scale, out[..., 4:]), -1)  # YOLOv5: (B, A, 5 + nc)


def denormalise(out: np.ndarray, layout: str, size: tuple[int, int]) -> np.ndarray:
    """Boxes back to input pixels (the inverse of ``NormalisedBoxes``), in place."""
    height, width = size
    if layout == "anchor_free":
        out[:, [0, 2]] *= width
        out[:, [1, 3]] *= height
    elif layout != "end2end":
        out[..., [0, 2]] *= width
        out[..., [1, 3]] *= height
    return out


# ---- INT8 scope: PyTorch module names to LiteRT tensor names ----


def _segment(module: nn.Module, attribute: str) -> str:
    return re.escape(f"{type(module).__module__}.{type(module).__qualname__}_{attribute}")


def tensor_name_pattern(model: nn.Module, qualified: str) -> str:
    """A regex for the tensors computed inside module ``qualified`` of ``model``.

    litert-torch names each op's output by the modules whose forward computed it, one ``<module>.<Class>_<attribute>``
    segment each, joined by ``/`` and closed by ``;`` (and a counter). Containers that are only iterated (the layers'
    Sequential, a ModuleList) leave no segment, a Sequential that is called does: so containers are left out of the
    pattern, and any segments may come between the others.
    """
    modules = dict(model.named_modules())
    if qualified not in modules:
        raise UserError(f"INT8 scope: no module {qualified!r} in the model")
    parts = qualified.split(".")
    segments = [
        _segment(modules[".".join(parts[: i + 1])], parts[i])
        for i in range(len(parts))
        if not isinstance(modules[".".join(parts[: i + 1])], CONTAINERS)
    ]
    return "/" + "/(?:[^/;]*/)*".join(segments)


def float_patterns(model: nn.Module, scope: Int8Scope) -> list[str]:
    """Regexes over tensor names of the ops that stay float in an INT8 file."""
    patterns = [tensor_name_pattern(model, name) + "[/;]" for name in (*scope.modules, *scope.logits)]  # subtrees
    patterns += [tensor_name_pattern(model, name) + ";" for name in scope.decoding]  # their own ops only
    patterns.append(re.escape(f"{NormalisedBoxes.__module__}.{NormalisedBoxes.__qualname__}") + ";")
    return patterns


def output_patterns(path: Path) -> list[str]:
    """The ops that write the graph's outputs: the quantizer's float output only dequantizes what they compute, and
    in int8 boxes and scores would share one scale."""
    from ai_edge_litert.interpreter import Interpreter

    return [f"^{re.escape(d['name'])};" for d in Interpreter(model_path=str(path)).get_output_details()]


# ---- writing ----


def _convert(module: nn.Module, example: torch.Tensor, path: Path) -> None:
    import litert_torch

    litert_torch.convert(module.eval(), (example,)).export(str(path))


def _quantize(source: Path, target: Path, configure: Callable[..., None], calibration_samples: Any = None) -> None:
    """ai-edge-quantizer on ``source`` into ``target``; ``configure(quantizer, qtyping, recipe)`` sets the recipe."""
    from ai_edge_quantizer import qtyping, quantizer, recipe

    quantizer_ = quantizer.Quantizer(str(source))
    configure(quantizer_, qtyping, recipe)
    result = None
    if calibration_samples is not None:
        result = quantizer_.calibrate(calibration_samples)
    quantizer_.quantize(calibration_result=result).export_model(str(target), overwrite=True)


def _fp16_recipe(quantizer_: Any, qtyping: Any, recipe: Any) -> None:  # ai_edge_quantizer's objects
    """Every weight stored in fp16 and dequantized once at load; arithmetic in fp32."""
    quantizer_.update_quantization_recipe(
        regex=".*",
        operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
        op_config=qtyping.OpQuantizationConfig(
            weight_tensor_config=qtyping.TensorQuantizationConfig(num_bits=16, dtype=qtyping.TensorDataType.FLOAT),
            compute_precision=qtyping.ComputePrecision.FLOAT,
            explicit_dequantize=True,
        ),
        algorithm_key=recipe.AlgorithmName.FLOAT_CASTING,
    )


def _int8_recipe(patterns: list[str]) -> Callable[..., None]:
    def configure(quantizer_: Any, qtyping: Any, recipe: Any) -> None:  # ai_edge_quantizer's objects
        quantizer_.load_quantization_recipe(recipe.static_wi8_ai8())
        # float32 input and output, as Ultralytics' INT8 LiteRT files have (after the recipe, which would set them)
        for op in (qtyping.TFLOperationName.INPUT, qtyping.TFLOperationName.OUTPUT):
            quantizer_.update_quantization_recipe(
                regex=".*", operation_name=op, algorithm_key=recipe.AlgorithmName.NO_QUANTIZE
            )
        for pattern in patterns:
            quantizer_.update_quantization_recipe(
                regex=pattern,
                operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
                algorithm_key=recipe.AlgorithmName.NO_QUANTIZE,
            )

    return configure


def _calibration_samples(job: ExportJob, source: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    """The calibration images as the quantizer takes them: per signature, one input dict per export batch."""
    from ai_edge_litert.interpreter import Interpreter

    if job.calibration is None:
        raise UserError("--int8 needs --data: INT8 is calibrated on images of the data YAML's train split")
    signatures = Interpreter(model_path=str(source)).get_signature_list()
    ((signature, spec),) = signatures.items()
    name = spec["inputs"][0]
    images = np.concatenate(list(job.calibration.images(job.calibration.size)))
    batch = job.export_batch
    if len(images) % batch:  # a fixed batch: the last one filled up with the first images
        images = np.concatenate([images, images[: batch - len(images) % batch]])
    return {signature: [{name: images[i : i + batch]} for i in range(0, len(images), batch)]}


def _store_metadata(path: Path, meta: ModelMeta, export_batch: int) -> None:
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(METADATA_ENTRY, meta.to_json(export_batch=export_batch))


def read_metadata(path: Path) -> ModelMeta:
    """The metadata entry of a .tflite: ours, or Ultralytics' keys."""
    try:
        with zipfile.ZipFile(path) as archive:
            text = archive.read(METADATA_ENTRY).decode("utf-8")
    except (zipfile.BadZipFile, KeyError) as e:
        raise UserError(f"{path}: no {METADATA_ENTRY} in it; export it with export.py") from e
    return ModelMeta.from_json(text, "litert", path)


# ---- running ----


class LiteRTRunner(Runner):
    """A .tflite run by ai-edge-litert's interpreter on the CPU, at the file's batch size."""

    def __init__(self, path: Path, device: torch.device):
        from ai_edge_litert.interpreter import Interpreter

        self.meta = read_metadata(path)
        try:
            self.interpreter = Interpreter(model_path=str(path), num_threads=torch.get_num_threads())
            self.interpreter.allocate_tensors()
        except (RuntimeError, ValueError) as e:
            raise UserError(f"{path}: LiteRT cannot open it ({first_line(e)})") from e
        first = self.interpreter.get_input_details()[0]
        self.input_index = first["index"]
        self.output_index = self.interpreter.get_output_details()[0]["index"]
        if len(first["shape"]) != 4 or int(first["shape"][1]) != 3:  # older TFLite exports take (B, H, W, 3)
            raise UserError(f"{path}: input {list(first['shape'])}, not (B, 3, H, W); re-export it with export.py")
        batch, _, height, width = (int(v) for v in first["shape"])
        self.meta = self.meta.copy(batch=batch, imgsz=(height, width))
        if device.type != "cpu":
            LOGGER.info(f"{path}: LiteRT runs on the CPU here")
        self.device = torch.device("cpu")

    def run(self, images: torch.Tensor) -> torch.Tensor:
        self.interpreter.set_tensor(self.input_index, as_numpy(images, np.float32))
        self.interpreter.invoke()
        out = self.interpreter.get_tensor(self.output_index).copy()
        assert self.meta.imgsz is not None  # a LiteRT file has one input shape
        return torch.from_numpy(denormalise(out, self.meta.layout, self.meta.imgsz))


class LiteRTFormat(Format):
    name = "litert"
    suffix = ".tflite"
    precisions = ("fp32", "fp16", "int8")
    packages = ("litert_torch", "ai_edge_litert", "ai_edge_quantizer")
    description = "LiteRT / TFLite (Android, edge runtimes)"

    def unavailable(self) -> str | None:
        missing = [PIP_NAMES[name] for name in self.packages if importlib.util.find_spec(name) is None]
        if missing:
            return f"{self.name} needs {' and '.join(missing)} (pip install {' '.join(missing)})"
        return None

    def write(self, job: ExportJob) -> str:
        module = NormalisedBoxes(job.module, job.meta.layout, (job.example.shape[2], job.example.shape[3]))
        meta = job.meta.copy(batch=job.export_batch)  # a converted graph takes its batch only
        notes = ["litert-torch"]
        with atomic_output(job.path) as target:
            if job.precision == "fp32":
                _convert(module, job.example, target)
            else:
                with tempfile.TemporaryDirectory(dir=job.path.parent) as folder:
                    source = Path(folder) / "float32.tflite"
                    _convert(module, job.example, source)
                    if job.precision == "fp16":
                        _quantize(source, target, _fp16_recipe)
                        notes.append("fp16 weights by ai-edge-quantizer")
                    else:
                        patterns = float_patterns(job.model, job.int8_scope or Int8Scope((), ())) + output_patterns(
                            source
                        )
                        _quantize(source, target, _int8_recipe(patterns), _calibration_samples(job, source))
                        notes.append(
                            f"INT8 by ai-edge-quantizer (static_wi8_ai8, float in/out, {len(patterns)} scopes float)"
                        )
            _store_metadata(target, meta, job.export_batch)
        return ", ".join(notes)

    def open(self, path: Path, device: torch.device) -> Runner:
        return LiteRTRunner(path, device)


FORMAT = LiteRTFormat()
