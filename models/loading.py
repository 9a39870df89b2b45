"""Models from checkpoint files: the checkpoint code (utils/checkpoint.py) reads files into dicts, the model
registry (models/yolo.py) builds models from configs; this joins the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.yolo import Model, build_model
from utils.checkpoint import load_checkpoint, model_weights


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[Model, dict[str, Any]]:
    """A checkpoint's model (EMA weights when present) in eval mode on ``device``, and the checkpoint dict."""
    ckpt = load_checkpoint(path)
    model = build_model(ckpt["model_cfg"], weights=model_weights(ckpt), names=ckpt.get("names"))
    return model.to(device).eval(), ckpt
