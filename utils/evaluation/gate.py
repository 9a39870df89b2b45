"""export.py's checks of every file it writes: the numeric check against PyTorch on one input, and the accuracy gate
(mAP50-95 on the val split through the same predictor as the PyTorch model, and latency at batch 1).

A file that fails either is set aside as ``<name>.rejected``; the others are kept. Nothing here knows a format:
it sees runners.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.families import Family
from utils.errors import UserError
from utils.evaluation.evaluator import DetectionEvaluator
from utils.evaluation.loop import evaluate
from utils.evaluation.predictor import PredictOptions, Predictor, threads_for
from utils.formats.base import Runner
from utils.log import LOGGER

# The largest mAP50-95 drop (absolute) a file may show against the PyTorch model, per precision of the file.
MAX_DROP = {"fp32": 0.001, "fp16": 0.003, "int8": 0.01}
# Numeric check tolerances (rtol, atol) against PyTorch computing in the file's precision: fp32, and fp16, whose
# 11-bit significand two runtimes' kernels round apart by a few units. fp16 box coordinates also get 4 units of
# the largest one: a centre near 0 is the difference of corners that may be hundreds of pixels, and keeps their
# rounding. INT8 files differ from float by design: the gate alone judges them.
CHECK_TOLERANCE = {"fp32": (1e-4, 1e-3), "fp16": (1e-2, 1e-2)}
LATENCY_RUNS, LATENCY_WARMUP = 50, 5
GATE_WORKERS_FROM = 100  # smaller val splits load in this process: starting workers would cost more


class Rejected(Exception):
    """A file failed a check; the message says which and by how much."""


def _difference(out: torch.Tensor, ref: torch.Tensor, layout: str) -> torch.Tensor:
    """Elementwise |out - ref|; for end-to-end outputs (B, k, 6) each row against its nearest row of the other,
    as top-k may order rows of equal score either way."""
    if layout != "end2end":
        return (out - ref).abs()
    gaps = (out[:, :, None, :] - ref[:, None, :, :]).abs()  # (B, k, k, 6)
    nearest = gaps.amax(-1).argmin(2)  # for each row of out, the closest row of ref
    return (out - ref.gather(1, nearest[..., None].expand(-1, -1, ref.shape[-1]))).abs()


def output_difference(out: torch.Tensor, ref: torch.Tensor, layout: str, precision: str) -> tuple[float, bool]:
    """The largest absolute difference of a file's output from PyTorch's (computing in the file's precision), and
    whether every element lies within the precision's tolerance (inf and False for another shape). Not applicable
    to INT8: (nan, True)."""
    if precision not in CHECK_TOLERANCE:
        return float("nan"), True
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        return float("inf"), False
    rtol, atol = CHECK_TOLERANCE[precision]
    allowed = atol + rtol * ref.abs()
    if precision == "fp16":
        boxes = torch.zeros_like(ref, dtype=torch.bool)
        (boxes[:, :4] if layout == "anchor_free" else boxes[..., :4]).fill_(True)  # (B, 4 + nc, A) or (B, N, 4 + ...)
        allowed = torch.where(boxes, allowed + 2**-8 * ref[boxes].abs().max(), allowed)
    difference = _difference(out, ref, layout)
    diff = float(difference.max()) if difference.numel() else 0.0
    return diff, not bool((difference > allowed).any())


def check_numerics(out: torch.Tensor, ref: torch.Tensor, layout: str, precision: str) -> float:
    """``output_difference``'s largest difference; ``Rejected`` past the tolerance."""
    diff, within = output_difference(out, ref, layout, precision)
    if not within:
        raise Rejected(
            f"output differs from PyTorch's (shape {tuple(out.shape)} vs {tuple(ref.shape)}, max abs "
            f"difference {diff:.3g})"
        )
    return diff


class AccuracyGate:
    """The val split, the PyTorch model's figures on it, and one row per file judged."""

    def __init__(
        self,
        data_cfg: dict[str, Any],
        family: Family,
        options: PredictOptions,
        shape: tuple[int, int, int],
        max_drop: dict[str, float],
    ):
        """``shape``: (image size, batch size, stride)."""
        from utils.data.loader import create_dataloader, load_labels

        if not data_cfg.get("val"):
            raise UserError(f"{data_cfg.get('yaml_file')}: no 'val' split for the accuracy gate")
        self.data_cfg, self.family, self.options, self.max_drop = data_cfg, family, options, max_drop
        labels = load_labels(data_cfg["val"], nc=int(data_cfg["nc"]), workers=0, prefix="gate: ", verbose=False)
        self.workers = 0 if len(labels) < GATE_WORKERS_FROM else min(os.cpu_count() or 1, 4)
        imgsz, batch_size, stride = shape
        self.loader, _ = create_dataloader(
            None,
            imgsz,
            batch_size,
            stride,
            augment=False,
            rect=False,
            workers=self.workers,
            nc=int(data_cfg["nc"]),
            label_set=labels,
        )
        self.image = first_image(self.loader)
        self.rows: list[GateRow] = []
        self.reference: GateRow | None = None

    @classmethod
    def for_source(cls, opt: Any, source: Any) -> AccuracyGate:
        """export.py's gate: its options, the source model as the reference at the same shape, batch and
        thresholds (an --nms file's own, else val.py's)."""
        from utils.data.config import load_data_config

        h, w = source.imgsz
        if h != w:
            raise UserError(f"--data: the gate validates square inputs; export with one --imgsz (not {h} {w})")
        nms = source.options.nms
        options = (
            PredictOptions(multi_label=True)
            if nms is None
            else PredictOptions(conf_thres=nms.conf, iou_thres=nms.iou, max_det=nms.max_det)
        )
        max_drop = dict(MAX_DROP) if opt.max_drop is None else dict.fromkeys(MAX_DROP, opt.max_drop)
        gate = cls(
            load_data_config(opt.data), source.family, options, (h, opt.batch_size, source.meta.stride), max_drop
        )
        results = gate.measure(source.runner)
        gate.reference = GateRow(
            "pytorch",
            "fp32",
            Path(opt.weights),
            Path(opt.weights).stat().st_size,
            results.map,
            None,
            latency_ms(source.runner, gate.image),
        )
        LOGGER.info(f"gate: the PyTorch model scores mAP50-95 {results.map:.4f} on {results.n_images} val images")
        return gate

    def measure(self, runner: Runner) -> Any:
        predictor = Predictor(runner, self.family, self.options)
        return evaluate(predictor, self.loader, DetectionEvaluator(self.data_cfg["names"]))

    def judge(self, format_name: str, path: Path, runner: Runner, failed: str = "") -> GateRow:
        """Validate a written file; its row says whether it passed. ``failed``: why it failed an earlier check (the
        row then gives its mAP beside the reason)."""
        from utils.formats.base import file_size

        assert self.reference is not None  # measured when the gate was made
        precision = runner.meta.precision
        value = self.measure(runner).map
        change = value - self.reference.map
        row = GateRow(format_name, precision, path, file_size(path), value, change, latency_ms(runner, self.image))
        both = f"mAP50-95 {value:.4f} against {self.reference.map:.4f} for the PyTorch model"
        if failed:
            row.rejected = f"{failed}; {both}"
        elif -change > self.max_drop[precision] + 1e-12:
            row.rejected = f"{both} (drop {-change:.4f} > {self.max_drop[precision]:g})"
        self.rows.append(row)
        return row

    def table(self) -> str:
        assert self.reference is not None
        return format_table(self.rows, self.reference, self.max_drop, cpu_name())


def split_map(
    runner: Runner,
    family: Family,
    data_cfg: dict[str, Any],
    split: Any,
    imgsz: int,
    workers: int,
    batch_size: int | None = None,
) -> float:
    """mAP50-95 of a runner on a split, at val.py's thresholds, square letterboxes of ``imgsz``."""
    return split_results(runner, family, data_cfg, split, imgsz, workers, batch_size).map


def split_results(
    runner: Runner,
    family: Family,
    data_cfg: dict[str, Any],
    split: Any,
    imgsz: int,
    workers: int,
    batch_size: int | None = None,
) -> Any:
    from utils.data.loader import create_dataloader, load_labels

    nc = int(data_cfg["nc"])
    labels = load_labels(split, nc=nc, workers=workers, prefix="gate: ", verbose=False)
    loader, _ = create_dataloader(
        None,
        imgsz,
        batch_size or runner.meta.batch or 1,
        runner.meta.stride,
        augment=False,
        rect=False,
        workers=workers,
        nc=nc,
        label_set=labels,
    )
    predictor = Predictor(runner, family, PredictOptions(multi_label=True))
    with threads_for(runner):  # as val.py runs it
        return evaluate(predictor, loader, DetectionEvaluator(data_cfg["names"]))


def latency_ms(runner: Runner, image: torch.Tensor) -> float:
    """Median milliseconds per image of the runner alone on one real image (batch 1; a file fixed to a larger batch
    runs that batch, divided by its size), after warm-up, with PyTorch's threads as val.py and detect.py leave them
    to a runtime that has its own."""
    batch = runner.meta.batch or 1
    x = image[None].expand(batch, -1, -1, -1).to(runner.input_dtype).contiguous()
    times = []
    with torch.no_grad(), threads_for(runner):
        for i in range(LATENCY_WARMUP + LATENCY_RUNS):
            t0 = time.perf_counter()
            runner(x)
            if i >= LATENCY_WARMUP:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3 / batch


def cpu_name() -> str:
    """The CPU's model name, as lscpu gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def set_aside(path: Path) -> Path:
    """``path`` renamed ``<name>.rejected`` (replacing an older one)."""
    target = path.with_name(path.name + ".rejected")
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    path.rename(target)
    return target


@dataclass
class GateRow:
    """One line of the table: a file and what the gate measured."""

    format: str
    precision: str
    path: Path
    size_bytes: int
    map: float | None = None
    change: float | None = None  # against the PyTorch model
    latency_ms: float | None = None
    rejected: str = ""  # why, when set aside


def format_table(rows: list[GateRow], reference: GateRow, max_drop: dict[str, float], device: str) -> str:
    """The gate's table: one line per file, the PyTorch model first."""
    head = f"{'format':<12}{'precision':<10}{'size MB':>9}{'mAP50-95':>10}{'change':>9}{'ms/img':>9}  file"
    lines = [f"Accuracy gate on the val split (latency at batch 1, median of {LATENCY_RUNS} runs on {device}):", head]
    for row in (reference, *rows):
        change = "" if row.change is None else f"{row.change:+.4f}"
        map_text = "" if row.map is None else f"{row.map:.4f}"
        latency = "" if row.latency_ms is None else f"{row.latency_ms:.2f}"
        verdict = f"  REJECTED: {row.rejected}" if row.rejected else ""
        lines.append(
            f"{row.format:<12}{row.precision:<10}{row.size_bytes / 1e6:>9.2f}{map_text:>10}{change:>9}"
            f"{latency:>9}  {row.path.name}{verdict}"
        )
    limits = ", ".join(f"{p} {v:g}" for p, v in max_drop.items())
    lines.append(f"largest allowed drop in mAP50-95: {limits}")
    return "\n".join(lines)


def first_image(loader: Any) -> torch.Tensor:
    """The loader's first image, letterboxed, (3, h, w) float in [0, 1]: the input of the latency runs."""
    imgs = next(iter(loader))[0]
    return imgs[0].float() / 255
