"""cuDNN's benchmark on and off, on a CUDA GPU: what a new input shape costs the first time, and the steady step.

    python bench/cudnn_benchmark.py            # yolo11n, fp16 autocast, channels_last, as train.py runs it
    python bench/cudnn_benchmark.py --device cpu --imgsz 64 --batch-size 2   # the code path at toy sizes, no GPU

    python bench/cudnn_benchmark.py --val-layouts   # benchmark off: validation's first calls per layout and precision

``--val-layouts`` times validation's first calls on a fused model in eval mode, in four settings: channels_last or
contiguous (NCHW) tensors, under fp16 autocast or in fp16 weights (``--half``, Ultralytics' validator's way).

Each setting runs in a process of its own (cuDNN keeps its choices per process; a fresh interpreter on CUDA, a fork
on the CPU). Printed per setting: the first
inference of four rectangular validation-like shapes (batch 32, 384-480 x 640) and the same calls again, then the
first training step at batch 64 x 640 x 640 and the median of 12 more. Why it matters: training keeps the
benchmark (one shape), validation turns it off (utils/validation.py), where every new rectangle would be timed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.yolo import build_model  # noqa: E402

VAL_HEIGHTS = (384, 416, 448, 480)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _val_shapes(
    model: torch.nn.Module,
    fmt: torch.memory_format,
    autocast: bool,
    half: bool,
    device: str,
    imgsz: int,
    batch_size: int,
) -> tuple[list[float], list[float]]:
    """Seconds of the first and of the second inference at each of the four validation-like shapes (half
    ``batch_size``, VAL_HEIGHTS scaled to ``imgsz``, multiples of the stride), under fp16 autocast or in fp16."""

    def infer(h: int) -> None:
        height = max(32, h * imgsz // 640 // 32 * 32)
        x = torch.rand(max(batch_size // 2, 1), 3, height, imgsz, device=device).contiguous(memory_format=fmt)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            model(x.half() if half else x)

    first = [_timed(lambda: infer(h)) for h in VAL_HEIGHTS]
    return first, [_timed(lambda: infer(h)) for h in VAL_HEIGHTS]


def measure(cfg: str, benchmark: bool, device: str = "cuda", imgsz: int = 640, batch_size: int = 64) -> str:
    """Validation at half ``batch_size`` in four rectangles (0.6-0.75 of ``imgsz`` high), training at ``batch_size``."""
    torch.backends.cudnn.benchmark = benchmark
    fmt = torch.channels_last
    model = build_model(cfg, nc=80).to(device, memory_format=fmt)
    on_gpu = device != "cpu"  # fp16 autocast as train.py runs it on CUDA; fp32 on the CPU, as train.py does there

    def train_step() -> None:
        x = torch.rand(batch_size, 3, imgsz, imgsz, device=device).contiguous(memory_format=fmt)
        with torch.autocast("cuda", dtype=torch.float16, enabled=on_gpu):
            out = model.train()(x)
        sum(o.float().mean() for o in out).backward()

    first, again = _val_shapes(model.eval(), fmt, on_gpu, False, device, imgsz, batch_size)
    first_step = _timed(train_step)
    steady = sorted(_timed(train_step) for _ in range(12))[6]
    return (
        f"benchmark {'on ' if benchmark else 'off'}: validation shapes first "
        f"{' '.join(f'{t:.2f}' for t in first)} s, again {' '.join(f'{t * 1000:.0f}' for t in again)} ms; training first step {first_step:.1f} s, "
        f"then median {steady * 1000:.1f} ms"
    )


VAL_SETTINGS = ("channels_last autocast", "contiguous autocast", "channels_last half", "contiguous half")


def measure_val(cfg: str, setting: str, device: str = "cuda", imgsz: int = 640, batch_size: int = 64) -> str:
    """Benchmark off: the first and second calls of the four validation shapes, in one of VAL_SETTINGS."""
    torch.backends.cudnn.benchmark = False
    layout, precision = setting.split()
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    on_gpu = device != "cpu"
    model = build_model(cfg, nc=80).fuse().eval().to(device, memory_format=fmt)
    half = precision == "half" and on_gpu  # the CPU runs fp32 either way, as val.py does there
    if half:
        model.half()

    first, again = _val_shapes(model, fmt, on_gpu and not half, half, device, imgsz, batch_size)
    return (
        f"validation, {setting}: first {' '.join(f'{t:.2f}' for t in first)} s, "
        f"again {' '.join(f'{t * 1000:.0f}' for t in again)} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="yolo11n.yaml")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to run the code path without a GPU")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=64, help="training batch (validation's is half of it)")
    p.add_argument("--val-layouts", action="store_true", help="validation's first calls in VAL_SETTINGS instead")
    p.add_argument("--one", choices=("on", "off", *VAL_SETTINGS), help=argparse.SUPPRESS)  # a child's own setting
    args = p.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("needs a CUDA GPU (--device cpu runs the code path)")
        return 1
    sizes = ["--device", args.device, "--imgsz", str(args.imgsz), "--batch-size", str(args.batch_size)]
    if args.one in VAL_SETTINGS:
        print(measure_val(args.cfg, args.one, args.device, args.imgsz, args.batch_size), flush=True)
        return 0
    if args.one:
        print(measure(args.cfg, args.one == "on", args.device, args.imgsz, args.batch_size), flush=True)
        return 0
    settings = VAL_SETTINGS if args.val_layouts else ("off", "on")
    where = torch.cuda.get_device_name() if args.device != "cpu" else "the CPU"
    print(f"{args.cfg} on {where}, torch {torch.__version__}", flush=True)
    if args.device == "cpu":
        # No cuDNN to keep apart: a fork per setting, without another interpreter's start-up (a dry run's time).
        context = multiprocessing.get_context("fork")
        for setting in settings:
            child = context.Process(target=_print_one, args=(args.cfg, setting, args.imgsz, args.batch_size))
            child.start()
            child.join()
            if child.exitcode:
                return child.exitcode
        return 0
    for setting in settings:
        subprocess.run([sys.executable, __file__, "--cfg", args.cfg, *sizes, "--one", setting], check=True)
    return 0


def _print_one(cfg: str, setting: str, imgsz: int, batch_size: int) -> None:
    if setting in VAL_SETTINGS:
        print(measure_val(cfg, setting, "cpu", imgsz, batch_size), flush=True)
    else:
        print(measure(cfg, setting == "on", "cpu", imgsz, batch_size), flush=True)


if __name__ == "__main__":
    sys.exit(main())
