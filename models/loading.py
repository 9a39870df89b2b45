"""Models from checkpoint files: the checkpoint code (utils/checkpoint.py) reads files into dicts, each model's
family (models/families/) builds it from its config; this joins the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from models.families import family_of
from utils.checkpoint import load_checkpoint, model_weights


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """A checkpoint's model (EMA weights when present), built by its family, in eval mode on ``device``, and the
    checkpoint dict."""
    ckpt = load_checkpoint(path)
    family = family_of(ckpt["model_cfg"])
    model = family.build_model(ckpt["model_cfg"], weights=model_weights(ckpt), names=ckpt.get("names"))
    return model.to(device).eval(), ckpt
