"""train.py's --compile side by side with eager: the training step (forward compiled, loss and backward as the
engine runs them, SGD update; no data loading), in one process on the same inputs.

    python bench/compile_step.py [--cfg yolov5n.yaml yolo11n.yaml] [--imgsz 320] [--batch-size 8] [--steps 10]
        [--backend inductor] [--device cpu]

Per model: the first compiled step (which compiles the forward and its backward graph), then eager and compiled
steps alternated, so that a machine's changing load falls on both alike; printed are both medians and their
ratio. Compilation happens once per new input shape (the last, smaller batch of an epoch and --multi-scale add
shapes, each compiled once), so a run pays the first-step figure once per shape.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.families import family_of  # noqa: E402
from models.yolo import load_model_config  # noqa: E402


def make_step(model, loss, family, images, targets, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)

    def step() -> float:
        t = time.perf_counter()
        out = family.forward_train(model, images, targets)
        total, _ = loss(out, targets)
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    return step


def measure(cfg: str, args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    cfg = load_model_config(cfg)
    family = family_of(cfg)
    name = Path(cfg.get("yaml_file", "model")).stem
    torch.manual_seed(0)
    eager = family.build_model(cfg, nc=80).to(device, memory_format=torch.channels_last).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=args.backend)  # as train.py's --compile: the forward, in place
    loss = family.make_loss(eager, family.read_hyp(family.default_hyp_path), imgsz=args.imgsz)
    b, n = args.batch_size, 4 * args.batch_size  # four objects per image
    images = torch.rand(b, 3, args.imgsz, args.imgsz, device=device).contiguous(memory_format=torch.channels_last)
    targets = torch.zeros(n, 6, device=device)
    targets[:, 0] = torch.arange(n, device=device) % b
    targets[:, 1] = torch.randint(0, 80, (n,), device=device).float()
    targets[:, 2:4] = torch.rand(n, 2, device=device) * 0.6 + 0.2
    targets[:, 4:6] = torch.rand(n, 2, device=device) * 0.3 + 0.05
    run_eager = make_step(eager, loss, family, images, targets, device)
    run_compiled = make_step(compiled, loss, family, images, targets, device)
    run_eager()  # eager's own first-step costs (allocations, oneDNN primitives) are not compile time
    first = run_compiled()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        times["eager"].append(run_eager())
        times["compiled"].append(run_compiled())
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return (
        f"{name} batch {b} at {args.imgsz}: first compiled step {first:.1f} s; median step eager "
        f"{e * 1000:.0f} ms, compiled {c * 1000:.0f} ms ({e / c:.2f}x)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", nargs="+", default=["yolov5n.yaml", "yolo11n.yaml"])
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps of each, alternated, after the first")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {args.backend}", flush=True)
    for cfg in args.cfg:
        print(measure(cfg, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
