"""What keeping freed memory (utils/process.py) does to a training step and to inference, in fresh processes.

    python bench/allocator.py [--imgsz 320] [--batch-size 16] [--steps 8] [--pairs 3]

Each pair runs the same measurement in two new processes, glibc's default first, then with
``keep_freed_memory()``; prints images/s of both and their ratio (the machine's speed drifts, so compare
within a pair).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(keep: bool, imgsz: int, batch_size: int, steps: int) -> dict[str, float]:
    """In this process: images/s of yolov5n training steps and of fused inference (batch x2, as validation)."""
    sys.path.insert(0, str(ROOT))
    from utils.process import keep_freed_memory

    if keep:
        keep_freed_memory()
    import torch
    from model_step import images_per_second  # bench/model_step.py: the same training step, timed

    from models.yolo import Model

    cfg = str(ROOT / "models/yolov5n.yaml")
    result = {"train": images_per_second(cfg, imgsz, batch_size, steps, True, None, torch.device("cpu"))}
    torch.manual_seed(0)
    fused = Model(cfg, nc=80).to(memory_format=torch.channels_last).eval().fuse()
    batch = torch.rand(2 * batch_size, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        fused(batch)  # creates the kernels
        start = time.perf_counter()
        for _ in range(steps):
            fused(batch)
    result["inference"] = steps * 2 * batch_size / (time.perf_counter() - start)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--child", choices=["default", "keep"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.imgsz, args.batch_size, args.steps, args.pairs) < 1:
        p.error("--imgsz, --batch-size, --steps and --pairs must be at least 1")
    if args.child:
        print(json.dumps(measure(args.child == "keep", args.imgsz, args.batch_size, args.steps)))
        return
    print(f"yolov5n, batch {args.batch_size} at {args.imgsz} (inference: batch {2 * args.batch_size}, BN folded)")
    for pair in range(args.pairs):
        runs = {}
        for mode in ("default", "keep"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--imgsz",
                    str(args.imgsz),
                    "--batch-size",
                    str(args.batch_size),
                    "--steps",
                    str(args.steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[mode] = json.loads(out.splitlines()[-1])
        for part in ("train", "inference"):
            a, b = runs["default"][part], runs["keep"][part]
            print(
                f"pair {pair + 1} {part:>9}: glibc default {a:6.1f} images/s, freed memory kept {b:6.1f} "
                f"images/s, {b / a:.2f}x"
            )


if __name__ == "__main__":
    main()
