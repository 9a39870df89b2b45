"""PyTorch helpers: devices, seeds, timing, rank ordering, EMA, fusion, model summary, optimizer groups."""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import random
import time
from copy import deepcopy
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from utils.errors import UserError
from utils.log import LOGGER

# A barrier group on gloo with a long timeout: a rank-0 job such as building the label cache of a million
# images may take longer than the default collective timeout, and gloo notices a dead peer at once.
_SLOW_BARRIER_GROUP: dist.ProcessGroup | None = None
SLOW_BARRIER_TIMEOUT = datetime.timedelta(hours=6)


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


def slow_barrier() -> None:
    """A barrier over all ranks that waits up to SLOW_BARRIER_TIMEOUT, yet fails at once if a peer dies."""
    global _SLOW_BARRIER_GROUP
    if _SLOW_BARRIER_GROUP is None:
        # new_group is collective: every rank reaches this line at the same point of the program.
        _SLOW_BARRIER_GROUP = dist.new_group(backend="gloo", timeout=SLOW_BARRIER_TIMEOUT)
    dist.barrier(group=_SLOW_BARRIER_GROUP)


@contextlib.contextmanager
def torch_distributed_zero_first(local_rank: int) -> Iterator[None]:
    """Run the block on local rank 0 first; the other ranks enter it once local rank 0 has left it."""
    active = local_rank != -1 and dist.is_available() and dist.is_initialized()
    if active and local_rank != 0:
        slow_barrier()
    yield
    if active and local_rank == 0:
        slow_barrier()


def de_parallel(model: nn.Module) -> nn.Module:
    """The bare model inside a DataParallel/DistributedDataParallel wrapper."""
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) else model


def fuse_conv_and_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A single Conv2d equal to ``bn(conv(x))`` in eval mode."""
    fused = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=True,
    ).to(conv.weight.device)
    scale = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    fused.weight.data.copy_(conv.weight.detach() * scale.view(-1, 1, 1, 1))
    conv_bias = conv.bias.detach() if conv.bias is not None else torch.zeros_like(bn.running_mean)
    fused.bias.data.copy_(bn.bias.detach() + (conv_bias - bn.running_mean) * scale)
    fused.requires_grad_(False)
    return fused


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


def parameter_groups(model: nn.Module) -> tuple[list, list, list]:
    """Split parameters into (weights with decay, normalisation weights without decay, biases without decay)."""
    decay, norm_weights, biases = [], [], []
    norm_types = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias":
                biases.append(p)
            elif isinstance(module, norm_types):
                norm_weights.append(p)
            else:
                decay.append(p)
    return decay, norm_weights, biases


def build_optimizer(
    model: nn.Module, name: str = "SGD", lr: float = 0.01, momentum: float = 0.937, decay: float = 5e-4
) -> torch.optim.Optimizer:
    """SGD (Nesterov), Adam or AdamW over three groups; weight decay only on conv/linear weights."""
    weights, norm_weights, biases = parameter_groups(model)
    if name == "Adam":
        optimizer = torch.optim.Adam(biases, lr=lr, betas=(momentum, 0.999))
    elif name == "AdamW":
        optimizer = torch.optim.AdamW(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    elif name == "SGD":
        optimizer = torch.optim.SGD(biases, lr=lr, momentum=momentum, nesterov=True)
    else:
        raise UserError(f"--optimizer {name} is not known: use SGD, Adam or AdamW")
    optimizer.add_param_group({"params": weights, "weight_decay": decay})
    optimizer.add_param_group({"params": norm_weights, "weight_decay": 0.0})
    LOGGER.info(
        f"optimizer: {name}(lr={lr}) with parameter groups {len(norm_weights)} weight(decay=0.0), "
        f"{len(weights)} weight(decay={decay}), {len(biases)} bias"
    )
    return optimizer


class ModelEMA:
    """Exponential moving average of a model's state; the decay ramps up over the first updates."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0, updates: int = 0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay_max = decay
        self.tau = tau
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def decay(self) -> float:
        return self.decay_max * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay()
        model_state = de_parallel(model).state_dict()
        for name, value in self.ema.state_dict().items():
            if value.dtype.is_floating_point:
                value.mul_(d).add_(model_state[name].detach(), alpha=1 - d)

    def update_attributes(self, model: nn.Module, names: tuple[str, ...] = ("nc", "names", "hyp")) -> None:
        src = de_parallel(model)
        for name in names:
            if hasattr(src, name):
                setattr(self.ema, name, getattr(src, name))
