"""Models from checkpoint files: the checkpoint code (utils/checkpoint.py) reads files into dicts, each model's
family (models/families/) builds it from its config; this joins the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.families import family_of
from utils.checkpoint import load_checkpoint, model_weights
from utils.errors import UserError, describe
from utils.log import LOGGER


def class_names(names: Any, nc: int, path: str | Path) -> list[str]:
    """``nc`` class names from a checkpoint's ``names`` (a list, or a dict by index): a class the file names none
    for is called by its index, names beyond ``nc`` are dropped, each with one warning; never an index error later."""
    if isinstance(names, dict):
        names = [names.get(i, names.get(str(i))) for i in range(nc)]
    if not isinstance(names, (list, tuple)):
        LOGGER.warning(f"{path}: no class names; classes are called by their index")
        return [str(i) for i in range(nc)]
    named = [str(n) if n is not None else str(i) for i, n in enumerate(names[:nc])]
    if len(names) != nc:
        fill = (
            f"; classes {len(named)} to {nc - 1} are called by their index" if len(names) < nc else ", the rest dropped"
        )
        LOGGER.warning(f"{path}: {len(names)} class names for {nc} classes{fill}")
    return named + [str(i) for i in range(len(named), nc)]


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """A checkpoint's model (EMA weights when present), built by its family, in eval mode on ``device``, and the
    checkpoint dict."""
    ckpt = load_checkpoint(path)
    family = family_of(ckpt["model_cfg"])
    try:
        model: Any = family.build_model(ckpt["model_cfg"], weights=model_weights(ckpt), names=ckpt.get("names"))
    except UserError as e:
        raise UserError(f"{path}: {e}") from e
    except (RuntimeError, TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        # The file opened but its config and weights do not make a model (edited, or written by another version).
        raise UserError(f"{path}: its model config and weights do not build a model ({describe(e)})"[:400]) from e
    model.names = class_names(ckpt.get("names"), model.nc, path)
    return model.to(device).eval(), ckpt
