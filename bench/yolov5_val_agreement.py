"""val.py against YOLOv5's val.py on the same weights and data: mAP50 and mAP50-95 side by side.

    python bench/yolov5_val_agreement.py --weights runs/train/exp/weights/best.pt --data data/shapes.yaml \
        --yolov5 /path/to/yolov5 --yolov5-python /path/to/venv/bin/python --imgsz 256

A checkpoint of ours is first turned into a YOLOv5 checkpoint by YOLOv5's own code (its ``Model`` built from the
checkpoint's model YAML, our EMA weights loaded with ``strict=True``, pickled the way YOLOv5 saves). Both val.py
then read that one file: YOLOv5's by unpickling its classes, ours through its safe YOLOv5 import. A YOLOv5
checkpoint (``--weights`` ending in a file YOLOv5 wrote) is used as it is. Both run on the CPU with the same
image size, batch size, thresholds (conf 0.001, IoU 0.6) and split.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Runs in YOLOv5's interpreter, inside its checkout: our checkpoint -> a YOLOv5 checkpoint.
TO_YOLOV5 = """
import sys, torch
from models.yolo import Model
ours = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
model = Model(ours["model_cfg"], ch=3, nc=len(ours["names"]))
state = dict(ours["ema"] or ours["model"])
stride = state.pop("model.%d.stride" % (len(model.model) - 1))  # a buffer of ours, an attribute of YOLOv5's
assert torch.equal(stride, model.stride), (stride, model.stride)
model.load_state_dict(state, strict=True)
model.names, model.nc = dict(enumerate(ours["names"])), len(ours["names"])  # set by YOLOv5 train.py
torch.save({"model": model.half().eval(), "ema": None, "updates": None, "optimizer": None, "epoch": -1}, sys.argv[2])
"""

ALL_ROW = re.compile(r"^\s*all\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def figures(output: str, who: str) -> dict[str, float]:
    """P, R, mAP50, mAP50-95 of the 'all' row a val.py prints."""
    rows = ALL_ROW.findall(output)
    if not rows:
        raise SystemExit(f"{who}: no 'all' row in its output:\n{output[-3000:]}")
    images, instances, p, r, map50, map50_95 = rows[-1]
    return {
        "images": int(images),
        "instances": int(instances),
        "P": float(p),
        "R": float(r),
        "mAP50": float(map50),
        "mAP50-95": float(map50_95),
    }


def run(cmd: list[str], cwd: Path, who: str) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{who} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="a checkpoint of ours, or a YOLOv5 .pt")
    p.add_argument("--data", default=str(ROOT / "data/shapes.yaml"))
    p.add_argument("--yolov5", required=True, help="a YOLOv5 checkout")
    p.add_argument("--yolov5-python", default=sys.executable, help="the Python that runs the YOLOv5 checkout")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    yolov5 = Path(args.yolov5).resolve()
    for path, what in ((Path(args.weights), "--weights"), (Path(args.data), "--data"), (yolov5 / "val.py", "--yolov5")):
        if not path.is_file():
            raise SystemExit(f"{path}: not found ({what})")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        weights = Path(args.weights).resolve()
        if _is_ours(weights):
            converted = out / f"{weights.stem}_yolov5.pt"
            run([args.yolov5_python, "-c", TO_YOLOV5, str(weights), str(converted)], yolov5, "conversion")
            weights = converted
        # YOLOv5 resolves a relative `path:` against its working directory: give it an absolute one.
        data = yaml.safe_load(Path(args.data).read_text())
        data["path"] = str((Path(args.data).resolve().parent / data.get("path", "")).resolve())
        data.pop("builtin", None)
        data_yaml = out / "data.yaml"
        data_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
        common = [
            "--weights",
            str(weights),
            "--data",
            str(data_yaml),
            "--imgsz",
            str(args.imgsz),
            "--batch-size",
            str(args.batch_size),
            "--conf-thres",
            "0.001",
            "--iou-thres",
            "0.6",
            "--device",
            "cpu",
            "--workers",
            "0",
            "--project",
            str(out),
            "--exist-ok",
        ]
        their_output = run([args.yolov5_python, "val.py", *common, "--name", "yolov5"], yolov5, "YOLOv5 val.py")
        theirs = figures(their_output, "YOLOv5 val.py")
        ours = figures(run([sys.executable, "val.py", *common, "--name", "ours"], ROOT, "our val.py"), "our val.py")

    print(f"weights: {args.weights}  data: {args.data}  imgsz {args.imgsz}, conf 0.001, IoU 0.6, CPU")
    print(f"{'':14}{'images':>8}{'boxes':>8}{'P':>8}{'R':>8}{'mAP50':>9}{'mAP50-95':>10}")
    for who, f in (("YOLOv5 val.py", theirs), ("our val.py", ours)):
        print(
            f"{who:14}{f['images']:>8}{f['instances']:>8}{f['P']:>8.3f}{f['R']:>8.3f}{f['mAP50']:>9.4f}"
            f"{f['mAP50-95']:>10.4f}"
        )
    if "NMS time limit" in their_output:  # YOLOv5 drops the rest of a batch whose NMS takes over 0.5 + 0.05 * bs s
        print("WARNING YOLOv5's NMS hit its time limit: its figures miss detections (run on an idle machine)")
    print(
        f"difference (ours - YOLOv5): mAP50 {ours['mAP50'] - theirs['mAP50']:+.4f}, "
        f"mAP50-95 {ours['mAP50-95'] - theirs['mAP50-95']:+.4f}"
    )
    return 0


def _is_ours(weights: Path) -> bool:
    """Our checkpoints load with weights_only=True; YOLOv5's hold pickled classes and do not."""
    import pickle

    import torch

    try:
        checkpoint = torch.load(weights, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # YOLOv5's pickled classes: weights_only refuses them
        return False
    return isinstance(checkpoint, dict) and "model_cfg" in checkpoint


if __name__ == "__main__":
    sys.exit(main())
