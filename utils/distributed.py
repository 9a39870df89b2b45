"""Rank and world size of this process: the one place that reads torch.distributed.run's environment."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
