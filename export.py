"""Export a checkpoint (ours, YOLOv5's or Ultralytics') to ONNX and TorchScript, next to the weights.

Usage:
    python export.py --weights runs/train/exp/weights/best.pt --include onnx torchscript --imgsz 640
    python export.py --weights yolo26n.pt --end2end          # YOLO26's NMS-free output (B, 300, 6)

Writes ``best.onnx`` and ``best.torchscript``: input ``images`` (B, 3, H, W) in [0, 1], output ``output0`` in
the model's layout: YOLOv5 (B, A, 5 + nc); YOLOv8 / YOLO11 / YOLO26 (B, 4 + nc, A), xywh in input pixels then
class scores, as Ultralytics' exports; with --end2end (YOLO26) (B, 300, 6) = x1 y1 x2 y2 score class. Each
file's output is compared with the PyTorch model's on the same input before it is kept (the largest absolute
difference is printed); a file that disagrees is deleted and reported. Both carry their metadata under the keys
Ultralytics' exporter writes (names, stride, task, batch, imgsz, end2end, ...) and this project's own record,
which detect.py and val.py read (models/backends.py).
"""
from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from models.backends import METADATA_FILE, ModelMeta, OnnxRuntimeModel, PredictionsOnly, TorchScriptModel
from utils.cli import INFERENCE_IMGSZ_HELP, add_device, add_end2end, add_half, add_imgsz, make_parser
from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, colorstr, setup_logging
from utils.process import setup_process
from utils.torch_utils import select_device

FORMATS = ("onnx", "torchscript")
# The torch.onnx TorchScript-based exporter used here writes opsets up to 20; onnxruntime 1.16+ runs opset 20.
DEFAULT_OPSET = 20
# An exported file is kept when it agrees with PyTorch within these (predictions in pixels and scores): (rtol, atol)
# for fp32, and for fp16 (--half), whose 11-bit significand two runtimes' kernels round apart by a few units.
# fp16 box coordinates also get 4 units of the largest one: a centre near 0 is the difference of corners that
# may be hundreds of pixels, and keeps their rounding.
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (1e-2, 1e-2)}


def _difference(out: torch.Tensor, ref: torch.Tensor, layout: str) -> torch.Tensor:
    """Elementwise |out - ref|; for end-to-end outputs (B, k, 6) each row against its nearest row of the other,
    as top-k may order rows of equal score either way."""
    if layout != "end2end":
        return (out - ref).abs()
    gaps = (out[:, :, None, :] - ref[:, None, :, :]).abs()  # (B, k, k, 6)
    nearest = gaps.amax(-1).argmin(2)  # for each row of out, the closest row of ref
    return (out - ref.gather(1, nearest[..., None].expand(-1, -1, ref.shape[-1]))).abs()


def check_export(kind: str, path: Path, out: torch.Tensor, ref: torch.Tensor, layout: str,
                 dtype: torch.dtype = torch.float32) -> float:
    """Compare an exported file's output with PyTorch's (the model computing in ``dtype``); delete the file and raise
    when they disagree."""
    out, ref = out.float(), ref.float()
    rtol, atol = CHECK_TOLERANCE[dtype]
    allowed = atol + rtol * ref.abs()
    if dtype == torch.float16:
        boxes = torch.zeros_like(ref, dtype=torch.bool)
        (boxes[:, :4] if layout == "anchor_free" else boxes[..., :4]).fill_(True)  # (B, 4 + nc, A) or (B, N, 4 + ...)
        allowed = torch.where(boxes, allowed + 2**-8 * ref[boxes].abs().max(), allowed)
    difference = _difference(out, ref, layout) if out.shape == ref.shape else None
    diff = float(difference.max()) if difference is not None else float("inf")
    if difference is None or (difference > allowed).any():
        path.unlink(missing_ok=True)
        raise UserError(f"{path}: {kind} output differs from PyTorch's (shape {tuple(out.shape)} vs "
                        f"{tuple(ref.shape)}, max abs difference {diff:.3g}); file removed")
    return diff


def export_torchscript(model: torch.nn.Module, im: torch.Tensor, path: Path, meta: ModelMeta) -> Path:
    """Trace the model (fixed input shape) and save it with its metadata as an extra file."""
    with warnings.catch_warnings():  # tracing is deprecated in favour of torch.export, but is what TorchScript needs
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(model, im, strict=False, check_trace=False)
    traced.save(str(path), _extra_files={METADATA_FILE: meta.to_json(export_batch=im.shape[0])})
    return path


def _simplify(path: Path) -> str:
    """Simplify the ONNX graph in place with onnxslim when it is installed; say what happened."""
    try:
        import onnxslim
    except ImportError:
        return "not simplified (pip install onnxslim to simplify)"
    import onnx

    slim = onnxslim.slim(onnx.load(str(path)))
    onnx.save(slim, str(path))
    return f"simplified by onnxslim {getattr(onnxslim, '__version__', '')}".rstrip()


def export_onnx(model: torch.nn.Module, im: torch.Tensor, path: Path, meta: ModelMeta, opset: int, dynamic: bool,
                simplify: bool) -> tuple[Path, str]:
    """Export with torch.onnx (TorchScript-based exporter), optionally simplify, then store the metadata."""
    try:
        import onnx
    except ImportError as e:
        raise UserError("ONNX export needs the onnx package (pip install onnx onnxruntime)") from e
    dynamic_axes = {"images": {0: "batch"}, "output0": {0: "batch"}} if dynamic else None
    with warnings.catch_warnings():  # the TorchScript-based exporter is deprecated, not removed; it needs no onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (im,), str(path), dynamo=False, opset_version=opset, do_constant_folding=True,
                          input_names=["images"], output_names=["output0"], dynamic_axes=dynamic_axes)
    note = _simplify(path) if simplify else "not simplified (--no-simplify)"
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    for key, value in meta.onnx_props(export_batch=im.shape[0]).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))
    return path, note


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("Export a detector checkpoint to ONNX and TorchScript")
    model = parser.add_argument_group("model")
    model.add_argument("--weights", type=str, required=True,
                       help="checkpoint (.pt: this project's, YOLOv5's or Ultralytics' detection model)")
    add_imgsz(model, help=INFERENCE_IMGSZ_HELP, pair=True)
    model.add_argument("--batch-size", type=int, default=1, help="batch size of the exported input")
    # Traced on the CPU unless asked otherwise, as YOLOv5 does: the exported graph does not depend on a GPU.
    add_device(model, default="cpu")
    add_half(model)
    output = parser.add_argument_group("output (written beside --weights)")
    output.add_argument("--include", nargs="+", default=list(FORMATS), help=f"formats: {', '.join(FORMATS)}")
    output.add_argument("--dynamic", action="store_true", help="ONNX: any batch size")
    add_end2end(output)
    output.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset")
    output.add_argument("--no-simplify", dest="simplify", action="store_false",
                        help="ONNX: keep the graph as traced (default: simplified with onnxslim when installed)")
    return parser


def run(**options: Any) -> list[Path]:
    """``python export.py`` from Python: the same option names and defaults; returns the files written."""
    defaults = vars(build_parser().parse_args(["--weights", ""]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"run() got unknown option(s): {', '.join(unknown)}")
    return run_options(argparse.Namespace(**{**defaults, **options}))


def run_options(opt: argparse.Namespace) -> list[Path]:
    from models.backends import default_imgsz, load_for_inference

    include = [f.lower() for f in opt.include]
    unknown = sorted(set(include) - set(FORMATS))
    if unknown:
        raise UserError(f"--include {' '.join(unknown)}: unknown format; choose from {', '.join(FORMATS)}")
    weights = Path(opt.weights)
    if weights.suffix != ".pt":
        raise UserError(f"{weights}: export starts from a .pt checkpoint")
    device = select_device(opt.device)
    if opt.half and device.type != "cuda":  # an fp16 file is what was asked for: no silent fp32 one instead
        raise UserError(f"--half exports fp16 on a CUDA device; --device {opt.device or device.type} is not one "
                        "(use --device 0)")
    model, meta = load_for_inference(weights, device, end2end=opt.end2end)
    if opt.half:
        model.half()
    asked = opt.imgsz
    if asked is None:
        size, source = default_imgsz(meta)
        LOGGER.info(f"image size {size} ({source})")
        asked = [size]
    imgsz = list(asked) * 2 if len(asked) == 1 else list(asked)
    if len(imgsz) != 2 or any(s % meta.stride for s in imgsz):
        raise UserError(f"--imgsz {' '.join(map(str, asked))}: give one or two multiples of the stride {meta.stride}")
    if opt.batch_size < 1:
        raise UserError(f"--batch-size {opt.batch_size}: must be at least 1")
    meta.imgsz, meta.batch = (imgsz[0], imgsz[1]), None if opt.dynamic and "onnx" in include else opt.batch_size
    wrapped = PredictionsOnly(model).eval()
    for p in wrapped.parameters():
        p.requires_grad_(False)
    # A reproducible input in [0, 1] like a real image; zeros would leave most activations untested.
    im = torch.rand(opt.batch_size, 3, *imgsz, generator=torch.Generator().manual_seed(0)).to(device)
    if opt.half:
        im = im.half()
    with torch.no_grad():
        ref = wrapped(im).float()
    LOGGER.info(f"{colorstr('export:')} {weights} input {tuple(im.shape)}, output {tuple(ref.shape)} "
                f"({meta.family}, {meta.layout} layout), {meta.nc} classes, stride {meta.stride}")

    written = []
    for kind in include:
        t0 = time.time()
        if kind == "torchscript":
            ts_meta = ModelMeta(**{**vars(meta), "batch": opt.batch_size})
            path = export_torchscript(wrapped, im, weights.with_suffix(".torchscript"), ts_meta)
            note = "traced"
            loaded = TorchScriptModel(path, device)
        else:
            path, note = export_onnx(wrapped, im, weights.with_suffix(".onnx"), meta, opset=opt.opset,
                                     dynamic=opt.dynamic, simplify=opt.simplify)
            note = f"opset {opt.opset}{', dynamic batch' if opt.dynamic else ''}, {note}"
            loaded = OnnxRuntimeModel(path, device)
        with torch.no_grad():
            diff = check_export(kind, path, loaded(im), ref, meta.layout, im.dtype)
        size_mb = path.stat().st_size / 1e6
        print(f"{kind}: {path} ({size_mb:.1f} MB, {note}, {time.time() - t0:.1f}s); "
              f"max abs difference from PyTorch {diff:.3g}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    setup_logging()
    LOGGER.info(setup_process(opt.device))
    return run_reporting_errors(lambda: run_options(opt) and None)


if __name__ == "__main__":
    sys.exit(main())
