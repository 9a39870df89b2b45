"""Mixed-precision policy: fp16 with a gradient scaler on CUDA, bf16 autocast on CPUs that support it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype | None  # autocast dtype; None runs in fp32
    reason: str

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16


def cpu_supports_bf16() -> bool:
    """True when oneDNN has native bf16 kernels on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(device: torch.device, requested: bool) -> Precision:
    if not requested:
        return Precision(None, "mixed precision off (--no-amp)")
    if device.type == "cuda":
        return Precision(torch.float16, "fp16 autocast with a gradient scaler on CUDA")
    if device.type == "cpu" and cpu_supports_bf16():
        return Precision(torch.bfloat16, "bf16 autocast on a CPU with native bf16")
    return Precision(None, f"fp32: no native bf16 on this {device.type.upper()}, mixed precision would be slower")


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    if not precision.enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.dtype)
