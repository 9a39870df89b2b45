"""The predictor: images in, detections out, for every format (val.py, detect.py and export.py's gate).

Pre-processing (letterbox, RGB, [0, 1], the runner's dtype and device), inference through a runner
(``utils/formats``), decoding through the family (NMS at its IoU threshold, or a confidence filter for an
end-to-end output), and rescaling to the original image. It times each of the three stages per image.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from models.families import Family
from utils.boxes import scale_boxes
from utils.data.augmentations import letterbox
from utils.formats.base import Runner
from utils.formats.metadata import ModelMeta
from utils.log import LOGGER
from utils.nms import end_to_end_detections

RatioPad = tuple[tuple[float, float], tuple[float, float]]  # ((ratio_h, ratio_w), (pad_w, pad_h)), as scale_boxes


@dataclass
class PredictOptions:
    """How predictions become detections. ``iou_thres`` None: the family's threshold for the purpose (validation's
    mAP sweep, or detect.py's)."""

    conf_thres: float = 0.001
    iou_thres: float | None = None
    max_det: int = 300
    classes: list[int] | None = None
    agnostic: bool = False
    multi_label: bool = False
    augment: bool = False  # test-time augmentation (PyTorch models)
    autocast_dtype: torch.dtype | None = None  # inference under autocast (training's bf16, --half on fp32 weights)


@dataclass
class BatchPrediction:
    """One batch: per image (n, 6) x1 y1 x2 y2 conf cls in input pixels (CPU), the input and the raw outputs."""

    detections: list[torch.Tensor]
    images: torch.Tensor  # (B, 3, H, W) as fed to the runner
    raw: Any = None  # a PyTorch model's level outputs, for losses; None for exported files


@dataclass
class Timer:
    """Seconds spent pre-processing, in inference and decoding, and the images they were spent on."""

    seconds: np.ndarray = field(default_factory=lambda: np.zeros(3))
    images: int = 0

    def per_image_ms(self) -> tuple[float, float, float]:
        return cast("tuple[float, float, float]", tuple(float(t) for t in self.seconds / max(self.images, 1) * 1e3))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Predictor:
    """Detections of a runner's model, decoded by its family; see the module docstring."""

    def __init__(self, runner: Runner, family: Family, options: PredictOptions, purpose: str = "val"):
        self.runner, self.family, self.options = runner, family, options
        default_iou = family.val_iou if purpose == "val" else family.detect_iou
        self.iou_thres = default_iou if options.iou_thres is None else options.iou_thres
        self.timer = Timer()

    @property
    def meta(self) -> ModelMeta:
        return self.runner.meta

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, H, W) RGB to the runner's input: its dtype and device, values in [0, 1]."""
        x = images.to(self.device, non_blocking=True)
        # One copy (the caller's batch stays as it was), in the layout the model's convolutions use.
        layout = torch.channels_last if self.runner.channels_last else torch.contiguous_format
        return x.to(self.runner.input_dtype, copy=True, memory_format=layout).div_(255)

    def infer(self, x: torch.Tensor, want_raw: bool = False) -> tuple[torch.Tensor, Any]:
        """The runner's output0 (and a PyTorch model's raw level outputs when asked and available)."""
        model = getattr(self.runner, "model", None)  # PyTorch runners: (predictions, raw) for losses and TTA
        dtype = self.options.autocast_dtype
        with (
            torch.no_grad(),
            torch.autocast(device_type=self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None),
        ):
            if self.options.augment:
                from utils.tta import tta_predict

                assert model is not None, "test-time augmentation runs a PyTorch model"  # open_for_prediction checks
                return tta_predict(model, x, self.meta.stride), None
            if want_raw and model is not None:
                out = model(x)
                return cast("tuple[torch.Tensor, Any]", out) if isinstance(out, (tuple, list)) else (out, None)
            return self.runner(x), None

    def decode(self, pred: torch.Tensor) -> list[torch.Tensor]:
        """Per image (n, 6) in input pixels, best first, on the CPU."""
        o = self.options
        if self.meta.layout == "end2end":  # final detections (YOLO26's one-to-one head, or NMS in the graph)
            dets = end_to_end_detections(pred.float(), o.conf_thres, classes=o.classes, max_det=o.max_det)
        else:
            dets = self.family.detections(
                pred.float(),
                o.conf_thres,
                self.iou_thres,
                classes=o.classes,
                agnostic=o.agnostic,
                multi_label=o.multi_label,
                max_det=o.max_det,
            )
        return [d.cpu() for d in dets]

    def predict(self, images: torch.Tensor, want_raw: bool = False) -> BatchPrediction:
        """Detections of a batch of letterboxed uint8 images (B, 3, H, W) RGB, in input pixels; timed."""
        t0 = _now(self.device)
        x = self.prepare(images)
        t1 = _now(self.device)
        pred, raw = self.infer(x, want_raw)
        t2 = _now(self.device)
        dets = self.decode(pred)
        t3 = _now(self.device)
        self.timer.seconds += (t1 - t0, t2 - t1, t3 - t2)
        self.timer.images += len(images)
        return BatchPrediction(dets, x, raw)

    def detect(self, images: list[np.ndarray], imgsz: int | None = None) -> list[np.ndarray]:
        """Detections (n, 6) = x1 y1 x2 y2 conf cls in pixels of each BGR image (any sizes, one at a time when their
        letterboxes differ): the whole path of detect.py, for your own code, at the size detect.py would use."""
        from utils.formats.metadata import inference_imgsz

        shape = inference_imgsz(self.meta, imgsz)
        out = []
        for image, (boxed, ratio_pad) in zip(images, self.letterboxed(images, shape)):
            pred = self.predict(to_batch([boxed]))
            input_hw = cast("tuple[int, int]", tuple(pred.images.shape[2:]))
            det = to_original(pred.detections[0], input_hw, image.shape[:2], ratio_pad)
            out.append(det.numpy())
        return out

    def letterboxed(
        self, images: Iterable[np.ndarray], shape: tuple[int, int]
    ) -> Iterator[tuple[np.ndarray, RatioPad]]:
        """Each BGR image letterboxed for this runner (RGB, CHW uint8) with its ratio and padding: to ``shape`` (h, w)
        from ``inference_imgsz``, exactly for a file with a fixed input shape, else padded only to a stride multiple
        (a PyTorch model takes any)."""
        fixed = self.meta.imgsz is not None
        for image in images:
            boxed, ratio, pad = letterbox(image, shape, auto=not fixed, stride=self.meta.stride)
            yield boxed[..., ::-1].transpose(2, 0, 1), ((ratio[1], ratio[0]), pad)


def to_batch(letterboxed: list[np.ndarray]) -> torch.Tensor:
    """CHW uint8 arrays of one shape as one contiguous (B, 3, H, W) tensor."""
    return torch.from_numpy(np.ascontiguousarray(np.stack(letterboxed)))


def to_original(
    det: torch.Tensor, input_hw: tuple[int, int], original_hw: tuple[int, int], ratio_pad: RatioPad | None
) -> torch.Tensor:
    """Detections (n, 6) in input pixels to a copy in pixels of the original image."""
    out = det.clone()
    scale_boxes(input_hw, out[:, :4], original_hw, ratio_pad)
    return out


def open_for_prediction(
    weights: str | Path, device: torch.device, *, end2end: bool = False, augment: bool = False, half: bool = False
) -> Runner:
    """The runner of ``weights`` (any format) for val.py and detect.py: ``--end2end``, ``--augment`` (PyTorch models,
    refused in one line otherwise) and ``--half`` (fp16 compute on CUDA devices for a PyTorch model; an exported file
    computes in the precision it was written in)."""
    from utils.formats import format_of, open_runner
    from utils.tta import check_tta_applies

    if augment and Path(weights).exists():  # before opening it: refused for any exported file
        check_tta_applies(str(weights), format_of(weights).name)
    runner = open_runner(weights, device, end2end=end2end)
    if augment:
        check_tta_applies(str(weights), runner.meta.kind, runner.meta.layout)
    if half and device.type != "cuda":
        LOGGER.warning("--half needs a CUDA device: running in fp32")
    elif half and not hasattr(runner, "half"):
        LOGGER.warning(f"--half: {weights} computes in the precision it was exported in ({runner.meta.precision})")
    elif half:
        cast(Any, runner).half()  # the PyTorch runner's, checked above
    return runner


def load_predictor(weights: str | Path, device: torch.device | str = "cpu", **options: Any) -> Predictor:
    """A predictor at detect.py's thresholds (``options``: PredictOptions' fields) for any weights file or export
    folder."""
    from models.families import family_of
    from utils.formats import open_runner

    runner = open_runner(weights, torch.device(device))
    return Predictor(
        runner, family_of(runner.meta.family), PredictOptions(**{"conf_thres": 0.25, **options}), purpose="detect"
    )


@contextlib.contextmanager
def threads_for(runner: Runner) -> Iterator[None]:
    """PyTorch's threads while ``runner`` predicts: for a runtime with its own thread pool (onnxruntime, ...) one,
    so that PyTorch's threads never spin on the cores the runtime computes on between their small pre- and
    post-processing ops; restored afterwards."""
    before = torch.get_num_threads()
    if runner.own_threads and runner.device.type == "cpu" and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
