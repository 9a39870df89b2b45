"""Host memory of the data pipeline at scale: a data-loader worker's private memory growth during training, and
the label cache's build and reload time, on generated datasets of many tiny images.

Run by hand from the repo root:

    python bench/data_memory.py memory [--sizes 20000 200000] [--seconds 120] [--repo /path/to/checkout]
    python bench/data_memory.py cache [--n 1000000] [--yolov5 /path/to/yolov5 checkout]

``memory`` generates each dataset once (under --root), starts ``train.py`` of --repo (default: this checkout) with
2 workers, --cache off, 64 px, batch 32 on it, and reads each worker's USS (Private_Clean + Private_Dirty) and PSS
from ``/proc/<pid>/smaps_rollup`` when training has run --warmup seconds and again --seconds later, then prints
the growth per worker for each size side by side (goal: the largest set's growth within 8 MiB of the smallest's).
Give ``--repo`` another checkout (e.g. the main branch before the flat label table) to measure it the same way.
``--loader-only`` runs the same training loader without the model, as fast as its workers go: on a slow or shared
machine train.py reads few samples in two minutes, and the loader alone shows what many more reads do.

``cache`` generates --n images and times building the label cache from scratch and reloading it, in a fresh
process each; with ``--yolov5`` it times YOLOv5's own ``LoadImagesAndLabels`` cache on the same files the same
way (YOLOv5's code is run from that checkout, never imported here).

Images are hard links to a few distinct 32x32 PNG files, so generating hundreds of thousands is quick, while
every read opens, reads and decodes a real file; label files (1-3 random rows) are hard links too.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N_DISTINCT = 16
N_DISTINCT_LABELS = 61  # prime: image and label files pair up differently across the set
PER_FOLDER = 10000


def generate(root: Path, n: int, n_val: int = 64, seed: int = 0) -> Path:
    """A dataset of ``n`` train and ``n_val`` val images with labels under ``root``; kept and reused if complete."""
    import cv2

    yaml_file = root / "data.yaml"
    if yaml_file.is_file():
        return yaml_file
    rng = np.random.default_rng(seed)
    distinct = root / "distinct"
    distinct.mkdir(parents=True, exist_ok=True)
    for k in range(N_DISTINCT):
        img = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
        cv2.imwrite(str(distinct / f"{k}.png"), img)
    for k in range(N_DISTINCT_LABELS):
        rows = rng.uniform(0.2, 0.4, (int(rng.integers(1, 4)), 4))
        rows[:, :2] += 0.2
        (distinct / f"{k}.txt").write_text("".join(f"{k % 3} {x:.5f} {y:.5f} {w:.5f} {h:.5f}\n" for x, y, w, h in rows))
    t0 = time.time()
    for split, count in (("train", n), ("val", n_val)):
        for i in range(count):
            folder = f"{i // PER_FOLDER:03d}"
            image = root / "images" / split / folder / f"{i:07d}.png"
            label = root / "labels" / split / folder / f"{i:07d}.txt"
            if i % PER_FOLDER == 0:
                image.parent.mkdir(parents=True, exist_ok=True)
                label.parent.mkdir(parents=True, exist_ok=True)
            os.link(distinct / f"{i % N_DISTINCT}.png", image)
            os.link(distinct / f"{(i * 7919) % N_DISTINCT_LABELS}.txt", label)
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: [a, b, c]\n")
    print(f"generated {n} + {n_val} images in {root} ({time.time() - t0:.0f} s)", flush=True)
    return yaml_file


def smaps(pid: int) -> dict[str, int]:
    """Pss and USS (Private_Clean + Private_Dirty) of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Private_Clean", "Private_Dirty"):
                out[key] = int(rest.split()[0]) * 1024
    return {"pss": out["Pss"], "uss": out["Private_Clean"] + out["Private_Dirty"]}


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


# The training loader alone, as fast as its workers go (no model): what train.py's workers do, without waiting on
# the model's steps, so the workers read many more samples in the same time on a slow or shared machine.
_LOADER_ONLY = """
import sys, time
sys.path.insert(0, {repo!r})
from utils.data.config import load_data_config
from utils.data.loader import create_dataloader, load_labels
labels = load_labels(load_data_config({data!r})["train"], nc=3, workers=2)
loader, _ = create_dataloader(None, 64, 32, 32, augment=True, cache=None, workers=2, shuffle=True, label_set=labels)
print("Starting training", flush=True)
batches = 0
for epoch in range(1000):
    loader.set_epoch(epoch)
    for _ in loader:
        batches += 1
        if batches % 10 == 0:
            print(f"batches {{batches}}", flush=True)
"""


def _batches(text: str) -> int:
    counts = [int(line.split()[1]) for line in text.splitlines() if line.startswith("batches ")]
    return counts[-1] if counts else -1


def measure_training(
    repo: Path, yaml_file: Path, warmup: float, seconds: float, workdir: Path, loader_only: bool = False
) -> dict:
    """Worker memory at ``warmup`` s of training and ``seconds`` later (train.py of ``repo`` in a subprocess)."""
    cmd = [
        sys.executable,
        "train.py",
        "--data",
        str(yaml_file),
        "--imgsz",
        "64",
        "--batch-size",
        "32",
        "--workers",
        "2",
        "--cache",
        "off",
        "--epochs",
        "1",
        "--noautoanchor",
        "--noplots",
        "--device",
        "cpu",
        "--project",
        str(workdir),
        "--name",
        "run",
    ]
    if loader_only:
        cmd = [sys.executable, "-c", _LOADER_ONLY.format(repo=str(repo), data=str(yaml_file))]
    log = open(workdir / f"train-{yaml_file.parent.name}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_start = None
        while t_start is None:
            time.sleep(1)
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"train.py ended early:\n{log.read()[-3000:]}")
            log.seek(0)
            if "Starting training" in log.read():
                t_start = time.time()
        workers: list[int] = []
        while len(workers) < 2 and time.time() - t_start < 60:
            time.sleep(1)
            workers = children(proc.pid)
        time.sleep(max(0.0, t_start + warmup - time.time()))
        workers = children(proc.pid)
        before = {w: smaps(w) for w in workers}
        log.seek(0)
        batches_before = _batches(log.read())
        time.sleep(seconds)
        after = {w: smaps(w) for w in workers if Path(f"/proc/{w}").exists()}
        log.seek(0)
        batches = _batches(log.read()) - batches_before if batches_before >= 0 else -1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    mib = 1 << 20
    return {
        w: {
            "uss_before_mib": before[w]["uss"] / mib,
            "uss_growth_mib": (after[w]["uss"] - before[w]["uss"]) / mib,
            "pss_growth_mib": (after[w]["pss"] - before[w]["pss"]) / mib,
            "batches": batches,
        }
        for w in after
    }


def memory(opt: argparse.Namespace) -> None:
    repo = Path(opt.repo).resolve()
    results = {}
    for n in opt.sizes:
        yaml_file = generate(Path(opt.root) / f"images{n}", n)
        with tempfile.TemporaryDirectory() as tmp:
            per_worker = measure_training(repo, yaml_file, opt.warmup, opt.seconds, Path(tmp), opt.loader_only)
        results[n] = per_worker
        for w, r in per_worker.items():
            print(
                f"{n:>8} images, worker {w}: USS {r['uss_before_mib']:.1f} MiB at {opt.warmup:g} s, "
                f"{r['uss_growth_mib']:+.1f} MiB USS, {r['pss_growth_mib']:+.1f} MiB PSS over {opt.seconds:g} s"
                + (f" ({r['batches']} batches of 32)" if r["batches"] >= 0 else ""),
                flush=True,
            )
    growth = {n: max(r["uss_growth_mib"] for r in per.values()) for n, per in results.items()}
    small, large = min(growth), max(growth)
    print(
        f"repo {repo}: largest worker USS growth over {opt.seconds:g} s of training: "
        + ", ".join(f"{growth[n]:.1f} MiB on {n} images" for n in sorted(growth))
        + f"; difference {growth[large] - growth[small]:.1f} MiB (goal: within 8 MiB)"
    )


_OURS = """
import sys, time
sys.path.insert(0, {repo!r})
from utils.data.labels import read_table
t = time.perf_counter()
table, reused = read_table({images!r}, nc=3, workers={workers}, verbose=False)
print(time.perf_counter() - t, reused, len(table))
"""

_YOLOV5 = """
import sys, time
sys.path.insert(0, {repo!r})
from utils.dataloaders import LoadImagesAndLabels
t = time.perf_counter()
d = LoadImagesAndLabels({images!r}, img_size=64, batch_size=32, augment=False, cache_images=False, prefix="")
print(time.perf_counter() - t, None, len(d.labels))
"""


def _timed(code: str, python: str = sys.executable, env: dict | None = None) -> tuple[float, str, int]:
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    seconds, reused, n = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), reused, int(n)


def cache(opt: argparse.Namespace) -> None:
    yaml_file = generate(Path(opt.root) / f"images{opt.n}", opt.n)
    images = str(yaml_file.parent / "images" / "train")
    labels = yaml_file.parent / "labels"
    sides = [
        (
            "this project",
            _OURS.format(repo=str(ROOT), images=images, workers=opt.workers),
            sys.executable,
            None,
            lambda p: p.name.endswith(".yolo-train.cache"),
        )
    ]
    if opt.yolov5:
        env = {**os.environ, "YOLO_OFFLINE": "1"}
        if opt.yolov5_pythonpath:
            env["PYTHONPATH"] = opt.yolov5_pythonpath
        sides.append(
            (
                "YOLOv5",
                _YOLOV5.format(repo=str(Path(opt.yolov5).resolve()), images=images),
                opt.yolov5_python,
                env,
                lambda p: not p.name.endswith(".yolo-train.cache"),
            )
        )
    for name, code, python, env, is_its_cache in sides:
        for stale in labels.rglob("*.cache"):
            if is_its_cache(stale):
                stale.unlink()
        built, _, n = _timed(code, python, env)
        reloaded, _, _ = _timed(code, python, env)
        print(f"{name}: label cache of {n} images built in {built:.1f} s, reloaded in {reloaded:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--sizes", type=int, nargs="+", default=[20000, 200000])
    m.add_argument("--seconds", type=float, default=120.0)
    m.add_argument("--warmup", type=float, default=20.0, help="seconds of training before the first reading")
    m.add_argument("--repo", default=str(ROOT), help="checkout whose train.py runs")
    m.add_argument(
        "--loader-only",
        action="store_true",
        help="run the training loader as fast as it goes instead of train.py (no model steps)",
    )
    c = sub.add_parser("cache")
    c.add_argument("--n", type=int, default=1_000_000)
    c.add_argument("--workers", type=int, default=8)
    c.add_argument("--yolov5", default="", help="a YOLOv5 checkout to time the same way")
    c.add_argument("--yolov5-python", default=sys.executable, help="the Python that runs YOLOv5 (its requirements)")
    c.add_argument("--yolov5-pythonpath", default="", help="PYTHONPATH for that Python (e.g. where ultralytics is)")
    for s in (m, c):
        s.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "yolo-train-bench-data"))
    opt = p.parse_args()
    memory(opt) if opt.what == "memory" else cache(opt)


if __name__ == "__main__":
    main()
