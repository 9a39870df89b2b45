"""Synchronised BatchNorm for every backend: torch's own on CUDA, an all-reduce version on CPU (gloo)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are the whole global batch's, summed over ranks.

    torch.nn.SyncBatchNorm only runs on accelerators; this one all-reduces per-channel sums with an
    autograd-aware collective, so gradients also flow through the other ranks' statistics.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        channels = x.shape[1]
        xf = x.float()
        count = torch.full((1,), xf.numel() / channels, dtype=torch.float32, device=x.device)
        packed = torch.cat((xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count))
        packed = dist_fn.all_reduce(packed, op=dist.ReduceOp.SUM)
        n = packed[-1]
        mean = packed[:channels] / n
        var = (packed[channels:2 * channels] / n - mean * mean).clamp(min=0)
        if self.track_running_stats:
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
    """Replace every BatchNorm2d with the synchronised version suited to ``device``."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, CpuSyncBatchNorm):
        sync = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats)
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device))
    return module
