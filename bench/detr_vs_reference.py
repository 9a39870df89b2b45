"""D-FINE-N learning, our trainer against the official D-FINE trainer (issue 47, "Learning, side by side").

    python bench/detr_vs_reference.py --dfine-repo /path/to/D-FINE --dfine-python PY        # every part, full size
    python bench/detr_vs_reference.py --dfine-repo /path/to/D-FINE --dfine-python PY --part finetune
    python bench/detr_vs_reference.py --dfine-repo R --dfine-python PY --n-train 16 --n-val 8 --imgsz 64 \\
        --epochs 2 --batch-size 4 --workers 0 --cap-hours 0.1 --work /tmp/race                 # a smoke run

The set: the built-in shapes generator (utils/data/shapes.py) with ``--n-train`` / ``--n-val`` images at ``--imgsz``
px into ``--work``, a data YAML for our scripts and COCO JSON files of the same labels for the official trainer
(category ids 0..nc-1, read with ``remap_mscoco_category: False``).

The parts (``--part``, default all; each part's record goes into ``--out`` as soon as it ends, and the tables are
printed from that file, so parts run in separate calls add up):

- ``ours``: ``train.py --cfg dfine-n.yaml --weights ''`` from random weights for ``--epochs``, a whole process timed
  with ``time.monotonic`` and stopped at ``--cap-hours`` (SIGTERM to its process group, "capped" in the record);
  then our ``val.py`` on its best.pt (last.pt when there is none).
- ``theirs``: the official trainer (``train.py -c CONFIG`` of ``--dfine-repo``, run by ``--dfine-python`` in that
  folder; nothing of it enters this repository) on a config written into ``--work`` that includes
  ``configs/dfine/dfine_hgnetv2_n_coco.yml`` and overrides what the run needs (classes, folders, sizes, epochs,
  batch, the schedule below, the backbone's pretrained download off, the device); timed and capped as ours. Its
  final checkpoint (best_stg2.pth, else best_stg1.pth: the one its trainer keeps last, chosen on the same val
  split as our best.pt) is read by our ``val.py`` through the official-weights importer, so both mAPs come from
  one evaluator; its own log's last and best AP are recorded beside as a cross-check (its evaluator stretches
  every image to a square, ours letterboxes: the shapes set's images are 4:3 and 5:4 as well as square).
- ``yolo11n``: ``train.py --cfg yolo11n.yaml --time H`` with H our D-FINE run's measured wall time (from ``--out``).
- ``finetune``: pre-training and fine-tuning on class-disjoint splits (the shapes generator has five fixed
  classes, so the splits come from relabelling): our trainer trains dfine-n from random weights on the race's
  images labelled with circles, rectangles and triangles only (classes 0-2; the other shapes stay in the images,
  unlabelled); the fine-tuning set is a second generated set (``--data-seed`` + 1, ``--ft-train`` / ``--ft-val``
  images) labelled with crosses and stars only, as classes 0 and 1. Both trainers fine-tune that pre-trained
  checkpoint for ``--ft-epochs``: ours with ``--weights best.pt``, the official one with ``-t`` on the checkpoint
  converted to its key layout (the inverse of our importer's table, models/families/dfine.py: OFFICIAL_KEYS,
  checked by reading the converted file back through the importer: every tensor equal). Their class heads do not
  fit a model of another class count, and both trainers start them afresh.
- ``recipes``: our dfine-n from random weights with each of our two D-FINE recipes (``--recipes``: hyp.dfine.yaml,
  and hyp.deim-dfine.yaml with DEIM's MAL, quadratic warm-up, mosaic and mixup) for each ``--recipe-seeds`` seed, on
  the race's set and schedule (DEIM's own 2000 warm-up steps scaled by the same share). Its table gives each recipe's
  mean and issue 47's rule: DEIM's recipe becomes the ``dfine`` default if its mean mAP50-95 is at least 0.01
  higher. A (recipe, seed) already in ``--out`` is skipped, so calls pinned to different cores can share the seeds.

The same schedule for both trainers, each recipe's defaults scaled to this run:

- Batch ``--batch-size`` (16) on both sides. The official D-FINE-N recipe is batch 128 at lr 0.0008 (backbone
  0.0004); its README's rule for another batch is linear scaling of the learning rate (with the EMA decay and the
  warm-ups scaled by the same factor), so both trainers run at lr 0.0008 * 16 / 128 = 0.0001, the backbone at half
  of it (our hyp's ``backbone_lr: 0.5``). A batch of 128 on 800 images would be 6 steps an epoch.
- The recipe's step counts (500 warm-up steps, the EMA's 1000-update ramp, and its averaging window
  1 / (1 - 0.9999) = 10000 updates) are sized for 160 epochs of COCO at batch 128 (924 steps an epoch, 147840 in
  all); each is kept as the same share of this run's optimizer steps (epochs * floor(n_train / batch), as the
  official loader drops the last partial batch): warm-up and EMA ramp at least 1 step, the EMA decay
  1 - 1 / window (0 where the window is under one step). Unscaled, the 0.9999 EMA would average over 8 times the
  whole 1200-step run.
- The no-augmentation stage from the recipe's share of the run (148 of 160; the stage epoch our family computes
  from ``no_aug_share``, at least the last epoch of a run of 2 or more): the official transforms' policy epoch and
  collate ``stop_epoch`` are set to that epoch. Both reload their first stage's best checkpoint there; ours then
  starts its EMA again (``stage_ema_restart``, our default), theirs goes on with the reloaded one (its "Refresh
  EMA" sets a decay its ramp does not read).
- Precision: each trainer's default (ours: bf16 autocast on a CPU with native bf16, else fp32; the official recipe
  has ``use_amp: True``, which on the CPU is bf16 autocast); ``--fp32`` turns both off.

A capped run's mAP is what it reached by the cap (its last written checkpoint; none: "not measured"), and where
both trainers hit the cap the wall ratio is about 1 by construction.

The goal columns (issue 47): our mAP50-95 minus theirs (from random weights: >= +0.05; fine-tuning: >= 0) and our
wall time over theirs (<= 0.6).
Run it on an idle machine: the two trainers go one after the other, never at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ultralytics_side_by_side import final_map  # noqa: E402
from utils.data.shapes import SHAPE_NAMES, ensure_shapes_dataset  # noqa: E402

PARTS = ("ours", "theirs", "yolo11n", "finetune", "recipes")
# Our two D-FINE recipes (data/hyps/hyp.NAME.yaml) that the recipes part compares; issue 47: DEIM's becomes the dfine
# default if its mean mAP50-95 over the seeds is at least this much higher.
RECIPE_FILES = ("dfine", "deim-dfine")
DEIM_DEFAULT_MARGIN = 0.01
OFFICIAL_CONFIG = "configs/dfine/dfine_hgnetv2_n_coco.yml"
# The official D-FINE-N recipe (configs/dfine/dfine_hgnetv2_n_coco.yml and its includes) and the run it is sized for.
RECIPE = {"batch": 128, "lr": 0.0008, "backbone_lr": 0.0004, "warmup": 500, "ema_decay": 0.9999, "ema_warmups": 1000}
RECIPE_STEPS = 160 * (118287 // 128)  # 160 epochs over COCO train2017's images at batch 128
PRETRAIN_CLASSES = (0, 1, 2)  # circle, rectangle, triangle
FINETUNE_CLASSES = (3, 4)  # cross, star
# Run inside the official repository: its model's state dict at a class count, for the converted checkpoint's keys.
OFFICIAL_STATE = """
import sys, torch
sys.path.insert(0, '.')
from src.core import YAMLConfig
config, nc, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = YAMLConfig(config, num_classes=nc, HGNetv2={'pretrained': False})
torch.save({'model': cfg.model.state_dict()}, out)
"""


# ---- data ----


def _write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _read_labels(label_file: Path) -> list[list[float]]:
    if not label_file.is_file():
        return []
    return [[float(v) for v in line.split()] for line in label_file.read_text(encoding="utf-8").splitlines() if line]


def coco_files(root: Path, names: list[str]) -> dict[str, Path]:
    """COCO JSON of each split's YOLO labels (image ids 1..N, category id = class index), beside the images."""
    import cv2
    import numpy as np

    from utils.coco_json import ground_truth_dict, write_json

    files = {}
    for split in ("train", "val"):
        images = sorted((root / "images" / split).glob("*.jpg"))
        labels = [np.array(_read_labels(root / "labels" / split / f"{p.stem}.txt")).reshape(-1, 5) for p in images]
        shapes = [cv2.imread(str(p)).shape[:2] for p in images]
        gt = ground_truth_dict(labels, shapes, list(range(1, len(images) + 1)), [p.name for p in images], names)
        files[split] = write_json(gt, root / f"{split}_coco.json")
    return files


def relabelled(source: Path, dest: Path, keep: tuple[int, ...], names: list[str]) -> Path:
    """``source``'s images (hard links where possible) with only the labels of classes ``keep``, renumbered 0.."""
    if (dest / "done").is_file():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    for split in ("train", "val"):
        (dest / "images" / split).mkdir(parents=True)
        (dest / "labels" / split).mkdir(parents=True)
        for image in sorted((source / "images" / split).glob("*.jpg")):
            try:
                os.link(image, dest / "images" / split / image.name)
            except OSError:
                shutil.copy2(image, dest / "images" / split / image.name)
            rows = [r for r in _read_labels(source / "labels" / split / f"{image.stem}.txt") if int(r[0]) in keep]
            lines = "".join(f"{keep.index(int(r[0]))} {' '.join(f'{v:.6f}' for v in r[1:])}\n" for r in rows)
            (dest / "labels" / split / f"{image.stem}.txt").write_text(lines, encoding="utf-8")
    coco_files(dest, names)
    (dest / "done").write_text("", encoding="utf-8")
    return dest


def dataset(root: Path, names: list[str]) -> dict[str, Any]:
    """A set's data YAML (ours) and COCO files (theirs)."""
    data_yaml = _write_yaml(
        root.parent / f"{root.name}.yaml",
        {"path": str(root), "train": "images/train", "val": "images/val", "names": names},
    )
    coco = {s: root / f"{s}_coco.json" for s in ("train", "val")}
    if not all(p.is_file() for p in coco.values()):
        coco = coco_files(root, names)
    return {"root": root, "yaml": data_yaml, "coco": coco, "nc": len(names), "names": names}


# ---- the schedule both trainers run ----


def schedule(n_train: int, epochs: int, batch: int) -> dict[str, Any]:
    """The recipe's learning rate scaled to the batch and its step counts to the run's share of the recipe's."""
    from models.families.dfine import DFINE

    steps = epochs * max(n_train // batch, 1)
    share = steps / RECIPE_STEPS
    window = share / (1 - RECIPE["ema_decay"])
    recipe = yaml.safe_load((ROOT / "data/hyps/hyp.dfine.yaml").read_text(encoding="utf-8"))
    stage = DFINE.stage_epoch(epochs, 0, SimpleNamespace(no_aug_share=recipe["no_aug_share"]))
    return {
        "batch": batch,
        "lr": RECIPE["lr"] * batch / RECIPE["batch"],
        "backbone_lr": RECIPE["backbone_lr"] * batch / RECIPE["batch"],
        "steps": steps,
        "share": share,
        "warmup_steps": max(1, round(RECIPE["warmup"] * share)),
        "ema_warmups": max(1, round(RECIPE["ema_warmups"] * share)),
        "ema_decay": round(1 - 1 / window, 6) if window > 1 else 0.0,
        "epochs": epochs,
        "stage_epoch": stage if stage is not None else epochs,
    }


def our_hyp(work: Path, plan: dict[str, Any], name: str, recipe: str = "dfine") -> Path:
    """data/hyps/hyp.RECIPE.yaml with the run's learning rate, warm-up (the recipe's own step count, scaled as the
    others) and EMA."""
    hyp = yaml.safe_load((ROOT / f"data/hyps/hyp.{recipe}.yaml").read_text(encoding="utf-8"))
    hyp.update(
        lr0=plan["lr"],
        warmup_steps=max(1, round(hyp["warmup_steps"] * plan["share"])),
        ema_tau=float(plan["ema_warmups"]),
        ema_decay=plan["ema_decay"],
    )
    return _write_yaml(work / f"hyp.{recipe}.{name}.yaml", hyp)


def official_config(work: Path, repo: Path, data: dict, plan: dict, opt: argparse.Namespace, name: str) -> Path:
    """The official trainer's config for this run: the D-FINE-N COCO config with the run's overrides."""
    size = [opt.imgsz, opt.imgsz]
    root = data["root"]
    optimizer = yaml.safe_load((repo / "configs/dfine/dfine_hgnetv2_n_coco.yml").read_text())["optimizer"]
    for group in optimizer["params"]:
        if "lr" in group:  # the backbone's groups
            group["lr"] = plan["backbone_lr"]
    optimizer["lr"] = plan["lr"]
    stopped = ["RandomPhotometricDistort", "RandomZoomOut", "RandomIoUCrop"]
    config = {
        "__include__": [str(repo / OFFICIAL_CONFIG)],
        "output_dir": str(work / name),
        "num_classes": data["nc"],
        "remap_mscoco_category": False,
        "device": "cpu",
        "use_amp": not opt.fp32,
        "eval_spatial_size": size,
        "epochs": plan["epochs"],
        "checkpoint_freq": 10**6,
        "print_freq": 10,
        "HGNetv2": {"pretrained": False},
        "optimizer": optimizer,
        "lr_warmup_scheduler": {"type": "LinearWarmup", "warmup_duration": plan["warmup_steps"]},
        "ema": {"type": "ModelEMA", "decay": plan["ema_decay"], "warmups": plan["ema_warmups"], "start": 0},
        "train_dataloader": {
            "total_batch_size": plan["batch"],
            "num_workers": opt.workers,
            "dataset": {
                "img_folder": str(root / "images/train"),
                "ann_file": str(data["coco"]["train"]),
                "transforms": {
                    "ops": [
                        {"type": "RandomPhotometricDistort", "p": 0.5},
                        {"type": "RandomZoomOut", "fill": 0},
                        {"type": "RandomIoUCrop", "p": 0.8},
                        {"type": "SanitizeBoundingBoxes", "min_size": 1},
                        {"type": "RandomHorizontalFlip"},
                        {"type": "Resize", "size": size},
                        {"type": "SanitizeBoundingBoxes", "min_size": 1},
                        {"type": "ConvertPILImage", "dtype": "float32", "scale": True},
                        {"type": "ConvertBoxes", "fmt": "cxcywh", "normalize": True},
                    ],
                    "policy": {"name": "stop_epoch", "epoch": plan["stage_epoch"], "ops": stopped},
                },
            },
            "collate_fn": {
                "base_size": opt.imgsz,
                "base_size_repeat": None,
                "stop_epoch": plan["stage_epoch"],
                "ema_restart_decay": plan["ema_decay"],
            },
        },
        "val_dataloader": {
            "total_batch_size": plan["batch"],
            "num_workers": opt.workers,
            "dataset": {
                "img_folder": str(root / "images/val"),
                "ann_file": str(data["coco"]["val"]),
                "transforms": {
                    "ops": [
                        {"type": "Resize", "size": size},
                        {"type": "ConvertPILImage", "dtype": "float32", "scale": True},
                    ]
                },
            },
        },
    }
    return _write_yaml(work / f"{name}.yml", config)


# ---- running and measuring ----


def run_capped(cmd: list[str], cwd: Path, log: Path, cap_s: float, env: dict[str, str] | None = None) -> dict:
    """A whole process, timed with time.monotonic; at ``cap_s`` its process group gets SIGTERM (SIGKILL a minute
    later)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {' '.join(cmd)}  (log {log})", flush=True)
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        capped = False
        try:
            code = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            capped = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
        wall = time.monotonic() - t0
    return {"wall_s": round(wall, 1), "exit": code, "capped": capped, "log": str(log), "cmd": cmd}


def our_val(weights: Path, data: dict, opt: argparse.Namespace, name: str) -> dict:
    """mAP50-95 (and mAP50) of our val.py on the val split."""
    cmd = [sys.executable, "val.py", "--data", str(data["yaml"]), "--weights", str(weights), "--imgsz", str(opt.imgsz)]
    cmd += ["--batch-size", str(opt.batch_size), "--workers", str(opt.workers), "--device", "cpu", "--noplots"]
    cmd += ["--project", str(opt.work / "val"), "--name", name, "--exist-ok"]
    run = run_capped(cmd, ROOT, opt.work / "logs" / f"val_{name}.log", 3600)
    return {"weights": str(weights), "map50_95": final_map(Path(run["log"])), "exit": run["exit"]}


def train_ours(
    cfg: str, data: dict, opt: argparse.Namespace, name: str, extra: list[str], resume: bool = False
) -> dict:
    """Our train.py as a whole process, then our val.py on its best (else last) weights. With ``resume``, a run of
    that name that stopped before its end (its last.pt written) continues bit-exactly instead of starting again; its
    ``wall_s`` then counts the continued part only."""
    weights_dir = opt.work / "runs" / name / "weights"
    cmd = [sys.executable, "train.py", "--cfg", cfg, "--data", str(data["yaml"]), "--imgsz", str(opt.imgsz)]
    cmd += ["--batch-size", str(opt.batch_size), "--workers", str(opt.workers), "--device", "cpu"]
    cmd += ["--seed", str(opt.seed), "--project", str(opt.work / "runs"), "--name", name, "--exist-ok", "--noplots"]
    cmd += [*extra, *(["--no-amp"] if opt.fp32 else [])]
    resumed = resume and (weights_dir / "last.pt").is_file()
    if resumed:
        cmd += ["--resume", str(weights_dir / "last.pt")]
    log = opt.work / "logs" / f"{name}{'.resumed' if resumed else ''}.log"  # the first part's log stays
    run = {**run_capped(cmd, ROOT, log, opt.cap_hours * 3600), "resumed": resumed}
    weights = next((p for p in (weights_dir / "best.pt", weights_dir / "last.pt") if p.is_file()), None)
    run["val"] = our_val(weights, data, opt, name) if weights else {"map50_95": None, "why": "no weights written"}
    return run


def official_log(out_dir: Path) -> dict:
    """The official trainer's own per-epoch AP (its log.txt): the last and the best."""
    log = out_dir / "log.txt"
    aps = []
    if log.is_file():
        for line in log.read_text(encoding="utf-8").splitlines():
            stats = json.loads(line).get("test_coco_eval_bbox")
            if stats:
                aps.append(float(stats[0]))
    return {"epochs_logged": len(aps), "last_ap": aps[-1] if aps else None, "best_ap": max(aps) if aps else None}


def train_theirs(config: Path, data: dict, opt: argparse.Namespace, name: str, tuning: Path | None = None) -> dict:
    """The official train.py in its own folder and interpreter, then our val.py on its final checkpoint."""
    out_dir = opt.work / name
    shutil.rmtree(out_dir, ignore_errors=True)  # its trainer appends to log.txt and keeps older best_stg*.pth
    cmd = [opt.dfine_python, "train.py", "-c", str(config), "--seed", str(opt.seed), "-d", "cpu"]
    cmd += ["--output-dir", str(out_dir), *(["-t", str(tuning)] if tuning else [])]
    run = run_capped(cmd, opt.dfine_repo, opt.work / "logs" / f"{name}.log", opt.cap_hours * 3600)
    run["own_log"] = official_log(out_dir)
    if tuning:  # what its loader took from the checkpoint: every tensor but the class-count-dependent ones
        loaded = re.search(r"^Load model\.state_dict, (.*)$", Path(run["log"]).read_text(errors="replace"), re.M)
        run["tuning_load"] = loaded[1] if loaded else "no load line in its log"
    final = next((p for p in (out_dir / "best_stg2.pth", out_dir / "best_stg1.pth") if p.is_file()), None)
    run["val"] = our_val(final, data, opt, name) if final else {"map50_95": None, "why": "no checkpoint written"}
    return run


# ---- our checkpoint in the official layout ----


def to_official(ours: Path, repo: Path, config: Path, python: str, dest: Path) -> dict:
    """Our checkpoint's weights under the official model's names ({'model': state}), for its ``-t``; checked by
    reading the file back through our importer."""
    import torch

    from models.families.detr_import import official_name_to_ours
    from models.families.dfine import DFINE
    from models.loading import load_model

    model, ckpt = load_model(ours)
    state = model.state_dict()
    layout = dest.with_suffix(".layout.pth")
    code = subprocess.run(
        [python, "-c", OFFICIAL_STATE, str(config), str(ckpt["model_cfg"]["nc"]), str(layout)],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    if code.returncode:
        raise SystemExit(f"{config}: the official model would not build:\n{code.stderr[-2000:]}")
    official = torch.load(layout, map_location="cpu", weights_only=True)["model"]
    packed = re.compile(r"^(?P<owner>.*\.self_attn)\.in_proj_(?P<kind>weight|bias)$")
    converted = {}
    for key, tensor in official.items():
        if re.match(DFINE.official_dropped, key):
            converted[key] = tensor  # what transformers computes: the official model's own values
            continue
        name = official_name_to_ours(key, DFINE)
        qkv = packed.match(name)
        if qkv:
            parts = [state[f"{qkv['owner']}.{p}_proj.{qkv['kind']}"] for p in "qkv"]
            converted[key] = torch.cat(parts, 0)
        else:
            converted[key] = state[name]
        if converted[key].shape != tensor.shape:
            raise SystemExit(f"{ours}: {name} {tuple(converted[key].shape)} does not fit {key} {tuple(tensor.shape)}")
    torch.save({"model": converted}, dest)
    back, _ = load_model(dest)
    back_state = back.state_dict()
    differing = [k for k, v in state.items() if not torch.equal(v, back_state[k])]
    if differing:
        raise SystemExit(f"{dest}: {len(differing)} tensors differ after the round trip (first {differing[0]})")
    return {"converted": str(dest), "tensors": len(converted), "round_trip": "every tensor equal"}


# ---- the parts ----


def record(out: Path, part: str, result: dict) -> dict:
    results = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    results[part] = result
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1), encoding="utf-8")
    os.replace(tmp, out)
    return results


def part_race(part: str, opt: argparse.Namespace, data: dict, machine: dict) -> dict:
    plan = schedule(opt.n_train, opt.epochs, opt.batch_size)
    epochs = ["--epochs", str(opt.epochs)]
    if part == "ours":
        hyp = our_hyp(opt.work, plan, "race")
        result = train_ours("dfine-n.yaml", data, opt, "ours_dfine_n", ["--weights", "", "--hyp", str(hyp), *epochs])
    elif part == "theirs":
        config = official_config(opt.work, opt.dfine_repo, data, plan, opt, "theirs_dfine_n")
        result = train_theirs(config, data, opt, "theirs_dfine_n")
    else:
        results = json.loads(opt.out.read_text(encoding="utf-8")) if opt.out.is_file() else {}
        if "ours" not in results:
            return {"not measured": "needs the 'ours' part's wall time first"}
        hours = results["ours"]["wall_s"] / 3600
        result = train_ours("yolo11n.yaml", data, opt, "yolo11n", ["--weights", "", "--time", f"{hours:.5f}"])
        return {**result, "time_hours": hours, "machine": machine}
    return {**result, "schedule": plan, "machine": machine}


def part_finetune(opt: argparse.Namespace, data: dict, machine: dict) -> dict:
    names = list(SHAPE_NAMES)
    pre_names = [names[c] for c in PRETRAIN_CLASSES]
    ft_names = [names[c] for c in FINETUNE_CLASSES]
    pre = dataset(
        relabelled(data["root"], opt.work / f"{data['root'].name}_c012", PRETRAIN_CLASSES, pre_names), pre_names
    )
    ft_source = ensure_shapes_dataset(
        opt.work / f"shapes_{opt.ft_train}_{opt.ft_val}_{opt.imgsz}_s{opt.data_seed + 1}",
        n_train=opt.ft_train,
        n_val=opt.ft_val,
        imgsz=opt.imgsz,
        seed=opt.data_seed + 1,
    )
    ft = dataset(relabelled(ft_source, opt.work / f"{ft_source.name}_c34", FINETUNE_CLASSES, ft_names), ft_names)
    result: dict[str, Any] = {"machine": machine, "classes": {"pretrain": pre_names, "finetune": ft_names}}

    pre_plan = schedule(opt.n_train, opt.ft_pretrain_epochs, opt.batch_size)
    hyp = our_hyp(opt.work, pre_plan, "pretrain")
    args = ["--weights", "", "--hyp", str(hyp), "--epochs", str(opt.ft_pretrain_epochs)]
    result["pretrain"] = {**train_ours("dfine-n.yaml", pre, opt, "ft_pretrain", args), "schedule": pre_plan}
    record(opt.out, "finetune", result)
    weights_dir = opt.work / "runs/ft_pretrain/weights"
    checkpoint = next((p for p in (weights_dir / "best.pt", weights_dir / "last.pt") if p.is_file()), None)
    if checkpoint is None:
        result["not measured"] = "the pre-training wrote no weights"
        return result

    plan = schedule(opt.ft_train, opt.ft_epochs, opt.batch_size)
    hyp = our_hyp(opt.work, plan, "finetune")
    args = ["--weights", str(checkpoint), "--hyp", str(hyp), "--epochs", str(opt.ft_epochs)]
    result["ours"] = {**train_ours("", ft, opt, "ft_ours", args), "schedule": plan}
    record(opt.out, "finetune", result)

    config = official_config(opt.work, opt.dfine_repo, ft, plan, opt, "ft_theirs")
    try:
        conversion = to_official(checkpoint, opt.dfine_repo, config, opt.dfine_python, opt.work / "ft_pretrain.pth")
    except SystemExit as e:
        result["theirs"] = {"not measured": f"conversion failed: {e}"}
        return result
    result["theirs"] = {**train_theirs(config, ft, opt, "ft_theirs", Path(conversion["converted"])), **conversion}
    result["theirs"]["schedule"] = plan
    return result


def part_recipes(opt: argparse.Namespace, data: dict, machine: dict) -> dict:
    """Our dfine-n from random weights with each recipe and each ``--recipe-seeds`` seed, on the race's set and
    schedule. A (recipe, seed) already in ``--out`` is not run again, so that several calls (one per core) share the
    work: each records its runs as they end; one that was stopped before its end resumes from its last.pt."""
    plan = schedule(opt.n_train, opt.epochs, opt.batch_size)
    for recipe in opt.recipes:
        hyp = our_hyp(opt.work, plan, "recipes", recipe)
        for seed in opt.recipe_seeds:
            if str(seed) in recorded_recipes(opt.out).get(recipe, {}):
                continue
            seeded = argparse.Namespace(**{**vars(opt), "seed": seed})
            args = ["--weights", "", "--hyp", str(hyp), "--epochs", str(opt.epochs)]
            run = train_ours("dfine-n.yaml", data, seeded, f"recipe_{recipe}_s{seed}", args, resume=True)
            done = recorded_recipes(opt.out)  # read again: another call may have recorded a run meanwhile
            done.setdefault(recipe, {})[str(seed)] = {**run, "schedule": plan, "machine": machine}
            record(opt.out, "recipes", done)
    return recorded_recipes(opt.out)


def recorded_recipes(out: Path) -> dict:
    """The recipes part's runs in ``out`` so far: {recipe: {seed: run}}."""
    return json.loads(out.read_text(encoding="utf-8")).get("recipes", {}) if out.is_file() else {}


def recipes_table(runs: dict) -> str:
    """Each recipe's mAP50-95 per seed and mean, and the issue's rule for the dfine default."""
    seeds = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    head = f"| recipe | {' | '.join(f'seed {s}' for s in seeds)} | mean | wall s (mean) |\n"
    head += "| --- " * (len(seeds) + 3) + "|"
    rows, means = [], {}
    for recipe in RECIPE_FILES:
        by_seed = runs.get(recipe, {})
        maps = [_map(by_seed.get(str(s))) for s in seeds]
        measured = [m for m in maps if m is not None]
        walls = [r["wall_s"] for r in by_seed.values() if "wall_s" in r]
        means[recipe] = sum(measured) / len(measured) if len(measured) == len(seeds) and seeds else None
        cells = " | ".join(_cell(m, ".3f") for m in maps)
        wall = _cell(sum(walls) / len(walls) if walls else None, ".0f")
        rows.append(f"| hyp.{recipe}.yaml | {cells} | {_cell(means[recipe], '.3f')} | {wall} |")
    dfine, deim = means.get("dfine"), means.get("deim-dfine")
    if dfine is None or deim is None:
        rule = "DEIM's recipe as the default: not decided (a recipe lacks a seed's run)"
    else:
        verdict = "yes" if deim - dfine >= DEIM_DEFAULT_MARGIN else "no"
        rule = f"DEIM's mean - D-FINE's: {deim - dfine:+.3f} (it becomes the default at >= +{DEIM_DEFAULT_MARGIN}): {verdict}"
    return "\n".join([head, *rows, "", rule])


# ---- the tables ----


def _map(run: dict | None) -> float | None:
    value = ((run or {}).get("val") or {}).get("map50_95")
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _cell(value: float | None, fmt: str) -> str:
    return "not measured" if value is None else format(value, fmt)


def _row(label: str, run: dict | None) -> str:
    if not run or "wall_s" not in run:
        why = (run or {}).get("not measured", "not run")
        return f"| {label} | not measured ({why}) | | | |"
    own = _cell(run["own_log"]["last_ap"], ".3f") if "own_log" in run else "-"  # the official trainer's only
    status = f"exit {run['exit']}" + (", capped" if run["capped"] else "")
    return f"| {label} | {_cell(_map(run), '.3f')} | {own} | {run['wall_s']:.0f} | {status} |"


def _goals(label: str, ours: dict | None, theirs: dict | None, min_gap: float) -> str:
    m_ours, m_theirs = _map(ours), _map(theirs)
    gap = None if m_ours is None or m_theirs is None else m_ours - m_theirs
    walls = [(r or {}).get("wall_s") for r in (ours, theirs)]
    ratio = walls[0] / walls[1] if None not in walls and walls[1] else None
    met = "not measured" if gap is None or ratio is None else ("yes" if gap >= min_gap and ratio <= 0.6 else "no")
    return f"| {label} | {_cell(gap, '+.3f')} | >= {min_gap:+.2f} | {_cell(ratio, '.2f')} | <= 0.6 | {met} |"


def tables(results: dict) -> str:
    head = "| run | mAP50-95 (our val.py) | own log's last AP | wall s | status |\n| --- | --- | --- | --- | --- |"
    race = [
        _row("D-FINE-N, ours", results.get("ours")),
        _row("D-FINE-N, official trainer", results.get("theirs")),
        _row("yolo11n, ours, our D-FINE's wall time", results.get("yolo11n")),
    ]
    ft = results.get("finetune", {})
    fine = [
        _row("pre-training (ours, classes 0-2)", ft.get("pretrain")),
        _row("fine-tuning, ours", ft.get("ours")),
        _row("fine-tuning, official trainer", ft.get("theirs")),
    ]
    goals = "| comparison | mAP50-95 ours - theirs | goal | wall ours / theirs | goal | met |\n"
    goals += "| --- | --- | --- | --- | --- | --- |\n"
    goals += _goals("from random weights", results.get("ours"), results.get("theirs"), 0.05) + "\n"
    goals += _goals("fine-tuning", ft.get("ours"), ft.get("theirs"), 0.0)
    recipes = ["", recipes_table(results["recipes"])] if "recipes" in results else []
    return "\n".join([head, *race, "", head, *fine, "", goals, *recipes])


def machine() -> dict:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "unknown",
    )
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    return {"cpu": model, "avx512_bf16": bf16, "cores": os.cpu_count(), "load_at_start": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dfine-repo", type=Path, help="a checkout of github.com/Peterande/D-FINE (theirs, finetune)")
    p.add_argument("--dfine-python", default=sys.executable, help="a Python with the official trainer's packages")
    p.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    p.add_argument("--n-train", type=int, default=800)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--imgsz", type=int, default=320, help="generated images' and both trainers' size")
    p.add_argument("--data-seed", type=int, default=1, help="generator seed (the fine-tuning set uses seed + 1)")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16, help="both trainers' total batch")
    p.add_argument("--workers", type=int, default=2, help="data workers of both trainers")
    p.add_argument("--seed", type=int, default=0, help="training seed of both trainers")
    p.add_argument("--cap-hours", type=float, default=2.0, help="each training process is stopped after this long")
    p.add_argument("--fp32", action="store_true", help="both trainers without mixed precision")
    p.add_argument("--ft-train", type=int, default=200, help="fine-tuning set: train images")
    p.add_argument("--ft-val", type=int, default=100, help="fine-tuning set: val images")
    p.add_argument("--ft-pretrain-epochs", type=int, default=24)
    p.add_argument("--ft-epochs", type=int, default=12)
    p.add_argument("--recipes", nargs="+", choices=RECIPE_FILES, default=list(RECIPE_FILES), help="recipes part")
    p.add_argument("--recipe-seeds", nargs="+", type=int, default=[0, 1, 2], help="recipes part: training seeds")
    p.add_argument("--work", type=Path, default=ROOT / "runs/bench_detr_race", help="data, configs, runs, logs")
    p.add_argument("--out", type=Path, help="the results JSON (default: WORK/results.json)")
    opt = p.parse_args()
    opt.work = opt.work.resolve()
    opt.work.mkdir(parents=True, exist_ok=True)
    opt.out = (opt.out or opt.work / "results.json").resolve()
    if (opt.imgsz // 16) ** 2 + (opt.imgsz // 32) ** 2 < 300:  # D-FINE-N's tokens at strides 16 and 32
        raise SystemExit(f"--imgsz {opt.imgsz}: D-FINE-N picks its 300 queries from the encoder's tokens; use >= 256")
    needs_repo = {"theirs", "finetune"} & set(opt.part)
    if needs_repo and not (opt.dfine_repo and (opt.dfine_repo / OFFICIAL_CONFIG).is_file()):
        raise SystemExit(f"--dfine-repo {opt.dfine_repo}: no {OFFICIAL_CONFIG} there (needed by {sorted(needs_repo)})")
    if opt.dfine_repo:
        opt.dfine_repo = opt.dfine_repo.resolve()

    source = ensure_shapes_dataset(
        opt.work / f"shapes_{opt.n_train}_{opt.n_val}_{opt.imgsz}_s{opt.data_seed}",
        n_train=opt.n_train,
        n_val=opt.n_val,
        imgsz=opt.imgsz,
        seed=opt.data_seed,
    )
    data = dataset(source, list(SHAPE_NAMES))
    print(f"data: {data['yaml']} ({opt.n_train} train / {opt.n_val} val at {opt.imgsz} px); results {opt.out}")
    where = machine()
    for part in PARTS:
        if part not in opt.part:
            continue
        t0 = time.monotonic()
        if part == "recipes":
            part_recipes(opt, data, where)
            print(f"{part}: done in {time.monotonic() - t0:.0f} s", flush=True)
            continue
        result = part_finetune(opt, data, where) if part == "finetune" else part_race(part, opt, data, where)
        result["part_wall_s"] = round(time.monotonic() - t0, 1)
        record(opt.out, part, result)
        print(f"{part}: done in {result['part_wall_s']:.0f} s", flush=True)
    print(tables(json.loads(opt.out.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
