"""val.py and detect.py against Ultralytics' validator and predictor: whole-process time on the same weights and
images, with the .pt and with the fp32 ONNX, side by side on this machine.

    python bench/inference_vs_ultralytics.py --ultralytics-python /work/venv-ul/bin/python --weights yolo11n.pt

``--weights`` is an Ultralytics detection checkpoint (both sides read it: this project imports it). The ONNX file is
this project's fp32 export of it (export.py, batch 1, static), which both sides run. Settings, the same on both sides
(written in each command below): the data YAML's val split at ``--imgsz``, the CPU, no plots; val at ``--batch``
with ``--workers`` loader workers for the .pt and at the file's batch 1 for the ONNX; detect on the val images at
batch 1 (both sides' default), default thresholds (conf 0.25, IoU 0.7), nothing saved. Each pair runs ``--pairs``
times, alternating which side goes first; printed: each wall time, and the ratio ours / Ultralytics' (below 1:
ours is faster) per case, the median over the pairs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ultralytics_side_by_side import ROOT, absolute_data_yaml, run_timed, ultralytics_env  # noqa: E402

_COCO128 = "shared/datasets/coco128.yaml"
COCO128 = next((p / _COCO128 for p in ROOT.parents if (p / _COCO128).exists()), ROOT.parent / _COCO128)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", required=True, help="a Python with ultralytics installed")
    p.add_argument("--weights", required=True, help="an Ultralytics detection .pt (e.g. a yolo11n trained on --data)")
    p.add_argument("--data", default=str(COCO128), help="data YAML; its val split is validated and detected on")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=32, help="val batch size with the .pt")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--cases", nargs="+", default=["val-pt", "val-onnx", "detect-pt", "detect-onnx"])
    p.add_argument("--out", default=str(ROOT / "runs/bench_inference"))
    return p


def commands(
    case: str, args: argparse.Namespace, weights: Path, onnx: Path, data: Path, images: Path, out: Path
) -> tuple[list[str], list[str]]:
    """(ours, Ultralytics') command lines of one case."""
    task, kind = case.split("-")
    model = weights if kind == "pt" else onnx
    yolo = str(Path(args.ultralytics_python).parent / "yolo")
    if task == "val":
        batch = args.batch if kind == "pt" else 1
        ours = [
            sys.executable,
            "val.py",
            "--data",
            str(data),
            "--weights",
            str(model),
            "--imgsz",
            str(args.imgsz),
            "--batch-size",
            str(batch),
            "--workers",
            str(args.workers),
            "--device",
            "cpu",
            "--noplots",
            "--project",
            str(out / "ours"),
            "--exist-ok",
        ]
        theirs = [
            yolo,
            "detect",
            "val",
            f"model={model}",
            f"data={data}",
            f"imgsz={args.imgsz}",
            f"batch={batch}",
            f"workers={args.workers}",
            "device=cpu",
            "plots=False",
            f"project={out / 'ultralytics'}",
            "name=val",
            "exist_ok=True",
        ]
    else:
        ours = [
            sys.executable,
            "detect.py",
            "--weights",
            str(model),
            "--source",
            str(images),
            "--imgsz",
            str(args.imgsz),
            "--device",
            "cpu",
            "--nosave",
            "--project",
            str(out / "ours"),
            "--exist-ok",
        ]
        theirs = [
            yolo,
            "detect",
            "predict",
            f"model={model}",
            f"source={images}",
            f"imgsz={args.imgsz}",
            "device=cpu",
            "save=False",
            f"project={out / 'ultralytics'}",
            "name=predict",
            "exist_ok=True",
        ]
    return ours, theirs


def val_images(data: Path) -> Path:
    import yaml

    cfg = yaml.safe_load(data.read_text())
    val = cfg["val"] if isinstance(cfg["val"], str) else cfg["val"][0]
    return Path(cfg["path"]) / val


def main() -> int:
    args = build_parser().parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = absolute_data_yaml(Path(args.data), out)
    weights = out / Path(args.weights).name
    shutil.copyfile(args.weights, weights)
    subprocess.run(
        [sys.executable, "export.py", "--weights", str(weights), "--include", "onnx", "--imgsz", str(args.imgsz)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    onnx = weights.with_suffix(".onnx")
    images = val_images(data)
    print(
        f"{weights.name} and {onnx.name} on {images} at {args.imgsz} px, CPU; val batch {args.batch} (.pt) / 1 "
        f"(.onnx), {args.workers} workers; {args.pairs} pair(s), alternating order",
        flush=True,
    )
    env = ultralytics_env(out, args.ultralytics_python)
    for case in args.cases:
        ours_cmd, theirs_cmd = commands(case, args, weights, onnx, data, images, out)
        ratios = []
        for pair in range(args.pairs):
            order = [("ours", ours_cmd), ("ultralytics", theirs_cmd)]
            times = {}
            for side, cmd in order if pair % 2 == 0 else order[::-1]:
                measured = run_timed(cmd, ROOT, out / f"{case}_{side}_{pair}.log", env=env)
                if measured.exit_code:
                    raise SystemExit(f"{case} {side} failed (exit {measured.exit_code}); see {measured.log}")
                times[side] = measured.wall_s
            ratios.append(times["ours"] / times["ultralytics"])
            print(
                f"{case:12s} pair {pair + 1}: ours {times['ours']:.2f} s, Ultralytics {times['ultralytics']:.2f} s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(
            f"{case:12s} median ratio ours / Ultralytics: {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
