"""The model's forward pass at inference, batch 1: milliseconds per image by memory layout and SiLU's form.

    python bench/inference_layout.py [--cfg yolo11n.yaml] [--imgsz 320] [--runs 100] [--rounds 3]

Four settings of the same fused model (random weights, 80 classes) on one random image: contiguous or channels-last
layout, and SiLU writing a new tensor (the form autograd needs) or overwriting the convolution's output (what
models/common.py's Conv does when no gradient is recorded). The plain form is selected by running with gradients
enabled on a model and an input that require none: nothing is recorded, only the branch changes. Each round runs
``--runs`` passes of every setting, in alternating blocks of 10 (the machine's speed drifts); printed per setting:
the median time per pass of each round, and the median over the rounds of its ratio to the anchor in the same round
(contiguous, plain SiLU: what the code did before either change).
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

from models.yolo import build_model  # noqa: E402

SETTINGS = {  # name: (channels_last, in-place SiLU)
    "contiguous, plain SiLU (anchor)": (False, False),
    "contiguous, in-place SiLU": (False, True),
    "channels-last, plain SiLU": (True, False),
    "channels-last, in-place SiLU": (True, True),
}


def block_seconds(model: torch.nn.Module, image: torch.Tensor, in_place: bool, passes: int) -> list[float]:
    times = []
    with torch.set_grad_enabled(not in_place):
        for _ in range(passes):
            start = time.perf_counter()
            model(image)
            times.append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="yolo11n.yaml")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = build_model(args.cfg, nc=80).fuse().eval().requires_grad_(False)
    image = torch.rand(1, 3, args.imgsz, args.imgsz)
    layouts = {
        False: (model, image),  # the same weights in both layouts
        True: (
            copy.deepcopy(model).to(memory_format=torch.channels_last),
            image.contiguous(memory_format=torch.channels_last),
        ),
    }
    for channels_last, in_place in SETTINGS.values():  # warm-up: every kernel created once
        block_seconds(*layouts[channels_last], in_place, 10)
    per_round: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(max(1, args.runs // 10)):
            for name, (channels_last, in_place) in SETTINGS.items():
                times[name] += block_seconds(*layouts[channels_last], in_place, 10)
        for name in SETTINGS:
            per_round[name].append(1000 * statistics.median(times[name]))
    anchor = per_round[next(iter(SETTINGS))]
    print(
        f"{args.cfg} at {args.imgsz} px, batch 1, {torch.get_num_threads()} threads, {args.rounds} rounds of "
        f"{args.runs} passes per setting"
    )
    for name, values in per_round.items():
        ratio = statistics.median(v / a for v, a in zip(values, anchor))
        print(f"{name:34s} {', '.join(f'{v:.2f}' for v in values)} ms per image; {ratio:.2f}x the anchor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
