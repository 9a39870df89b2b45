"""Whether Ultralytics' own validator and predictor read this project's exports: the anchor-free ONNX (plain and
``--nms``) and OpenVINO files of an Ultralytics checkpoint, beside Ultralytics' own ONNX export of it.

    python bench/ultralytics_reads_exports.py --ultralytics-python /work/venv-ul/bin/python --weights yolo11n.pt \\
        --data data.yaml --imgsz 320

export.py writes our files from ``--weights``; Ultralytics (``--ultralytics-python``, its own process) then validates
the checkpoint and each file on the val split (``yolo detect val``, batch 1) and predicts on the first val images
with our ONNX and with its own ONNX export of the same weights. Printed: mAP50-95 per file as Ultralytics' validator
scores it, and the largest box and score difference between the two ONNX files' detections (the same count of
detections per image is required). Exit status 1 when a file does not load or the detections differ in count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.inference_vs_ultralytics import val_images  # noqa: E402
from bench.ultralytics_side_by_side import ROOT, absolute_data_yaml, final_map, ultralytics_env  # noqa: E402

# Run in Ultralytics' Python: its ONNX export of the checkpoint, then both ONNX files' detections compared.
_COMPARE = """
import sys
from pathlib import Path
from ultralytics import YOLO
weights, ours, images, imgsz = sys.argv[1], sys.argv[2], sorted(Path(sys.argv[3]).iterdir())[:20], int(sys.argv[4])
theirs = YOLO(weights).export(format="onnx", imgsz=imgsz, verbose=False)
a, b = YOLO(theirs, task="detect"), YOLO(ours, task="detect")
box = score = 0.0
for image in images:
    p, q = (m.predict(str(image), imgsz=imgsz, verbose=False)[0].boxes.data for m in (a, b))
    if len(p) != len(q):
        sys.exit(f"{image.name}: {len(p)} detections with Ultralytics' ONNX, {len(q)} with ours")
    if len(p):
        p, q = p[p[:, 4].argsort(descending=True)], q[q[:, 4].argsort(descending=True)]
        box = max(box, float((p[:, :4] - q[:, :4]).abs().max()))
        score = max(score, float((p[:, 4] - q[:, 4]).abs().max()))
print(f"RESULT {len(images)} images: largest box difference {box:.4f} px, score difference {score:.5f}")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", required=True, help="a Python with ultralytics installed")
    p.add_argument("--weights", required=True, help="an Ultralytics anchor-free detection .pt")
    p.add_argument("--data", required=True, help="data YAML whose val split both read")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--out", default=str(ROOT / "runs/bench_ultralytics_reads"))
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = absolute_data_yaml(Path(args.data), out)
    env = ultralytics_env(out, args.ultralytics_python)
    files = {}
    for name, extra in (("plain", ["--include", "onnx", "openvino"]), ("nms", ["--include", "onnx", "--nms"])):
        (out / name).mkdir(exist_ok=True)
        weights = out / name / Path(args.weights).name
        shutil.copyfile(args.weights, weights)
        subprocess.run(
            [sys.executable, "export.py", "--weights", str(weights), "--imgsz", str(args.imgsz), *extra],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        files[name] = weights
    checkpoint, onnx = files["plain"], files["plain"].with_suffix(".onnx")
    openvino, nms = out / "plain" / f"{checkpoint.stem}_openvino_model", files["nms"].with_suffix(".onnx")
    yolo = str(Path(args.ultralytics_python).parent / "yolo")
    failed = False
    for label, model in (
        ("checkpoint", checkpoint),
        ("our ONNX", onnx),
        ("our OpenVINO", openvino),
        ("our ONNX --nms", nms),
    ):
        log = out / f"val_{label.replace(' ', '_')}.log"
        with open(log, "w") as f:
            code = subprocess.call(
                [
                    yolo,
                    "detect",
                    "val",
                    f"model={model}",
                    f"data={data}",
                    f"imgsz={args.imgsz}",
                    "batch=1",
                    "device=cpu",
                    "plots=False",
                    f"project={out / 'val'}",
                    "name=v",
                    "exist_ok=True",
                ],
                cwd=out,
                env={**os.environ, **env},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        failed |= code != 0
        print(
            f"Ultralytics' validator, {label:16s} ({model.name}): exit {code}, mAP50-95 {final_map(log):.4f}",
            flush=True,
        )
    done = subprocess.run(
        [args.ultralytics_python, "-c", _COMPARE, str(checkpoint), str(onnx), str(val_images(data)), str(args.imgsz)],
        cwd=out,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    print(
        f"Ultralytics' predictor, its ONNX against ours: "
        f"{result[0][7:] if result else (done.stderr or done.stdout).strip().splitlines()[-1:]}"
    )
    return int(failed or done.returncode != 0)


if __name__ == "__main__":
    sys.exit(main())
