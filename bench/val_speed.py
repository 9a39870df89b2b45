"""Validation speed on CPU: val.py on coco128 at 640 px, then NMS alone on 1,000 images of raw predictions.

    python bench/val_speed.py [--weights best.pt] [--images 1000] [--skip-val] [--skip-nms]

Without --weights a randomly initialised yolov5n is used. Its detection head starts from prior biases
(objectness ~8 objects per image, class ~0.6/nc), which put almost no box above conf 0.001: that run times
pre-processing and inference honestly but NMS hardly at all. --zero-head-bias sets those biases to 0
(objectness and class scores near 0.5), the worst case for NMS: every box and class passes conf 0.001 and
each image sends the full cap of 30,000 candidates to NMS, far more than a trained model does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.log import LOGGER, setup_logging  # noqa: E402
from utils.nms import non_max_suppression  # noqa: E402

DATA = ROOT.parent / "shared" / "datasets" / "coco128.yaml"


def random_checkpoint(path: Path, zero_head_bias: bool) -> Path:
    from models.yolo import Model
    from utils.checkpoint import model_state, save_checkpoint

    torch.manual_seed(0)
    model = Model(ROOT / "models" / "yolov5n.yaml", nc=80)
    if zero_head_bias:
        with torch.no_grad():
            for conv in model.model[-1].m:
                conv.bias.zero_()
    save_checkpoint(model_state(model), path)
    return path


def bench_val(weights: str | None, zero_head_bias: bool, imgsz: int, batch_size: int, workers: int) -> None:
    import val

    with tempfile.TemporaryDirectory() as tmp:
        label = weights or f"random yolov5n ({'zeroed' if zero_head_bias else 'prior'} head biases)"
        weights = weights or str(random_checkpoint(Path(tmp) / "yolov5n_random.pt", zero_head_bias))
        LOGGER.setLevel(logging.WARNING)  # keep val.py's table out of the benchmark output
        t0 = time.perf_counter()
        r = val.run(
            data=str(DATA),
            weights=weights,
            imgsz=imgsz,
            batch_size=batch_size,
            conf_thres=0.001,
            iou_thres=0.6,
            device="cpu",
            workers=workers,
            project=str(Path(tmp) / "runs"),
            noplots=True,
        )
        wall = time.perf_counter() - t0
        LOGGER.setLevel(logging.INFO)
    pre, inference, nms = r.speed
    per_image = pre + inference + nms
    print(
        f"val.py on {DATA.name}, {r.n_images} images at {imgsz} px, CPU ({torch.get_num_threads()} threads), "
        f"conf 0.001, weights: {label}"
    )
    print(
        f"  {1000 / per_image:.2f} images/s in the loop ({per_image:.1f} ms/image: {pre:.1f} pre-process, "
        f"{inference:.1f} inference, {nms:.1f} NMS); {r.n_images / wall:.2f} images/s including start-up"
    )
    print(f"  {r.n_detections / max(r.n_images, 1):.0f} detections per image after NMS; mAP50-95 {r.map:.4f}")
    if label.startswith("random"):
        print("  note: random weights; NMS load is unlike a trained model's (see this script's docstring)")


def synthetic_predictions(n: int, generator: torch.Generator, anchors: int = 25200, nc: int = 80) -> torch.Tensor:
    """Raw predictions shaped like a trained model's: ~10 objects each hit by a few dozen confident anchors
    (one dominant class), and a background whose objectness sits mostly far below 0.001."""
    pred = torch.empty((n, anchors, 5 + nc))
    pred[..., :2] = torch.rand((n, anchors, 2), generator=generator) * 640
    pred[..., 2:4] = torch.rand((n, anchors, 2), generator=generator) * 120 + 8
    pred[..., 4:] = torch.sigmoid(torch.randn((n, anchors, 1 + nc), generator=generator) * 2 - 10)
    for i in range(n):
        n_obj = int(torch.randint(3, 20, (1,), generator=generator))
        centres = torch.rand((n_obj, 2), generator=generator) * 600 + 20
        sizes = torch.rand((n_obj, 2), generator=generator) * 200 + 10
        classes = torch.randint(0, nc, (n_obj,), generator=generator)
        hits = torch.randint(0, anchors, (n_obj, 40), generator=generator)
        for k in range(n_obj):
            idx = hits[k]
            pred[i, idx, :2] = centres[k] + torch.randn((40, 2), generator=generator) * 4
            pred[i, idx, 2:4] = sizes[k] * (1 + torch.randn((40, 2), generator=generator) * 0.1)
            pred[i, idx, 4] = torch.rand(40, generator=generator) * 0.9 + 0.05
            pred[i, idx, 5 + classes[k]] = torch.rand(40, generator=generator) * 0.5 + 0.5
    return pred


def bench_nms(images: int, chunk: int = 8) -> None:
    generator = torch.Generator().manual_seed(0)
    nms_seconds, candidates, kept = 0.0, 0, 0
    for start in range(0, images, chunk):
        pred = synthetic_predictions(min(chunk, images - start), generator)
        candidates += int((pred[..., 4] > 0.001).sum())
        t0 = time.perf_counter()
        out = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, multi_label=True, max_det=300)
        nms_seconds += time.perf_counter() - t0
        kept += sum(len(o) for o in out)
    print(
        f"NMS alone on {images} images of synthetic raw predictions (25200 x 85, conf 0.001, IoU 0.6, "
        f"multi-label), CPU ({torch.get_num_threads()} threads):"
    )
    print(
        f"  {images / nms_seconds:.1f} images/s ({1000 * nms_seconds / images:.2f} ms/image); "
        f"{candidates / images:.0f} boxes/image above the objectness threshold, {kept / images:.0f} kept"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None, help="checkpoint (default: random yolov5n)")
    parser.add_argument("--zero-head-bias", action="store_true", help="random model: worst case for NMS")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=1000, help="images of synthetic predictions for NMS")
    parser.add_argument("--skip-val", action="store_true")
    parser.add_argument("--skip-nms", action="store_true")
    opt = parser.parse_args()
    setup_logging()
    if not opt.skip_val:
        if not DATA.is_file():
            sys.exit(f"{DATA}: dataset YAML not found")
        bench_val(opt.weights, opt.zero_head_bias, opt.imgsz, opt.batch_size, opt.workers)
    if not opt.skip_nms:
        bench_nms(opt.images)


if __name__ == "__main__":
    main()
