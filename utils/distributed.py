"""Everything distributed: rank and world size (the one place that reads torch.distributed.run's environment),
the process group, barriers, and unwrapping DDP models."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank, -1 when not distributed
    local_rank: int  # rank on this machine, -1 when not distributed
    world_size: int  # 1 when not distributed

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank in (-1, 0)


def dist_info() -> DistInfo:
    """Read RANK, LOCAL_RANK and WORLD_SIZE as set by ``torch.distributed.run``."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size <= 1:
        return DistInfo(rank=-1, local_rank=-1, world_size=1)
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=world_size,
    )


def init_process_group(device: torch.device, timeout_s: float = 1800.0) -> None:
    """Join the process group: NCCL for CUDA devices, gloo for CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# A barrier group on gloo with a long timeout: a rank-0 job such as building the label cache of a million
# images may take longer than the default collective timeout, and gloo notices a dead peer at once.
_SLOW_BARRIER_GROUP: dist.ProcessGroup | None = None
SLOW_BARRIER_TIMEOUT = datetime.timedelta(hours=6)


def slow_barrier() -> None:
    """A barrier over all ranks that waits up to SLOW_BARRIER_TIMEOUT, yet fails at once if a peer dies."""
    global _SLOW_BARRIER_GROUP
    if _SLOW_BARRIER_GROUP is None:
        # new_group is collective: every rank reaches this line at the same point of the program.
        _SLOW_BARRIER_GROUP = dist.new_group(backend="gloo", timeout=SLOW_BARRIER_TIMEOUT)
    dist.barrier(group=_SLOW_BARRIER_GROUP)


def de_parallel(model: nn.Module) -> nn.Module:
    """The bare model inside a DataParallel/DistributedDataParallel wrapper."""
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) else model
