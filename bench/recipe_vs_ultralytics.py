"""The training recipe against Ultralytics' own: yolo11n from scratch on a generated shapes set, both trainers with
their own defaults on the same data, epochs, image size and batch, each scored by its own validator.

    python bench/recipe_vs_ultralytics.py --ultralytics-python PY      # 800 shapes images, 20 epochs at 320
    python bench/recipe_vs_ultralytics.py --ultralytics-python PY --seeds 0 \\
        --n-train 80 --n-val 20 --epochs 2 --imgsz 160                 # a quick look

The set: the built-in shapes generator (utils/data/shapes.py) with ``--n-train`` / ``--n-val`` images at
``--data-imgsz`` px, generated once per ``--data-seed`` into ``--out``. Per training seed the two runs go one after
the other (never at once: they would share the cores); each is a whole process timed by GNU time. Ours trains with
``python train.py --cfg yolo11n.yaml`` and everything else default; Ultralytics with ``yolo detect train model=yolo11n.yaml``
and its defaults (run by the Python given with --ultralytics-python; see bench/ultralytics_side_by_side.py). Printed
per seed: both mAP50-95, their difference, both wall times and their ratio; then the means.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ultralytics_side_by_side import (
    ROOT,
    final_map,
    run_timed,
    ultralytics_env,  # noqa: E402
    ultralytics_train_cmd,
)
from utils.data.shapes import SHAPE_NAMES, ensure_shapes_dataset  # noqa: E402


def shapes_set(out: Path, n_train: int, n_val: int, imgsz: int, seed: int) -> Path:
    """The generated set and a data YAML for both trainers (absolute path)."""
    root = ensure_shapes_dataset(
        out / f"shapes_{n_train}_{n_val}_{imgsz}_s{seed}", n_train=n_train, n_val=n_val, imgsz=imgsz, seed=seed
    )
    data = {"path": str(root.resolve()), "train": "images/train", "val": "images/val", "names": list(SHAPE_NAMES)}
    data_yaml = root.parent / f"{root.name}.yaml"
    data_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
    return data_yaml


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ultralytics-python", required=True, help="a Python with ultralytics installed")
    p.add_argument("--cfg", default="yolo11n.yaml", help="the model both train")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (both trainers)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--n-train", type=int, default=800)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--data-imgsz", type=int, default=320, help="size of the generated images")
    p.add_argument("--data-seed", type=int, default=1, help="generator seed (the built-in demo set uses 0)")
    p.add_argument("--out", default=str(ROOT / "runs/bench_recipe"), help="data and runs go here")
    p.add_argument("--extra", default="", help="extra flags for our train.py")
    args = p.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_yaml = shapes_set(out, args.n_train, args.n_val, args.data_imgsz, args.data_seed)
    print(
        f"data: {data_yaml} ({args.n_train} train / {args.n_val} val images at {args.data_imgsz} px); "
        f"{args.cfg}, {args.epochs} epochs at {args.imgsz}, batch {args.batch_size}, {args.workers} workers, CPU"
    )
    rows = []
    for seed in args.seeds:
        name = f"seed{seed}"
        ours_cmd = [
            sys.executable,
            "train.py",
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
            "cpu",
            "--seed",
            str(seed),
            "--project",
            str(out / "ours"),
            "--name",
            name,
            "--exist-ok",
            "--noplots",
            *args.extra.split(),
        ]
        ours = run_timed(ours_cmd, ROOT, out / f"ours_{name}.log")
        theirs_cmd = ultralytics_train_cmd(
            args.ultralytics_python,
            model=args.cfg,
            data=str(data_yaml),
            epochs=args.epochs,
            imgsz=args.imgsz,
            batch=args.batch_size,
            workers=args.workers,
            device="cpu",
            seed=seed,
            project=str(out / "ultralytics"),
            name=name,
            exist_ok=True,
            plots=False,
        )
        theirs = run_timed(
            theirs_cmd, out, out / f"ultralytics_{name}.log", env=ultralytics_env(out, args.ultralytics_python)
        )
        ours_map, theirs_map = final_map(ours.log), final_map(theirs.log)
        rows.append((ours_map, theirs_map, ours.wall_s, theirs.wall_s))
        print(
            f"seed {seed}: mAP50-95 ours {ours_map:.3f} | Ultralytics {theirs_map:.3f} | difference "
            f"{ours_map - theirs_map:+.3f};  wall ours {ours.wall_s:.0f} s | Ultralytics {theirs.wall_s:.0f} s | "
            f"ours / Ultralytics {ours.wall_s / theirs.wall_s:.2f}  (exit {ours.exit_code}/{theirs.exit_code}; "
            f"logs {ours.log}, {theirs.log})",
            flush=True,
        )
    if len(rows) > 1:
        means = [statistics.fmean(r[k] for r in rows) for k in range(4)]
        print(
            f"mean of {len(rows)} seeds: mAP50-95 ours {means[0]:.3f} | Ultralytics {means[1]:.3f} | difference "
            f"{means[0] - means[1]:+.3f};  wall ours {means[2]:.0f} s | Ultralytics {means[3]:.0f} s | "
            f"ours / Ultralytics {means[2] / means[3]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
