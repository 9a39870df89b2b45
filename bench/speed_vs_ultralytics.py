"""Whole-process training speed and peak memory against Ultralytics' trainer, side by side on this CPU.

    python bench/speed_vs_ultralytics.py --ultralytics-python /path/to/venv-with-ultralytics/bin/python

Both train ``--cfg`` (yolo11n) from scratch on coco128 at 320 px, batch 16, 3 epochs, 2 dataloader workers, on the
CPU, without per-epoch validation (ours --noval, Ultralytics val=False: each still validates the last epoch) and
without plots. Both close mosaic for the last 10 epochs by default (Ultralytics 8.4 from epoch epochs - 10 on), so
a 3-epoch run trains without mosaic in either. Ours runs twice: as it is (mixed precision where the CPU has native
bf16) and with --no-amp (fp32, as Ultralytics trains on a CPU). Each whole process is timed by GNU time, which also
gives its peak resident set size (see bench/ultralytics_side_by_side.py). Printed: each run's wall time and peak
RSS, then the ratios (Ultralytics' time / ours: above 1 means ours is faster; our peak RSS / Ultralytics'); with
``--pairs N``, N such pairs, alternating which trainer goes first, then the median and range of each ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ultralytics_side_by_side import (
    ROOT,
    absolute_data_yaml,
    final_map,
    run_timed,  # noqa: E402
    ultralytics_env,
    ultralytics_train_cmd,
)

# ../shared/datasets beside the checkout (or beside the folder of worktrees that holds it)
_COCO128 = "shared/datasets/coco128.yaml"
COCO128 = next((p / _COCO128 for p in ROOT.parents if (p / _COCO128).exists()), ROOT.parent / _COCO128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", required=True, help="a Python with ultralytics installed")
    p.add_argument("--data", default=str(COCO128))
    p.add_argument("--cfg", default="yolo11n.yaml")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or a CUDA device such as 0 (both trainers)")
    p.add_argument("--out", default=str(ROOT / "runs/bench_speed"))
    p.add_argument("--pairs", type=int, default=1, help="pairs of runs, alternating which trainer goes first")
    p.add_argument("--skip-fp32", action="store_true", help="do not also run ours with --no-amp")
    args = p.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_yaml = absolute_data_yaml(Path(args.data), out)
    common = [
        "--data",
        str(data_yaml),
        "--cfg",
        args.cfg,
        "--epochs",
        str(args.epochs),
        "--imgsz",
        str(args.imgsz),
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--device",
        args.device,
        "--noval",
        "--noplots",
        "--project",
        str(out / "ours"),
        "--exist-ok",
    ]
    variants = {"ours": []} if args.skip_fp32 else {"ours": [], "ours --no-amp": ["--no-amp"]}
    ultralytics_cmd = ultralytics_train_cmd(
        args.ultralytics_python,
        model=args.cfg,
        data=str(data_yaml),
        epochs=args.epochs,
        imgsz=args.imgsz,
        batch=args.batch_size,
        workers=args.workers,
        device=args.device,
        val=False,
        plots=False,
        project=str(out / "ultralytics"),
        name="speed",
        exist_ok=True,
    )
    print(
        f"{args.cfg} on {Path(args.data).name}: {args.epochs} epochs at {args.imgsz}, batch {args.batch_size}, "
        f"{args.workers} workers, device {args.device}, last epoch validated",
        flush=True,
    )

    def ours() -> dict:
        runs = {}
        for label, extra in variants.items():
            name = label.replace(" --", "_").replace("-", "_")
            runs[label] = run_timed(
                [sys.executable, "train.py", *common, "--name", name, *extra], ROOT, out / f"{name}.log"
            )
        return runs

    def theirs() -> dict:
        env = ultralytics_env(out, args.ultralytics_python)
        return {"Ultralytics": run_timed(ultralytics_cmd, out, out / "ultralytics.log", env=env)}

    ratios: dict[str, list[tuple[float, float]]] = {label: [] for label in variants}
    for pair in range(args.pairs):
        # Alternate which trainer goes first: the machine's speed drifts, and a fixed order would bias the pairs.
        measured = {**ours(), **theirs()} if pair % 2 == 0 else {**theirs(), **ours()}
        first = "ours" if pair % 2 == 0 else "Ultralytics"
        print(f"pair {pair + 1} ({first} first):", flush=True)
        for label, m in measured.items():
            score = final_map(m.log)
            print(
                f"{label:>14}: {m.wall_s:8.1f} s, peak RSS {m.peak_rss_mib:8.0f} MiB, final mAP50-95 {score:.3f}, "
                f"exit {m.exit_code} (log {m.log})",
                flush=True,
            )
        reference = measured["Ultralytics"]
        for label in variants:
            m = measured[label]
            ratios[label].append((reference.wall_s / m.wall_s, m.peak_rss_mib / reference.peak_rss_mib))
            print(
                f"{label}: speed-up (Ultralytics time / ours) {ratios[label][-1][0]:.2f}x; "
                f"peak RSS ours / Ultralytics {ratios[label][-1][1]:.2f}",
                flush=True,
            )
    if args.pairs > 1:
        for label, pairs in ratios.items():
            speed, rss = [sorted(x) for x in zip(*pairs)]
            print(
                f"{label} over {args.pairs} pairs: speed-up median {statistics.median(speed):.2f}x "
                f"(range {speed[0]:.2f}x-{speed[-1]:.2f}x); peak RSS ratio median {statistics.median(rss):.2f} "
                f"(range {rss[0]:.2f}-{rss[-1]:.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
