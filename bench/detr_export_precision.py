"""The DETR families' exports at every precision through export.py's accuracy gate, on narrowed models whose val
split is labelled with the PyTorch model's own detections.

    python bench/detr_export_precision.py --out /tmp/detr-precision

A narrowed model with random weights detects nothing real, so on a real val split both it and its files score 0
and the gate says nothing. Here the val images (random pixels, written losslessly) are labelled with what the
PyTorch model itself detects on them (its best detections lying inside the image, ``--per-image`` per image on
average): the PyTorch model scores close to 1, and a file's mAP50-95 is how closely it reproduces those detections,
ranked as PyTorch ranks them. The models: D-FINE from tests/fixtures/detr/dfine_tiny_official.pth (the official
code's initialisation) and the narrowed RT-DETRv2 of tests/test_detr.py with its convolutions and norms
initialised as PyTorch initialises them (transformers' initialisation ties every encoder score: docs/deploy.md).

For each family and precision (fp32, fp16, int8: INT8 calibrated on as many train images, random pixels too) it
runs ``export.py --include onnx openvino --data ...`` and prints the gate's table (and the one line naming
the files set aside or the refusal). Only mAP is measured: the gate's latency runs are cut to 3 (``--latency-runs``) to save time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the narrowed RT-DETRv2 of tests/test_detr.py

import export  # noqa: E402
from models.families import DFINE  # noqa: E402
from models.loading import load_model  # noqa: E402
from utils.checkpoint import save_checkpoint  # noqa: E402
from utils.errors import UserError  # noqa: E402

SIZE = 128
FIXTURES = ROOT / "tests" / "fixtures" / "detr"


def dfine_checkpoint(folder: Path) -> Path:
    """The narrowed D-FINE the official code built (tests/fixtures/detr), as a checkpoint of ours."""
    table = yaml.safe_load((FIXTURES / "dfine_tiny.yaml").read_text())
    DFINE.scales = lambda: table  # type: ignore[method-assign]  # the narrowed scale, for this process only
    model, _ = load_model(FIXTURES / "dfine_tiny_official.pth")
    path = folder / "dfine_tiny.pt"
    save_checkpoint({"model_cfg": model.yaml, "model": model.state_dict(), "names": ["a", "b", "c"]}, path)
    return path


def rtdetrv2_checkpoint(folder: Path) -> Path:
    """The narrowed RT-DETRv2 of tests/test_detr.py, convolutions and norms as PyTorch initialises them."""
    from test_detr import narrowed_rtdetrv2

    hf = narrowed_rtdetrv2()
    for module in hf.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.BatchNorm2d)):
            module.reset_parameters()
    hf.save_pretrained(folder / "rtdetrv2_tiny")
    model, ckpt = load_model(folder / "rtdetrv2_tiny")
    path = folder / "rtdetrv2_tiny.pt"
    save_checkpoint({"model_cfg": model.yaml, "model": model.state_dict(), "names": ["a", "b"]}, path)
    return path


def self_labelled_split(weights: Path, folder: Path, n_train: int, n_val: int, per_image: int) -> Path:
    """Random-pixel images (PNG), the val ones labelled with the model's own best detections (those lying inside
    the image, above one score chosen so that there are ``per_image`` per image on average); the data YAML."""
    model, _ = load_model(weights)
    model.eval()
    rng = np.random.default_rng(0)
    found = []
    for split, n in (("train", n_train), ("val", n_val)):
        (folder / "images" / split).mkdir(parents=True, exist_ok=True)
        (folder / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            rgb = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            cv2.imwrite(str(folder / "images" / split / f"{i:04d}.png"), rgb[..., ::-1])
            (folder / "labels" / split / f"{i:04d}.txt").write_text("")
            if split == "val":
                with torch.no_grad():
                    det, _ = model(torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255)
                inside = [
                    d for d in det[0].tolist() if 0 <= d[0] < d[2] - 2 <= SIZE - 2 and 0 <= d[1] < d[3] - 2 <= SIZE - 2
                ]
                found.append(inside)
    scores = sorted((d[4] for dets in found for d in dets), reverse=True)
    cut = scores[min(per_image * n_val, len(scores)) - 1]
    for i, dets in enumerate(found):
        rows = [
            f"{int(c)} {(x1 + x2) / 2 / SIZE:.6f} {(y1 + y2) / 2 / SIZE:.6f} {(x2 - x1) / SIZE:.6f} {(y2 - y1) / SIZE:.6f}"
            for x1, y1, x2, y2, score, c in dets
            if score >= cut
        ]
        (folder / "labels" / "val" / f"{i:04d}.txt").write_text("\n".join(rows) + "\n" if rows else "")
    names = list(model.names)
    data = {"path": str(folder), "train": "images/train", "val": "images/val", "nc": len(names), "names": names}
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump(data))
    print(
        f"{weights.name}: val labels its {sum(s >= cut for s in scores)} detections scoring >= {cut:.4f} on {n_val} images"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="working folder (models, data, exported files)")
    parser.add_argument("--families", nargs="+", default=["dfine", "rtdetrv2"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"])
    parser.add_argument("--formats", nargs="+", default=["onnx", "openvino"])
    parser.add_argument("--n-train", type=int, default=16, help="train images (INT8 calibration)")
    parser.add_argument("--n-val", type=int, default=8)
    parser.add_argument("--per-image", type=int, default=8, help="labels per val image: PyTorch's best detections")
    parser.add_argument("--latency-runs", type=int, default=3, help="the gate's latency runs (mAP only is measured)")
    opt = parser.parse_args()
    from utils.evaluation import gate

    gate.LATENCY_RUNS, gate.LATENCY_WARMUP = opt.latency_runs, 1
    makers = {"dfine": dfine_checkpoint, "rtdetrv2": rtdetrv2_checkpoint}
    for name in opt.families:
        folder = opt.out / name
        folder.mkdir(parents=True, exist_ok=True)
        weights = makers[name](folder)
        data = self_labelled_split(weights, folder / "data", opt.n_train, opt.n_val, opt.per_image)
        for precision in opt.precisions:
            print(f"=== {name} {precision}", flush=True)
            try:  # a file set aside is named in the UserError after the gate's table is printed
                export.run(
                    weights=str(weights),
                    include=opt.formats,
                    imgsz=[SIZE],
                    data=str(data),
                    half=precision == "fp16",
                    int8=precision == "int8",
                )
            except UserError as e:
                print(f"{name} {precision}: {e}", flush=True)


if __name__ == "__main__":
    main()
