"""Model summary: layers, parameters, gradients and GFLOPs (counted by thop when it is installed)."""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn as nn

from utils.log import LOGGER


def model_flops(model: nn.Module, imgsz: int = 640) -> float | None:
    """GFLOPs of one forward pass at imgsz x imgsz, counted by thop; None when thop is unavailable."""
    try:
        import thop
    except ImportError:
        return None
    stride = int(getattr(model, "stride", torch.tensor([32])).max())
    ch = getattr(model, "yaml", {}).get("ch", 3)
    probe = torch.zeros((1, ch, stride, stride), device=next(model.parameters()).device)
    macs = thop.profile(deepcopy(model), inputs=(probe,), verbose=False)[0]
    return macs * 2 / 1e9 * (imgsz / stride) ** 2


def model_info(model: nn.Module, imgsz: int = 640) -> str:
    """One line: layers, parameters, gradients and GFLOPs at ``imgsz``; logged and returned."""
    n_params = sum(p.numel() for p in model.parameters())
    n_grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_layers = len(list(model.modules()))
    flops = model_flops(model, imgsz)
    flops_text = f", {flops:.1f} GFLOPs" if flops is not None else ""
    line = f"Model summary: {n_layers} layers, {n_params:,} parameters, {n_grads:,} gradients{flops_text}"
    LOGGER.info(line)
    return line
