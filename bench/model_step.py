"""The model step alone (forward, loss, backward, SGD step; no data): images/s by layout and precision.

python bench/model_step.py [--cfg models/yolov5n.yaml] [--imgsz 320] [--batch-size 16] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.families import YOLOV5  # noqa: E402
from models.loss import ComputeLoss  # noqa: E402
from models.yolo import Model  # noqa: E402
from utils.amp import cpu_supports_bf16  # noqa: E402


def images_per_second(
    cfg: str,
    imgsz: int,
    batch_size: int,
    steps: int,
    channels_last: bool,
    dtype: torch.dtype | None,
    device: torch.device,
) -> float:
    torch.manual_seed(0)
    model = Model(cfg, nc=80).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    compute_loss = ComputeLoss(model, YOLOV5.read_hyp(YOLOV5.default_hyp_path))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    imgs = torch.rand(batch_size, 3, imgsz, imgsz, device=device).contiguous(memory_format=fmt)
    n = 4 * batch_size  # four objects per image
    targets = torch.zeros(n, 6, device=device)
    targets[:, 0] = torch.arange(n, device=device) % batch_size
    targets[:, 1] = torch.randint(0, 80, (n,), device=device).float()
    targets[:, 2:4] = torch.rand(n, 2, device=device) * 0.6 + 0.2
    targets[:, 4:6] = torch.rand(n, 2, device=device) * 0.3 + 0.05
    for step in range(steps + 2):  # two warm-up steps create the kernels
        if step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = compute_loss(model(imgs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch_size / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default=str(ROOT / "models/yolov5n.yaml"))
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    print(
        f"{Path(args.cfg).stem}, batch {args.batch_size} at {args.imgsz}, {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
        + ("" if device.type == "cuda" or cpu_supports_bf16() else " (no native bf16 on this CPU)")
    )
    for channels_last in (False, True):
        for dtype in (None, low):
            ips = images_per_second(args.cfg, args.imgsz, args.batch_size, args.steps, channels_last, dtype, device)
            layout = "channels-last" if channels_last else "NCHW"
            print(f"  {layout:>13}, {str(dtype or torch.float32).replace('torch.', ''):>8}: {ips:7.1f} images/s")


if __name__ == "__main__":
    main()
