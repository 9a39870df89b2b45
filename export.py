"""Export a checkpoint (ours, YOLOv5's or Ultralytics') to deployable formats, next to the weights, and prove each
file still detects.

Usage:
    python export.py --weights runs/train/exp/weights/best.pt --include onnx torchscript --imgsz 640
    python export.py --weights best.pt --include onnx --half --data data.yaml      # fp16, checked on the val split
    python export.py --weights best.pt --include onnx --nms                       # NMS inside the ONNX graph
    python export.py --weights yolo26n.pt --end2end          # YOLO26's NMS-free output (B, 300, 6)

One precision per call: fp32, ``--half`` (fp16) or ``--int8`` (calibrated on the data YAML's train split). Files are
named as Ultralytics names them (``best.onnx``, ``best_int8.onnx``, ``best_openvino_model/``, ...), with ``_fp16``
where Ultralytics would write fp16 under the fp32 name. Each file is run on the same input as the PyTorch model
and kept only if it agrees; with ``--data`` each is also validated on the val split through the same predictor as
the PyTorch model, and a file whose mAP50-95 drops by more than ``--max-drop`` is set aside as ``<name>.rejected``.
INT8 files, and those a family's ``gate_judges`` names (D-FINE's and RT-DETRv2's fp16), are judged by the gate
alone and need ``--data``.
One table gives format, precision, size, mAP50-95, its change and the latency per image. Exit status 1 names
every file set aside. The formats are modules of utils/formats/; each file carries its metadata where
Ultralytics' exports keep it.
"""

from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.families import titles_by
from utils.cli import (
    INFERENCE_IMGSZ_HELP,
    add_allow_pipe,
    add_device,
    add_end2end,
    add_half,
    add_imgsz,
    add_max_pixels,
    apply_data_limits,
    make_parser,
    positive_int,
)
from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, colorstr, setup_logging
from utils.process import setup_process
from utils.storage import is_url, local_copy, open_storage, split
from utils.torch_utils import select_device

DEFAULT_INCLUDE = ("onnx", "torchscript")
# --nms bakes detect.py's defaults into the graph: with them it finds what detect.py finds with the .pt.
DETECT_CONF, DETECT_MAX_DET = 0.25, 1000


def build_parser() -> argparse.ArgumentParser:
    from utils.formats import export_names
    from utils.formats.onnx import DEFAULT_OPSET

    parser = make_parser("Export a detector checkpoint and check each file on the user's data")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--weights",
        type=str,
        required=True,
        help="checkpoint (.pt: this project's, YOLOv5's or Ultralytics' detection model; a DETR's official .pth or Hugging Face folder)",
    )
    add_imgsz(model, help=INFERENCE_IMGSZ_HELP, pair=True)
    model.add_argument("--batch-size", type=positive_int, default=1, help="batch size of the exported input")
    # Traced on the CPU unless asked otherwise, as YOLOv5 does: the exported graph does not depend on a GPU.
    add_device(model, default="cpu")
    add_end2end(model)
    precision = parser.add_argument_group("precision of the written files (one per call; default fp32)")
    add_half(precision)
    precision.add_argument(
        "--int8", action="store_true", help="INT8 files, calibrated on images of --data's train split (needs --data)"
    )
    output = parser.add_argument_group("output (written beside --weights)")
    output.add_argument(
        "--include", nargs="+", default=list(DEFAULT_INCLUDE), help=f"formats: {', '.join(export_names())}"
    )
    output.add_argument("--dynamic", action="store_true", help="ONNX and OpenVINO: any batch size")
    output.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset")
    output.add_argument(
        "--no-simplify",
        dest="simplify",
        action="store_false",
        help="ONNX: keep the graph as traced (default: simplified with onnxslim, when installed)",
    )
    output.add_argument(
        "--nms",
        action="store_true",
        help="ONNX: NMS inside the graph; output (B, max-det, 6) = x1 y1 x2 y2 score class",
    )
    output.add_argument("--conf-thres", type=float, default=DETECT_CONF, help="--nms: confidence threshold")
    output.add_argument(
        "--iou-thres",
        type=float,
        default=None,
        help=f"--nms: NMS IoU threshold (default: detect.py's, {titles_by(lambda f: f.detect_iou)})",
    )
    output.add_argument("--max-det", type=int, default=DETECT_MAX_DET, help="--nms: detections kept per image")
    gate = parser.add_argument_group("accuracy gate")
    gate.add_argument(
        "--data",
        type=str,
        default=None,
        help="dataset YAML: validate every file on its val split against the PyTorch model (and "
        "calibrate --int8 on its train split)",
    )
    add_allow_pipe(gate)
    add_max_pixels(gate)
    gate.add_argument(
        "--max-drop",
        type=float,
        default=None,
        help="largest allowed mAP50-95 drop, absolute (default: 0.001 fp32, 0.003 fp16, 0.01 int8)",
    )
    return parser


def run(**options: Any) -> list[Path]:
    """``python export.py`` from Python: the same option names and defaults; returns the files kept. Raises
    ``UserError`` naming every file set aside."""
    defaults = vars(build_parser().parse_args(["--weights", ""]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"run() got unknown option(s): {', '.join(unknown)}")
    return run_options(argparse.Namespace(**{**defaults, **options}))


@dataclass
class Source:
    """The PyTorch model every file is exported from, and what each file's job shares."""

    runner: Any  # utils.formats.pytorch.PytorchRunner
    family: Any  # the family's hooks
    module: torch.nn.Module  # images in [0, 1] to output0
    imgsz: tuple[int, int]
    example: torch.Tensor
    precision: str
    options: Any  # utils.formats.base.ExportOptions
    meta: Any = None  # what every file says about itself (before its own precision, batch, nms)
    calibration: Any = None
    gate: Any = None  # the accuracy gate, with --data
    rows: list = field(default_factory=list)


def _precision(opt: argparse.Namespace) -> str:
    if opt.half and opt.int8:
        raise UserError("--half and --int8: one precision per call (run export.py once for each)")
    if opt.int8 and not opt.data:
        raise UserError("--int8 needs --data: INT8 is calibrated on images of the data YAML's train split")
    return "int8" if opt.int8 else "fp16" if opt.half else "fp32"


def _formats(opt: argparse.Namespace, precision: str, options: Any) -> list[Any]:
    from utils.formats import format_named

    names = list(dict.fromkeys(f.lower() for f in opt.include))
    formats = [format_named(name) for name in names]
    for fmt in formats:
        fmt.check_request(options, precision)
    return formats


def prepare(opt: argparse.Namespace) -> tuple[Source, list[Any]]:
    """Every check that can fail before a file is written, then the source model and its example input."""
    from models.families import family_of
    from utils.formats.base import ExportOptions, NmsSpec
    from utils.formats.metadata import inference_imgsz
    from utils.formats.pytorch import FORMAT as PYTORCH
    from utils.formats.pytorch import load_pytorch

    precision = _precision(opt)
    weights = Path(opt.weights)
    if not PYTORCH.recognizes(weights):
        raise UserError(f"{weights}: export starts from a checkpoint (.pt, or a DETR's .pth or Hugging Face folder)")
    if opt.batch_size < 1:
        raise UserError(f"--batch-size {opt.batch_size}: must be at least 1")
    if opt.nms and opt.end2end:
        raise UserError("--nms and --end2end: the end-to-end output is already final; it needs no NMS")
    if not weights.exists():
        from models.families import missing_weights_message

        raise UserError(missing_weights_message(weights, "weights file"))
    runner = load_pytorch(weights, select_device(opt.device))
    family = family_of(runner.meta.family)
    nms = (
        NmsSpec(opt.conf_thres, family.detect_iou if opt.iou_thres is None else opt.iou_thres, opt.max_det)
        if opt.nms
        else None
    )
    options = ExportOptions(opset=opt.opset, dynamic=opt.dynamic, simplify=opt.simplify, nms=nms, end2end=opt.end2end)
    formats = _formats(opt, precision, options)
    for fmt in formats:
        refusal = family.export_refusal(fmt.name, precision)
        if refusal:
            raise UserError(f"{weights}: {refusal}")
        unjudged = family.gate_judges(fmt.name, precision)
        if unjudged and not opt.data:
            raise UserError(
                f"{weights}: {family.title} {precision} {fmt.name} files need --data: {unjudged}, so only the "
                "accuracy gate on your val split can judge them"
            )
    if any(fmt.name == "onnx" for fmt in formats) and opt.opset < family.min_onnx_opset:
        raise UserError(
            f"{weights}: --opset {opt.opset}: {family.title} is exported at opset {family.min_onnx_opset} or newer "
            "(older opsets split LayerNorm into operations whose fp16 Pow overflows)"
        )
    if opt.end2end:
        runner.use_end2end(weights)
    module = family.export_module(runner.model, end2end=opt.end2end)
    for p in module.parameters():
        p.requires_grad_(False)
    imgsz = inference_imgsz(runner.meta, opt.imgsz, opt.weights)
    # A reproducible input in [0, 1] like a real image; zeros would leave most activations untested.
    example = torch.rand(opt.batch_size, 3, *imgsz, generator=torch.Generator().manual_seed(0)).to(runner.device)
    meta = runner.meta.copy(imgsz=imgsz, batch=None if opt.dynamic else opt.batch_size, trained_imgsz=None)
    return Source(runner, family, module, imgsz, example, precision, options, meta), formats


def export_one(fmt: Any, source: Source, weights: Path) -> tuple[Path, str]:
    """Write one file, run the numeric check on it and, with --data, the gate; returns (path kept or set aside, why
    it was set aside or '')."""
    from utils.evaluation.gate import Rejected, check_numerics, output_difference, set_aside
    from utils.formats.base import ExportJob, file_size

    path = fmt.output_path(weights, source.precision)
    nms = source.options.nms
    meta = source.meta.copy(
        kind=fmt.name,
        precision=source.precision,
        nms=None if nms is None else nms.as_dict(),
        layout="end2end" if nms is not None else source.meta.layout,
    )
    job = ExportJob(
        module=source.module,
        model=source.runner.model,
        family=source.family,
        example=source.example,
        meta=meta,
        path=path,
        precision=source.precision,
        options=source.options,
        int8_scope=source.family.int8_float_scope(source.runner.model),
        calibration=source.calibration,
    )
    t0 = time.time()
    note = fmt.write(job)
    runner = fmt.open(path, source.runner.device)
    reason = ""
    with torch.no_grad():
        out, reference = runner(source.example), fmt.reference_module(job)(job.module_in(source.precision)[1])
    gate_alone = source.family.gate_judges(fmt.name, source.precision)
    try:
        if gate_alone and out.shape == reference.shape:  # reported, no criterion: the gate (--data) judges it
            diff = output_difference(out, reference, meta.layout, source.precision)[0]
        else:
            diff = check_numerics(out, reference, meta.layout, source.precision)
        shown = f"{diff:.3g}" if diff == diff else "n/a"
        if gate_alone or diff != diff:
            shown += f" (the gate judges it: {gate_alone or 'INT8'})"
    except Rejected as e:
        reason, shown = str(e), "past the tolerance"
    print(
        f"{fmt.name}: {path} ({file_size(path) / 1e6:.1f} MB, {note}, {time.time() - t0:.1f}s); "
        f"max abs difference from PyTorch {shown}"
    )
    if source.gate is not None:
        reason = source.gate.judge(fmt.name, path, runner, failed=reason).rejected
    del runner  # the runtime lets go of the file before it is renamed
    if reason:
        target = set_aside(path)
        LOGGER.error(f"{path}: {reason}; set aside as {target.name}")
        return target, reason
    return path, ""


def run_options(opt: argparse.Namespace) -> list[Path]:
    apply_data_limits(opt)
    if is_url(opt.weights):  # exported from a download, and each file uploaded beside the URL
        url = opt.weights
        with local_copy(url) as local:
            kept = export_files(argparse.Namespace(**{**vars(opt), "weights": str(local)}))
            folder = open_storage(split(url)[0])
            for path in kept:
                folder.upload_tree(path, path.name)
                LOGGER.info(f"{path.name} uploaded to {folder.full(path.name)}")
        return kept
    return export_files(opt)


def export_files(opt: argparse.Namespace) -> list[Path]:
    source, formats = prepare(opt)
    weights = Path(opt.weights)
    LOGGER.info(
        f"{colorstr('export:')} {weights} input {tuple(source.example.shape)} ({source.meta.family}, "
        f"{source.meta.layout} layout), {source.meta.nc} classes, stride {source.meta.stride}, "
        f"{source.precision}"
    )
    if opt.data:
        from utils.evaluation.gate import AccuracyGate

        source.gate = AccuracyGate.for_source(opt, source)
        if source.precision == "int8":
            from utils.evaluation.calibration import make_calibration

            source.calibration = make_calibration(
                source.gate.data_cfg, source.imgsz[0], source.meta.stride, source.family, workers=source.gate.workers
            )
    kept, rejected = [], []
    for fmt in formats:
        path, reason = export_one(fmt, source, weights)
        (rejected if reason else kept).append(path)
    if source.gate is not None:
        print(source.gate.table())
    if rejected:
        raise UserError(f"{len(rejected)} file(s) set aside: {', '.join(str(p) for p in rejected)}")
    return kept


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    setup_logging()
    LOGGER.info(setup_process(opt.device))
    return run_reporting_errors(lambda: run_options(opt) and None)


if __name__ == "__main__":
    sys.exit(main())
