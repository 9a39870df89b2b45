"""The model as the step runs it: wrapped for DDP across ranks, its forward optionally compiled (--compile).

DDP's settings, and why each keeps a run exactly what it was (docs/distributed.md, "How DDP is set up"):

- Buffers are broadcast once, when the wrapper is made, not before every forward. The only buffers training
  changes are BatchNorm's running statistics, and a BatchNorm in training mode normalises with the batch's own
  statistics, never its running ones: no forward pass, loss or gradient reads them. Rank 0's buffers follow the
  same sequence either way (broadcasting rank 0's buffers to rank 0 changes nothing), so rank 0's model, EMA and
  checkpoints are bit for bit those of a run that broadcasts them every step. The other ranks' running statistics
  follow their own batches (with --sync-bn the global batch's, the same on every rank); what reads them is their
  EMA, which validates their part of the split: ``share_buffers`` gives every rank rank 0's EMA buffers before each
  validation, so every rank validates exactly the weights rank 0 saves (the per-forward broadcast does not: each rank
  moves rank 0's statistics by its own batch before its EMA reads them).
- Gradient buckets are sized to the model (``bucket_cap_mb``): DDP starts a bucket's all-reduce once all its
  gradients exist. With torch's 25 MiB, yolo11n's 10 MiB of gradients make one bucket beside the 1 MiB first one,
  ready only when the backward pass reaches the first layers, so nothing overlaps the backward pass; about
  ``BUCKETS`` buckets let the head's and the late layers' all-reduces run while the early layers' gradients are
  computed, at a few microseconds of launch each.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from utils.distributed import DistInfo, collective
from utils.log import LOGGER

BUCKETS = 8  # gradient buckets a model's gradients are split into, at most (see the module's docstring)
MIN_BUCKET_MB = 1.0  # below this an all-reduce costs its latency more than its bytes
MAX_BUCKET_MB = 25.0  # torch's own default: large models keep it


def bucket_cap_mb(model: nn.Module) -> float:
    """The gradient bucket size (MiB) that splits ``model``'s trainable gradients into about ``BUCKETS``."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, grad_bytes / 2**20 / BUCKETS))


def wrap_ddp(model: nn.Module, device: torch.device) -> DDP:
    """``model`` in DDP: buffers made equal once now and not broadcast before each forward, buckets sized to it."""
    cap = bucket_cap_mb(model)
    options: dict = {"bucket_cap_mb": cap}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:  # torch 2.13+: init sync kept
        options["forward_sync_buffers"] = False
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
    else:  # older torch: broadcast_buffers=False also skips the init sync of buffers, made here instead
        ddp = DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False, **options
        )
        broadcast_buffers(model)
    LOGGER.info(f"DDP: gradient buckets of {cap:.2f} MiB, buffers broadcast once (not before every forward)")
    return ddp


def broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's buffers on every rank, one broadcast per dtype (a no-op outside a process group)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in module.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    with torch.no_grad(), collective("broadcast"):
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            torch._foreach_copy_(
                buffers, [f.view_as(b) for f, b in zip(flat.split([b.numel() for b in buffers]), buffers)]
            )


def share_buffers(module: nn.Module, info: DistInfo) -> None:
    """Before a validation: every rank's ``module`` (the EMA) takes rank 0's buffers, its BN running statistics."""
    if info.is_distributed:
        broadcast_buffers(module)


def compile_forward(model: nn.Module, backend: str) -> nn.Module:
    """--compile: ``model``'s forward (the DDP wrapper's, so that dynamo splits its graphs at the gradient
    buckets) compiled in place with ``backend``; '' leaves it. In place, so the module and its ``state_dict`` keys
    stay as they are (no ``_orig_mod.`` prefix in checkpoints); the loss is not compiled. Compiling happens at the
    first forward of each new input shape."""
    if not backend:
        return model
    model.compile(backend=backend)
    LOGGER.info(f"torch.compile: the model's forward with backend {backend}, compiled at its first step")
    return model
