"""Training throughput on a GPU, ours against Ultralytics' trainer, measured the same way for both.

    python bench/gpu_throughput.py --ultralytics-python /path/to/python-with-ultralytics --cfg yolo11n.yaml yolo11s.yaml

Each trainer trains each ``--cfg`` from scratch on the same generated shapes set (``--images`` train images at
``--imgsz``, made once in parallel by ``utils/data/shapes.py``), batch ``--batch-size``, ``--workers`` loader
workers, mixed precision (each trainer's default on CUDA), mosaic on in every epoch (close-mosaic 0 for both), no
validation before the last epoch, no experiment trackers (ours: --loggers alone; Ultralytics: its integrations
switched off), each trainer's other defaults. Both save ``weights/last.pt`` at the end of every
epoch; a watcher here notes the moment each save lands, so an epoch's time is the interval between two saves,
observed from outside, the same for both trainers. The first epoch (start-up, cuDNN's autotuning) and the
interval that holds the final validation are left out: printed is the median of the remaining intervals as
images/s, and ours' own per-epoch share of the step spent waiting for data (results.csv ``time/data``). Each
trainer's output is kept in ``--out``, every line stamped with the seconds since its start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.forked_scripts import Launcher, start_subprocess  # noqa: E402
from bench.ultralytics_side_by_side import ROOT, ultralytics_env, ultralytics_train_cmd  # noqa: E402
from utils.data.shapes import SHAPE_NAMES, generate_shapes  # noqa: E402
from utils.plots import read_results_csv  # noqa: E402

SAVE_BURST_S = 0.5  # changes to the checkpoint closer together than this are one save


def make_dataset(out: Path, images: int, imgsz: int, parts: int, val: int = 64) -> tuple[Path, int]:
    """``images`` distinct train images (and ``val`` to validate), made by ``parts`` processes, each with its own
    seed."""
    root = out / (f"shapes_{images}_{imgsz}" + ("" if val == 64 else f"_val{val}"))
    yaml_file = root / "data.yaml"
    if yaml_file.exists():
        return yaml_file, images
    per = -(-images // parts)
    with ProcessPoolExecutor(parts) as pool:
        list(
            pool.map(
                generate_shapes,
                [root / f"part{k}" for k in range(parts)],
                [per] * parts,
                [val if k == 0 else 0 for k in range(parts)],
                [imgsz] * parts,
                range(parts),
            )
        )
    for split in ("train", "val"):
        for kind in ("images", "labels"):
            (root / kind / split).mkdir(parents=True, exist_ok=True)
        files = sorted(p for k in range(parts) for p in (root / f"part{k}/images/{split}").glob("*.jpg"))
        if split == "train":
            files = files[:images]
        for image in files:
            part = image.parts[-4]
            os.link(image, root / "images" / split / f"{part}_{image.name}")
            label = image.parents[2] / "labels" / split / f"{image.stem}.txt"
            os.link(label, root / "labels" / split / f"{part}_{label.name}")
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: {list(SHAPE_NAMES)}\n")
    return yaml_file, images


def watch_saves(
    cmd: list[str],
    cwd: Path,
    checkpoint: Path,
    log: Path,
    env: dict[str, str],
    timeout: float | None = None,
    burst_s: float = SAVE_BURST_S,
    start: Launcher = start_subprocess,
) -> tuple[int, list[float]]:
    """Run ``cmd`` (started by ``start``); return its exit code (-9 when killed after ``timeout`` s) and the times
    (s since start) at which ``checkpoint`` was written anew."""
    seen: list[float] = []
    done = threading.Event()
    t0 = time.perf_counter()

    def poll() -> None:
        last = None
        while not done.is_set():
            try:
                st = checkpoint.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp is not None and stamp != last:
                now = time.perf_counter() - t0
                # A save written in place changes the file several times within a moment: one save, timed at its end.
                if seen and now - seen[-1] < burst_s:
                    seen[-1] = now
                else:
                    seen.append(now)
                last = stamp
            time.sleep(0.01)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    proc = start(cmd, cwd, {**os.environ, "PYTHONUNBUFFERED": "1", **env}, subprocess.PIPE)
    assert proc.stdout is not None  # a pipe was asked for
    killer = threading.Timer(timeout, proc.kill) if timeout is not None else None
    if killer is not None:
        killer.start()
    with open(log, "w") as out:
        # Each line (progress bars' carriage returns too) stamped with the seconds since start: where time goes.
        for line in iter(proc.stdout.readline, b""):
            for part in line.decode(errors="replace").replace("\r", "\n").splitlines():
                if part.strip():
                    out.write(f"{time.perf_counter() - t0:8.2f} {part}\n")
        code = proc.wait()
        out.write(f"{time.perf_counter() - t0:8.2f} [process ended, exit {code}]\n")
    if killer is not None:
        killer.cancel()
    done.set()
    watcher.join()
    return code, seen


def images_per_s(saves: list[float], n_images: int, epochs: int) -> tuple[float, list[float]]:
    """Median images/s over the epochs after the first and before the last (which holds the final validation); a
    save after the last epoch's (Ultralytics strips the optimizer from last.pt at the end) is not an epoch."""
    saves = saves[:epochs]
    intervals = [b - a for a, b in zip(saves[:-2], saves[1:-1])]
    return (n_images / statistics.median(intervals) if intervals else float("nan")), intervals


def our_data_share(results_csv: Path) -> list[float]:
    header, values = read_results_csv(results_csv)
    return values[:, header.index("time/data")].tolist()


@dataclass(frozen=True)
class Settings:
    """How both trainers train (the command line's settings)."""

    imgsz: int
    batch_size: int
    workers: int
    epochs: int
    device: str
    ultralytics_python: str = ""  # '' : ours only
    # Changes to the checkpoint closer together than this are one save (a file written in place changes several
    # times); a toy run's tiny checkpoints and sub-second epochs need a shorter window.
    save_burst_s: float = SAVE_BURST_S
    our_extra: tuple[str, ...] = ()  # more train.py options for ours alone (the GPU report's --compile part)


@dataclass
class Trained:
    """One trainer's run of one model."""

    images_per_s: float
    intervals: list[float]  # seconds between saves, the timed epochs
    saves: int
    whole_s: float  # the whole process
    exit_code: int
    log: Path  # its output, every line stamped with the seconds since its start
    folder: Path  # its run folder (weights/last.pt, results.csv)
    data_share: list[float] = field(default_factory=list)  # ours: time/data per epoch


def our_cmd(cfg: str, settings: Settings, data_yaml: Path, project: Path) -> list[str]:
    """train.py as the bench runs it: no validation before the last epoch, no plots, no trackers (--loggers alone)."""
    return [
        sys.executable,
        "train.py",
        "--data",
        str(data_yaml),
        "--cfg",
        cfg,
        "--epochs",
        str(settings.epochs),
        "--imgsz",
        str(settings.imgsz),
        "--batch-size",
        str(settings.batch_size),
        "--workers",
        str(settings.workers),
        "--device",
        settings.device,
        "--close-mosaic",
        "0",
        "--noval",
        "--noplots",
        "--loggers",
        "--project",
        str(project),
        "--name",
        Path(cfg).stem,
        "--exist-ok",
        *settings.our_extra,
    ]


def their_cmd(cfg: str, settings: Settings, data_yaml: Path, project: Path) -> list[str]:
    """Ultralytics' trainer with the same settings (its tracker integrations are off in ``ultralytics_env``)."""
    return ultralytics_train_cmd(
        settings.ultralytics_python,
        model=cfg,
        data=str(data_yaml),
        epochs=settings.epochs,
        imgsz=settings.imgsz,
        batch=settings.batch_size,
        workers=settings.workers,
        device=settings.device,
        close_mosaic=0,
        val=False,
        plots=False,
        project=str(project),
        name=Path(cfg).stem,
        exist_ok=True,
    )


def train_both(
    cfg: str,
    settings: Settings,
    data: tuple[Path, int],
    out: Path,
    env_ul: dict[str, str],
    timeout: float | None = None,
    start: Launcher = start_subprocess,
) -> dict[str, Trained]:
    """Ours, then Ultralytics' (when ``settings`` names its Python), on ``cfg``; each killed after ``timeout`` s,
    each started by ``start``."""
    (data_yaml, n_images), name = data, Path(cfg).stem
    runs = [("ours", our_cmd(cfg, settings, data_yaml, out / "ours"), out / "ours" / name, ROOT, {})]
    if settings.ultralytics_python:
        theirs = their_cmd(cfg, settings, data_yaml, out / "ultralytics")
        runs.append(("Ultralytics", theirs, out / "ultralytics" / name, out, env_ul))
    measured = {}
    out.mkdir(parents=True, exist_ok=True)
    for label, cmd, folder, cwd, env in runs:
        (folder / "weights/last.pt").unlink(missing_ok=True)
        t = time.perf_counter()
        log = out / f"{label}_{name}.log"
        checkpoint = folder / "weights/last.pt"
        code, saves = watch_saves(cmd, cwd, checkpoint, log, env, timeout, settings.save_burst_s, start)
        rate, intervals = images_per_s(saves, n_images, settings.epochs)
        run = Trained(rate, intervals, len(saves), time.perf_counter() - t, code, log, folder)
        if label == "ours" and (folder / "results.csv").exists():
            run.data_share = our_data_share(folder / "results.csv")
        measured[label] = run
    return measured


def describe(name: str, label: str, run: Trained) -> str:
    extra = f", data share per epoch {' '.join(f'{s:.0%}' for s in run.data_share)}" if run.data_share else ""
    return (
        f"{name} {label:>11}: {run.images_per_s:7.0f} images/s (epochs {' '.join(f'{i:.2f}' for i in run.intervals)} "
        f"s), {run.saves} saves, whole process {run.whole_s:.0f} s, exit {run.exit_code}{extra}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", default="", help="a Python with ultralytics installed ('' : ours only)")
    p.add_argument("--cfg", nargs="+", default=["yolo11n.yaml", "yolo11s.yaml"])
    p.add_argument("--images", type=int, default=4096, help="train images per epoch")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5, help="at least 4: epochs 1 .. epochs-2 are timed")
    p.add_argument("--device", default="0")
    p.add_argument("--out", default=str(ROOT / "runs/bench_gpu_throughput"))
    args = p.parse_args()
    if args.epochs < 4:
        p.error(f"--epochs {args.epochs}: at least 4 (epoch 0 and the last one are not timed)")
    if args.ultralytics_python and not Path(args.ultralytics_python).is_file():
        p.error(f"--ultralytics-python {args.ultralytics_python}: no such file")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    data = make_dataset(out, args.images, args.imgsz, min(os.cpu_count() or 1, 16))
    print(f"data: {data[1]} train images at {args.imgsz} ({time.perf_counter() - t:.0f} s to make) in {data[0]}")
    settings = Settings(args.imgsz, args.batch_size, args.workers, args.epochs, args.device, args.ultralytics_python)
    env_ul = ultralytics_env(out, args.ultralytics_python) if args.ultralytics_python else {}
    for cfg in args.cfg:
        name = Path(cfg).stem
        measured = train_both(cfg, settings, data, out, env_ul)
        for label, run in measured.items():
            print(describe(name, label, run), flush=True)
        if len(measured) == 2:
            ratio = measured["ours"].images_per_s / measured["Ultralytics"].images_per_s
            print(f"{name}: ours / Ultralytics = {ratio:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
