"""Finding the checkpoint to resume and restoring the options of the run it belongs to."""
from __future__ import annotations

import argparse
from pathlib import Path

from utils.checkpoint import load_checkpoint
from utils.errors import UserError

# Options a resumed run may take anew; everything else comes from the checkpoint.
RESUME_OVERRIDABLE = ("device", "workers")


def latest_last_checkpoint(search_dir: str | Path = "runs/train") -> Path:
    candidates = sorted(Path(search_dir).glob("**/last.pt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise UserError(f"{search_dir}: no last.pt to resume (train first, or pass --resume PATH)")
    return candidates[-1]


def resumed_options(opt: argparse.Namespace, explicit: set[str]) -> tuple[argparse.Namespace, dict]:
    """Options of the interrupted run with ``explicit`` overridable flags applied, and its checkpoint."""
    path = latest_last_checkpoint(Path(opt.project)) if opt.resume is True else Path(opt.resume)
    ckpt = load_checkpoint(path)
    if "opt" not in ckpt or "epoch" not in ckpt:
        raise UserError(f"{path}: has no training state to resume (a final or stripped checkpoint?)")
    restored = argparse.Namespace(**ckpt["opt"])
    for name in RESUME_OVERRIDABLE:
        if name in explicit:
            setattr(restored, name, getattr(opt, name))
    restored.resume = str(path)
    restored.weights = str(path)
    return restored, ckpt
