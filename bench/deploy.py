"""Our exports against Ultralytics' exports of the same weights, format by format and precision by precision:
mAP50-95 change on the val split and latency per image at batch 1, side by side on this machine.

    python bench/deploy.py --ultralytics-python /work/venv-ul/bin/python --weights yolo11n.pt --data data.yaml \\
        --imgsz 320 --formats onnx openvino litert ncnn --precisions fp32 fp16 int8

``--weights`` is an Ultralytics detection checkpoint: this project imports it (export.py), Ultralytics' exporter
reads it as it is (``--ultralytics-python``, a Python with ultralytics installed, run as a separate process), so
both sides export the same weights. The same settings on both sides:

* input ``--imgsz`` square, batch 1, static shapes, on the CPU;
* INT8 calibrated on the same images: those this project picks from the train split (utils/evaluation/calibration.py,
  up to 300), given to Ultralytics as a data YAML listing exactly them;
* every file, ours and theirs, is scored by this project's predictor and evaluator on the val split at val.py's
  thresholds (square letterboxes of ``--imgsz``), against the PyTorch model run the same way; the latency is the
  runtime alone on one val image at batch 1, the median of 50 runs after 5 warm-up runs, ours and theirs timed in
  alternating blocks of 10 runs, with ``--threads`` threads on both sides.

Formats come from the registry (utils/formats/): one asked for that this version does not have, or whose package
is missing here, is skipped with one line. ``--end2end``: our files with YOLO26's NMS-free output, which
Ultralytics' exporter writes for YOLO26 by default. Printed: one row per format and precision with both sides'
mAP50-95 change, latency and size, and for INT8 the goals (our drop at most max(half of theirs, theirs - 0.01) +
0.002 and at most 0.01; our latency at most 1.05 x theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ultralytics_side_by_side import ROOT, ultralytics_env  # noqa: E402

# Ultralytics' format names and precision arguments (8.4: ``quantize``).
ULTRALYTICS_FORMAT = {
    "onnx": "onnx",
    "torchscript": "torchscript",
    "openvino": "openvino",
    "litert": "litert",
    "ncnn": "ncnn",
}
ULTRALYTICS_QUANTIZE = {"fp32": None, "fp16": 16, "int8": 8}

# Run in Ultralytics' Python: export one file, print its path as the last line.
_ULTRALYTICS_EXPORT = """
import json, sys
from ultralytics import YOLO
kwargs = json.loads(sys.argv[2])
print("EXPORTED", YOLO(sys.argv[1]).export(**kwargs))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", required=True, help="a Python with ultralytics installed")
    p.add_argument("--weights", required=True, help="an Ultralytics detection .pt")
    p.add_argument("--data", required=True, help="data YAML: val split scored, train split calibrates INT8")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--formats", nargs="+", default=["onnx", "openvino", "litert", "ncnn"])
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"], choices=["fp32", "fp16", "int8"])
    p.add_argument("--calibration-images", type=int, default=300)
    p.add_argument("--end2end", action="store_true", help="our files with the NMS-free output (YOLO26)")
    p.add_argument("--threads", type=int, default=0, help="threads of every runtime (default: PyTorch's)")
    p.add_argument("--out", default=str(ROOT / "runs/bench_deploy"))
    return p


@dataclass
class Side:
    """One side's file of a format and precision, and what was measured on it."""

    path: Path | None = None
    map: float = float("nan")
    ms: float = float("nan")
    mb: float = float("nan")
    error: str = ""


def available(names: list[str]) -> list:
    """The registry's formats among ``names``, in that order; one line for each skipped."""
    from utils.errors import UserError
    from utils.formats import format_named

    found = []
    for name in names:
        try:
            found.append(format_named(name))
        except UserError as e:
            print(f"skipped {name}: {e}")
    return found


def calibration_yaml(args: argparse.Namespace, cfg: dict, out: Path) -> Path:
    """A data YAML for Ultralytics whose train and val list exactly our calibration images."""
    import yaml

    from utils.evaluation.calibration import calibration_labels

    files = [str(Path(f).resolve()) for f in calibration_labels(cfg, args.calibration_images).im_files]
    listing = out / "calibration.txt"
    listing.write_text("\n".join(files) + "\n")
    path = out / "calibration.yaml"
    path.write_text(
        yaml.safe_dump(
            {"path": str(out), "train": str(listing), "val": str(listing), "names": dict(enumerate(cfg["names"]))},
            sort_keys=False,
        )
    )
    return path


def ours(args: argparse.Namespace, fmt, precision: str, folder: Path) -> Path:  # noqa: ANN001 (Format)
    """export.py on a copy of the weights in ``folder`` (gate off: max-drop 1, the bench measures)."""
    import export

    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / Path(args.weights).name
    shutil.copyfile(args.weights, weights)
    (path,) = export.run(
        weights=str(weights),
        include=[fmt.name],
        imgsz=[args.imgsz],
        half=precision == "fp16",
        int8=precision == "int8",
        data=args.data if precision == "int8" else None,
        max_drop=1.0,
        end2end=args.end2end,
    )
    return path


def theirs(args: argparse.Namespace, fmt, precision: str, folder: Path, calibration: Path) -> Path:  # noqa: ANN001
    """Ultralytics' exporter, in its own process, on a copy of the weights in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / Path(args.weights).name
    shutil.copyfile(args.weights, weights)
    kwargs = {"format": ULTRALYTICS_FORMAT[fmt.name], "imgsz": args.imgsz, "batch": 1, "device": "cpu"}
    if ULTRALYTICS_QUANTIZE[precision]:
        kwargs["quantize"] = ULTRALYTICS_QUANTIZE[precision]
    if precision == "int8":
        kwargs["data"] = str(calibration)
    done = subprocess.run(
        [args.ultralytics_python, "-c", _ULTRALYTICS_EXPORT, str(weights), json.dumps(kwargs)],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**os.environ, **ultralytics_env(folder, args.ultralytics_python)},
    )
    (folder / "ultralytics_export.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("EXPORTED ")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"Ultralytics' export failed: {tail[0]} (log: {folder / 'ultralytics_export.log'})")
    return Path(lines[-1].split(" ", 1)[1].strip())


def measure(side: Side, family, cfg: dict, imgsz: int):  # noqa: ANN001, ANN201 (a runner)
    """mAP50-95 on val of the file at ``side.path``, through this project's predictor; returns its runner."""
    from utils.evaluation.gate import split_map
    from utils.formats import open_runner
    from utils.formats.base import file_size

    runner = open_runner(side.path)
    side.map = split_map(runner, family, cfg, cfg["val"], imgsz, 0, batch_size=1)
    side.mb = file_size(side.path) / 1e6
    return runner


def paired_latency(runners: list, image, runs: int = 50, block: int = 10) -> list[float]:  # noqa: ANN001
    """Median milliseconds per image at batch 1 of each runner on one val image, after 5 warm-up runs each, timed
    in alternating blocks of ``block`` runs, so that a change in the machine's load falls on both sides alike. Each
    runner gets the image in its input dtype and PyTorch's threads as val.py and detect.py leave them to it."""
    import statistics
    import time

    import torch

    from utils.evaluation.predictor import threads_for

    inputs = [image[None].to(runner.input_dtype).contiguous() for runner in runners]
    times: list[list[float]] = [[] for _ in runners]
    with torch.no_grad():
        for runner, x in zip(runners, inputs):
            for _ in range(5):
                runner(x)
        for _ in range(runs // block):
            for runner, x, spent in zip(runners, inputs, times):
                with threads_for(runner):
                    for _ in range(block):
                        t0 = time.perf_counter()
                        runner(x)
                        spent.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def int8_goal(our_drop: float, their_drop: float, our_ms: float, their_ms: float) -> str:
    """The INT8 goals of the side-by-side: met, or by how much they are missed."""
    allowed = min(max(their_drop / 2, their_drop - 0.01) + 0.002, 0.01)
    misses = []
    if our_drop > allowed:
        misses.append(f"drop {our_drop:.4f} > {allowed:.4f}")
    if our_ms > 1.05 * their_ms:
        misses.append(f"latency {our_ms / their_ms:.2f}x > 1.05x")
    return "goals met" if not misses else "MISSED: " + ", ".join(misses)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from models.families import family_of
    from utils.data.config import load_data_config
    from utils.errors import describe
    from utils.evaluation.gate import cpu_name, latency_ms, split_map
    from utils.formats import open_runner

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_data_config(args.data)
    formats = available(args.formats)
    calibration = calibration_yaml(args, cfg, out)
    reference = open_runner(args.weights, end2end=args.end2end)
    family = family_of(reference.meta.family)
    image = _one_val_image(cfg, args.imgsz, reference.meta.stride)
    base = split_map(reference, family, cfg, cfg["val"], args.imgsz, 0, batch_size=1)
    print(
        f"PyTorch: mAP50-95 {base:.4f}, {latency_ms(reference, image):.2f} ms/img ({cpu_name()}, "
        f"{torch.get_num_threads()} threads)"
    )
    rows = []
    for fmt in formats:
        for precision in args.precisions:
            if precision not in fmt.precisions:
                print(f"skipped {fmt.name} {precision}: not a precision this version writes")
                continue
            pair, runners = [], []
            for name, make in (
                ("ours", lambda f: ours(args, fmt, precision, f)),
                ("ultralytics", lambda f: theirs(args, fmt, precision, f, calibration)),
            ):
                side = Side()
                try:
                    side.path = make(out / name / f"{fmt.name}_{precision}")
                    runners.append(measure(side, family, cfg, args.imgsz))
                except Exception as e:  # one side failing is a row to print, not the end of the bench  # noqa: BLE001
                    side.error = describe(e)
                pair.append(side)
            if len(runners) == 2:
                pair[0].ms, pair[1].ms = paired_latency(runners, image)
            rows.append((fmt.name, precision, *pair))
            print(_row(fmt.name, precision, base, *pair), flush=True)
    print(f"\nSide by side on {cpu_name()}, {args.imgsz} px, batch 1; mAP50-95 change against PyTorch {base:.4f}")
    print(
        f"{'format':<12}{'precision':<10}{'ours dmAP':>10}{'theirs':>9}{'ours ms':>9}{'theirs':>8}"
        f"{'ratio':>7}{'ours MB':>9}{'theirs':>8}  INT8 goals"
    )
    for row in rows:
        print(_row(*row[:2], base, *row[2:]))
    return 0


def _one_val_image(cfg: dict, imgsz: int, stride: int):  # noqa: ANN202 (a tensor)
    from utils.data.loader import create_dataloader, load_labels
    from utils.evaluation.gate import first_image

    labels = load_labels(cfg["val"], nc=int(cfg["nc"]), workers=0, verbose=False)
    loader, _ = create_dataloader(
        None, imgsz, 1, stride, augment=False, rect=False, workers=0, nc=int(cfg["nc"]), label_set=labels
    )
    return first_image(loader)


def _row(fmt: str, precision: str, base: float, ours_side: Side, theirs_side: Side) -> str:
    cells = [f"{fmt:<12}{precision:<10}"]
    for side in (ours_side, theirs_side):
        cells.append(f"{side.map - base:>+10.4f}" if not side.error else f"{'failed':>10}")
    cells.append(
        f"{ours_side.ms:>9.2f}{theirs_side.ms:>8.2f}{ours_side.ms / theirs_side.ms:>7.2f}"
        f"{ours_side.mb:>9.2f}{theirs_side.mb:>8.2f}"
    )
    if precision == "int8" and not (ours_side.error or theirs_side.error):
        cells.append("  " + int8_goal(base - ours_side.map, base - theirs_side.map, ours_side.ms, theirs_side.ms))
    for name, side in (("ours", ours_side), ("ultralytics", theirs_side)):
        if side.error:
            cells.append(f"\n    {name}: {side.error}")
    return "".join(cells)


if __name__ == "__main__":
    sys.exit(main())
