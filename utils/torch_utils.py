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

from utils.distributed import slow_barrier
from utils.errors import UserError
from utils.log import LOGGER


def select_device(device: str = "", batch_size: int | None = None) -> torch.device:
    """Resolve '' (CUDA 0 if present, else CPU), 'cpu', '0' or '0,1,2,3' to the device this process uses."""
    spec = str(device).strip().lower().replace("cuda:", "").replace(" ", "")
    if spec == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # keep CUDA from initialising in CPU runs
        chosen = torch.device("cpu")
        ids: list[str] = []
    elif spec:
        ids = spec.split(",")
        if not all(i.isdigit() for i in ids):
            raise UserError(f"--device '{device}' is not valid: use 'cpu', '0' or '0,1,2,3'")
        os.environ["CUDA_VISIBLE_DEVICES"] = spec  # must happen before CUDA initialises
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < len(ids):
            raise UserError(
                f"--device '{device}' asks for CUDA device(s) {spec} but {available} CUDA device(s) are "
                f"available{'' if available else ' (use --device cpu)'}"
            )
        chosen = torch.device("cuda", 0)
    else:
        ids = ["0"] if torch.cuda.is_available() else []
        chosen = torch.device("cuda", 0) if ids else torch.device("cpu")

    if len(ids) > 1 and batch_size is not None and batch_size > 0 and batch_size % len(ids):
        raise UserError(f"--batch-size {batch_size} must be a multiple of the number of devices ({len(ids)})")

    parts = [f"Python-{platform.python_version()} torch-{torch.__version__}"]
    if chosen.type == "cuda":
        for i in range(len(ids)):
            p = torch.cuda.get_device_properties(i)
            parts.append(f"CUDA:{ids[i]} ({p.name}, {p.total_memory / (1 << 20):.0f}MiB)")
    else:
        parts.append(f"CPU ({torch.get_num_threads()} threads)")
    LOGGER.info(" ".join(parts))
    return chosen


def init_torch_seeds(seed: int = 0, deterministic: bool = False) -> None:
    """Seed python, numpy and torch; ``deterministic`` also makes kernels bit-for-bit repeatable."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        torch.backends.cudnn.benchmark = True


def time_synchronized() -> float:
    """Wall time in seconds once queued CUDA work has finished."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.time()


@contextlib.contextmanager
def torch_distributed_zero_first(local_rank: int) -> Iterator[None]:
    """Run the block on local rank 0 first; the other ranks enter it once local rank 0 has left it."""
    active = local_rank != -1 and dist.is_available() and dist.is_initialized()
    if active and local_rank != 0:
        slow_barrier()
    yield
    if active and local_rank == 0:
        slow_barrier()
