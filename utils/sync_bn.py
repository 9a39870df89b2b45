"""Synchronised BatchNorm: torch's own with NCCL, an all-reduce version with gloo (on the CPU or a shared GPU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are the whole global batch's, summed over ranks.

    torch.nn.SyncBatchNorm only runs on accelerators; this one gathers per-channel means and squared
    deviations with an autograd-aware collective, so gradients also flow through the other ranks' statistics.
    Outside a process group it computes the same two-pass statistics of its own batch: PyTorch's CPU kernel in
    channels-last layout computes the variance in one pass, about 5e-4 (relative) from float64 on yolov5n, which
    would make a 1-process run differ from a W-rank one by more than rounding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        channels = x.shape[1]
        xf = x.float()
        # Each rank's count, mean and sum of squared deviations, combined exactly (Chan et al.): unlike
        # E[x^2] - mean^2 this does not cancel, so the statistics equal one process's up to rounding.
        count = torch.full((1,), xf.numel() / channels, dtype=torch.float32, device=x.device)
        local_mean = xf.mean((0, 2, 3))
        local_m2 = (xf - local_mean.view(1, -1, 1, 1)).square().sum((0, 2, 3))
        local = torch.cat((local_mean, local_m2, count))
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        gathered = torch.stack(dist_fn.all_gather(local)) if distributed else local.unsqueeze(0)
        counts = gathered[:, -1:]
        n = counts.sum()
        mean = (gathered[:, :channels] * counts).sum(0) / n
        m2 = gathered[:, channels : 2 * channels].sum(0) + ((gathered[:, :channels] - mean).square() * counts).sum(0)
        var = m2 / n
        if self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None  # kept when tracking
            assert self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = var.detach() * n / (n - 1).clamp(min=1)
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        scale = torch.rsqrt(var + self.eps)
        y = (xf - mean.view(1, -1, 1, 1)) * scale.view(1, -1, 1, 1)
        if self.affine:
            y = y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm2d with the synchronised version suited to ``device`` and the process group's backend:
    torch's own with NCCL, the all-reduce version with gloo (on the CPU, or ranks sharing a GPU)."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    if device.type != "cpu" and nccl:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, CpuSyncBatchNorm):
        # Made where the BatchNorm's tensors are (the model is already on its device, e.g. a GPU shared over gloo).
        tensors = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        where = next((t for t in tensors if t.is_floating_point()), None)
        factory: dict[str, Any] = {} if where is None else {"device": where.device, "dtype": where.dtype}
        sync = CpuSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **factory
        )
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device))
    return module
