"""Whether two checkouts train identically: the same --deterministic CPU run with each, compared value by value.

    python bench/compare_runs.py --other /path/to/other/checkout                  # yolov5n and yolo11n, 3 epochs
    python bench/compare_runs.py --other ../baseline --cfg yolo11n.yaml --epochs 2 -- --save-period 1

Each model trains once with this checkout's train.py and once with the other's, in processes of their own, on
the same generated rectangles set (tests/conftest.py), one thread each. Every results.csv column the other
checkout writes must be in this one's with the same values (columns only this one writes, such as the time
split, are listed, not compared: they are measurements), and every tensor in the other's last.pt (model, EMA,
optimizer state, RNG state) must equal this one's bit for bit. Arguments after ``--`` go to both train.py runs.
Exit status 0 when everything agrees; each difference is printed.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def train(checkout: Path, data: Path, project: Path, cfg: str, epochs: int, extra: list[str]) -> Path:
    cmd = [
        sys.executable,
        str(checkout / "train.py"),
        "--data",
        str(data),
        "--cfg",
        cfg,
        "--epochs",
        str(epochs),
        "--imgsz",
        "64",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--deterministic",
        "--noplots",
        "--project",
        str(project),
        "--name",
        "exp",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(checkout), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{checkout}: train.py failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return project / "exp"


def results(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "results.csv") as f:
        return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]


def tensor_differences(reference: Any, other: Any, where: str = "last.pt") -> list[str]:
    """Every place where ``reference`` holds a tensor that ``other`` does not hold identically."""
    if isinstance(reference, torch.Tensor):
        same = isinstance(other, torch.Tensor) and reference.dtype == other.dtype and torch.equal(reference, other)
        return [] if same else [where]
    if isinstance(reference, dict):
        if not isinstance(other, dict):
            return [where] if any(tensor_differences(v, None) for v in reference.values()) else []
        return [d for k, v in reference.items() for d in tensor_differences(v, other.get(k), f"{where}[{k!r}]")]
    if isinstance(reference, (list, tuple)):
        others = list(other) if isinstance(other, (list, tuple)) else []
        return [
            d
            for i, v in enumerate(reference)
            for d in tensor_differences(v, others[i] if i < len(others) else None, f"{where}[{i}]")
        ]
    return []


def count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(count_tensors(v) for v in values)


def compare(cfg: str, other: Path, data: Path, work: Path, epochs: int, extra: list[str]) -> list[str]:
    theirs = train(other, data, work / "other" / cfg, cfg, epochs, extra)
    ours = train(ROOT, data, work / "this" / cfg, cfg, epochs, extra)
    problems = []
    reference_rows, rows = results(theirs), results(ours)
    if len(reference_rows) != len(rows):
        problems.append(f"results.csv: {len(reference_rows)} rows against {len(rows)}")
    theirs_columns, our_columns = list(reference_rows[0]) if reference_rows else [], list(rows[0]) if rows else []
    problems += [f"results.csv: column {c} missing" for c in theirs_columns if c not in our_columns]
    new = [c for c in our_columns if c not in theirs_columns]
    for i, (a, b) in enumerate(zip(reference_rows, rows)):
        problems += [f"results.csv row {i} {k}: {v} against {b[k]}" for k, v in a.items() if k in b and b[k] != v]
    load = lambda run: torch.load(run / "weights/last.pt", map_location="cpu", weights_only=True)  # noqa: E731
    reference, ckpt = load(theirs), load(ours)
    problems += [f"{where} differs" for where in tensor_differences(reference, ckpt)]
    n_tensors = count_tensors(reference)
    print(
        f"{cfg}: {len(rows)} results rows x {len(reference_rows[0])} columns, {n_tensors} tensors compared: "
        f"{'identical' if not problems else f'{len(problems)} differences'}"
    )
    if new:
        print(f"{cfg}: columns only this checkout writes (not compared): {', '.join(new)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, type=Path, help="the other checkout (e.g. a clone at another commit)")
    parser.add_argument("--cfg", nargs="+", default=["yolov5n.yaml", "yolo11n.yaml"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="after --: more train.py arguments, for both runs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_rectangles_dataset

    with tempfile.TemporaryDirectory() as tmp:
        data = write_rectangles_dataset(Path(tmp) / "data")
        problems = [
            p for cfg in args.cfg for p in compare(cfg, args.other.resolve(), data, Path(tmp), args.epochs, args.extra)
        ]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
