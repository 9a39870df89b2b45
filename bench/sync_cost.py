"""What the per-step all-reduce of the global counts costs against a training step, on 2 gloo ranks (CPU).

    python bench/sync_cost.py [--imgsz 320] [--batch-size 8] [--steps 4]

Each optimizer step makes one all-reduce of a few scalars (the positive counts of its micro-batches, the
previous step's losses, a save flag: see utils/engine/step.py's sync). This prints that collective's time per
step beside the time of a DDP step of yolov5n (forward, loss, backward with its gradient all-reduce, SGD) on
the same two ranks, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.families import YOLOV5  # noqa: E402
from models.loss import ComputeLoss  # noqa: E402
from models.yolo import Model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on the two cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    counts = torch.zeros(8)  # one micro-batch's 3 positive counts, 4 loss sums, the save flag
    for _ in range(10):
        dist.all_reduce(counts)
    t0 = time.perf_counter()
    for _ in range(args.reduces):
        dist.all_reduce(counts)
    per_reduce = (time.perf_counter() - t0) / args.reduces

    torch.manual_seed(0)
    model = Model(str(ROOT / "models/yolov5n.yaml"), nc=80).to(memory_format=torch.channels_last)
    compute_loss = ComputeLoss(model, YOLOV5.read_hyp(YOLOV5.default_hyp_path))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    imgs = torch.rand(args.batch_size, 3, args.imgsz, args.imgsz, generator=g).contiguous(
        memory_format=torch.channels_last
    )
    n = 3 * args.batch_size
    targets = torch.cat(
        (
            torch.arange(n).remainder(args.batch_size).unsqueeze(1).float(),
            torch.randint(0, 80, (n, 1), generator=g).float(),
            torch.rand(n, 2, generator=g) * 0.6 + 0.2,
            torch.rand(n, 2, generator=g) * 0.3 + 0.05,
        ),
        1,
    )
    for step in range(args.steps + 1):  # the first step creates the kernels
        if step == 1:
            t0 = time.perf_counter()
        loss, _ = compute_loss(ddp(imgs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    per_step = (time.perf_counter() - t0) / args.steps
    if rank == 0:
        Path(out).write_text(f"{per_reduce} {per_step}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reduces", type=int, default=500)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        mp.spawn(_rank, args=(_free_port(), args, out), nprocs=2, join=True)
        per_reduce, per_step = map(float, Path(out).read_text().split())
    print(
        f"2 gloo ranks, 1 thread each, yolov5n batch {args.batch_size} per rank at {args.imgsz}: "
        f"all-reduce of the step's counts {per_reduce * 1e3:.3f} ms, DDP step {per_step * 1e3:.0f} ms, "
        f"ratio {per_reduce / per_step:.2e}"
    )


if __name__ == "__main__":
    main()
