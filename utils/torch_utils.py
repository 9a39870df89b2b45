"""PyTorch helpers every entry point needs: the device, seeds, synchronised timing, rank-0-first blocks."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from utils.cli import DeviceRequest, parse_device
from utils.distributed import DistInfo, local_rank_zero_first
from utils.errors import UserError
from utils.log import LOGGER


def select_device(device: str | DeviceRequest = "", local_rank: int = -1, local_world_size: int = 1) -> torch.device:
    """This process's device for --device '' (CUDA if present, else CPU), 'cpu', '0' or '0,1,2,3' (read by
    ``utils/cli.py: parse_device``, the option's one parser).

    In a distributed run the list names the GPUs of this machine, one per local rank: ``--device 2,3`` puts
    local rank 0 on GPU 2 and local rank 1 on GPU 3; a GPU named twice ('0,0') is shared by two ranks. The entry
    points have made only those visible (utils/process.py); called without that (the Python API), the list indexes
    the GPUs CUDA sees.
    """
    request = parse_device(device)
    ids = [str(i) for i in request.gpus]
    if request.cpu:
        chosen = torch.device("cpu")
    elif request.gpus:
        processes = max(local_world_size, 1) if local_rank >= 0 else 1
        if len(ids) < processes:
            raise UserError(
                f"--device {request} names {len(ids)} GPU(s) for {processes} processes on this machine "
                "(LOCAL_WORLD_SIZE): name one GPU per process"
            )
        distinct = list(request.distinct)  # '0,0': two ranks share GPU 0, which is made visible once
        only_these = os.environ.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, distinct))  # set by setup_process
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < (len(distinct) if only_these else max(distinct) + 1):
            raise UserError(
                f"--device '{device}' asks for CUDA device(s) {request} but {available} CUDA device(s) are "
                f"available{'' if available else ' (use --device cpu)'}"
            )
        mine = request.gpus[max(local_rank, 0)]
        chosen = torch.device("cuda", distinct.index(mine) if only_these else mine)
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        chosen = torch.device("cuda", max(local_rank, 0)) if ids else torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)

    parts = [f"Python-{platform.python_version()} torch-{torch.__version__}"]
    if chosen.type == "cuda":
        p = torch.cuda.get_device_properties(chosen.index)
        name = ids[max(local_rank, 0)] if ids else chosen.index
        parts.append(f"CUDA:{name} ({p.name}, {p.total_memory / (1 << 20):.0f}MiB)")
    else:
        parts.append(f"CPU ({torch.get_num_threads()} threads)")
    LOGGER.info(" ".join(parts))
    return chosen


def local_ranks_share_a_gpu(device: str | DeviceRequest, local_world_size: int) -> bool:
    """Whether --device gives one GPU to several ranks of this machine ('0,0'): NCCL refuses that, gloo does not."""
    gpus = parse_device(device).gpus[: max(local_world_size, 1)]
    return len(set(gpus)) < len(gpus)


def init_torch_seeds(seed: int = 0) -> None:
    """Seed python, numpy and torch (repeatable kernels are a process-wide setting: utils/process.py)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def time_synchronized() -> float:
    """A monotonic clock's reading in seconds (``time.perf_counter``), taken once queued CUDA work has finished; only
    differences between two readings mean anything. CUDA is synchronised only where it is already in use, so that
    timing a CPU run never initialises it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def torch_distributed_zero_first(local_rank: int) -> Iterator[None]:
    """Run the block on local rank 0 first; the machine's other ranks enter it once local rank 0 has left it.

    The others wait on the rendezvous store, not in a collective, so the block may take hours.
    """
    if local_rank == -1 or not (dist.is_available() and dist.is_initialized()):
        yield
        return
    info = DistInfo(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size())
    with local_rank_zero_first(info):
        yield


def cpu_fp32_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's state_dict on the CPU with floating-point tensors in fp32 (checkpoints stay fp32)."""
    return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in module.state_dict().items()}
