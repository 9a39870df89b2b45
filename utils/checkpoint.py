"""The project's one checkpoint format: a model config dict, state_dicts and plain values.

Everything in it opens with ``torch.load(path, weights_only=True)``, so loading never runs code from the
file. Files are written to a temporary name and renamed, so a crash never leaves a half-written checkpoint.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from utils.errors import UserError
from utils.distributed import de_parallel

FORMAT_VERSION = 1


def cpu_fp32_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's state_dict on the CPU with floating-point tensors in fp32 (checkpoints stay fp32)."""
    return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in module.state_dict().items()}


def model_state(model: nn.Module) -> dict[str, Any]:
    """The entries that rebuild a model: its config, class names and fp32 weights (on the CPU)."""
    bare = de_parallel(model)
    return {"model_cfg": bare.yaml, "names": list(bare.names), "model": cpu_fp32_state(bare)}


def save_checkpoint(ckpt: dict[str, Any], path: str | Path) -> None:
    """Write ``ckpt`` atomically: to a temporary file in the same folder, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format_version": FORMAT_VERSION, **ckpt}, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Open a checkpoint safely; a file that needs arbitrary unpickling is refused, never executed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{path}: refused: this checkpoint needs arbitrary unpickling (a pickled object or a foreign format); "
            "only checkpoints saved by this project load"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path}: not a readable checkpoint ({e.__class__.__name__}: {str(e).splitlines()[0]})") from e
    if not isinstance(ckpt, dict) or "model_cfg" not in ckpt or "model" not in ckpt:
        raise UserError(f"{path}: not a checkpoint of this project (no model config and weights)")
    return ckpt


def build_model(ckpt: dict[str, Any], weights: str = "ema") -> nn.Module:
    """Rebuild the model of a checkpoint with its EMA weights (when present) or its raw weights."""
    from models.yolo import Model

    model = Model(ckpt["model_cfg"])
    state = ckpt.get("ema") if weights == "ema" and ckpt.get("ema") is not None else ckpt["model"]
    model.load_state_dict(state)
    model.names = list(ckpt.get("names", model.names))
    return model


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Load a checkpoint and return its model (EMA weights when present, eval mode, on ``device``) and the dict."""
    ckpt = load_checkpoint(path)
    model = build_model(ckpt).to(device).eval()
    return model, ckpt
