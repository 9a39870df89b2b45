"""Whole-process training speed and peak memory, optionally side by side with another trainer.

    python bench/train_speed.py                                # ours: yolov5n, coco128, 320, batch 16, 3 epochs
    python bench/train_speed.py --yolov5 /path/to/yolov5 --yolov5-python /path/to/venv/bin/python

Both trainers run the same settings: yolov5n from scratch, ../shared/datasets/coco128.yaml, imgsz 320,
batch 16, 2 workers, 3 epochs, --noval (each still validates the final epoch), --noplots, CPU. Ours also
gets --close-mosaic 0 so that both do the same augmentation work in every epoch. Peak memory is the
largest sum of proportional set size (PSS) over the trainer's whole process tree (main process plus
workers), sampled every 0.25 s. YOLOv5 resolves a relative `path:` against its working directory, so it
gets a copy of the data YAML with `path:` made absolute.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COCO128 = ROOT.parent / "shared/datasets/coco128.yaml"


def _pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (e.g. copy-on-write after fork) split between their users."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_memory_bytes(pid: int) -> int:
    """Memory of a process and all its descendants (sum of PSS), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        with contextlib.suppress(OSError):  # the process ended meanwhile
            total += _pss_bytes(p)
        stack.extend(children.get(p, []))
    return total


def run_measured(cmd: list[str], cwd: Path, log_file: Path) -> tuple[float, int, int]:
    """Wall seconds, peak memory of the process tree and exit code of ``cmd``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_file, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, tree_memory_bytes(proc.pid))
                time.sleep(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        elapsed = time.perf_counter() - t0
        stop.set()
        sampler.join()
    return elapsed, peak, code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(COCO128))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--extra", default="", help="extra flags for our train.py, e.g. '--no-amp'")
    p.add_argument("--yolov5", default="", help="a YOLOv5 checkout to run the same way, side by side")
    p.add_argument("--yolov5-python", default=sys.executable, help="the Python that runs the YOLOv5 checkout")
    args = p.parse_args()

    common = [
        "--data",
        args.data,
        "--imgsz",
        str(args.imgsz),
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--epochs",
        str(args.epochs),
        "--noval",
        "--noplots",
        "--device",
        "cpu",
        "--exist-ok",
    ]
    out = Path(tempfile.mkdtemp(prefix="train_speed_"))
    runs = {
        "ours": (
            [
                sys.executable,
                "train.py",
                *common,
                "--cfg",
                "models/yolov5n.yaml",
                "--close-mosaic",
                "0",
                "--project",
                str(out),
                "--name",
                "ours",
                *args.extra.split(),
            ],
            ROOT,
        )
    }
    if args.yolov5:
        data = yaml.safe_load(Path(args.data).read_text())
        data["path"] = str((Path(args.data).parent / data.get("path", "")).resolve())
        absolute_yaml = out / "data_absolute.yaml"
        absolute_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
        common[1] = str(absolute_yaml)
        runs["yolov5"] = (
            [
                args.yolov5_python,
                "train.py",
                *common,
                "--cfg",
                "models/yolov5n.yaml",
                "--weights",
                "",
                "--project",
                str(out),
                "--name",
                "yolov5",
            ],
            Path(args.yolov5),
        )
    results = {}
    for name, (cmd, cwd) in runs.items():
        elapsed, peak, code = run_measured(cmd, cwd, out / f"{name}.log")
        results[name] = (elapsed, peak)
        print(
            f"{name:>7}: {elapsed:7.1f} s whole process, peak memory {peak / 2**30:.2f} GiB, exit {code} "
            f"(log: {out / f'{name}.log'})"
        )
        if name == "ours":
            text = (out / "ours.log").read_text(errors="replace")
            for line in re.findall(r"epoch \d+: [\d.]+ images/s, \d+% of the time waiting for data[^\n\r]*", text):
                print(f"         {line}")
    if "yolov5" in results:
        ours, theirs = results["ours"], results["yolov5"]
        print(
            f"speed-up (YOLOv5 time / ours): {theirs[0] / ours[0]:.2f}x; "
            f"peak memory ours / YOLOv5: {ours[1] / theirs[1]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
