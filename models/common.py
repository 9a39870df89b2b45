"""Building blocks shared by all families: Conv (Conv2d + BN + SiLU), Bottleneck, C3, SPPF, Concat; BN folding.

The blocks only the anchor-free families use (C2f, C3k2, attention, ...) live in models/blocks.py.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F


def same_padding(kernel: int | list[int], padding: int | None = None, dilation: int = 1) -> int | list[int]:
    """Padding that keeps the spatial size for stride 1 ('same'), unless given explicitly."""
    if padding is not None:
        return padding
    if dilation > 1:
        kernel = dilation * (kernel - 1) + 1 if isinstance(kernel, int) else [dilation * (k - 1) + 1 for k in kernel]
    return kernel // 2 if isinstance(kernel, int) else [k // 2 for k in kernel]


class Conv(nn.Module):
    """Conv2d without bias, BatchNorm, SiLU. After ``Model.fuse()`` the BN is folded into the conv."""

    def __init__(
        self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, g: int = 1, d: int = 1, act: bool = True
    ):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, cast(int, same_padding(k, p, d)), groups=g, dilation=d, bias=False)
        # BN settings of the published YOLOv5 models (eps 1e-3, momentum 0.03).
        self.bn: nn.Module = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)  # nn.Identity once fused
        # Not in place when training: autograd would copy the input of an in-place SiLU for its backward anyway.
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if isinstance(self.act, nn.SiLU) and not (torch.is_grad_enabled() or torch.jit.is_tracing()):
            # Inference: SiLU overwrites the convolution's fresh output instead of allocating and writing another
            # tensor, which shows at batch 1 on a CPU in channels-last layout (docs/benchmarks.md, "The model at
            # inference"). Traces for export keep the plain op.
            return F.silu(y, inplace=True)
        return self.act(y)


class Bottleneck(nn.Module):
    """Two convs (kernels ``k``: 1x1 then 3x3 in YOLOv5), with a residual connection when the shapes allow it.

    The anchor-free families use 3x3 then 3x3 (``k=(3, 3)``).
    """

    def __init__(
        self, c1: int, c2: int, shortcut: bool = True, g: int = 1, e: float = 0.5, k: tuple[int, int] = (1, 3)
    ):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, k[0], 1)
        self.cv2 = Conv(hidden, c2, k[1], 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP block: a stack of Bottlenecks on one half of the channels, concatenated with a 1x1 shortcut."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(c1, hidden, 1, 1)
        self.cv3 = Conv(2 * hidden, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: ``n`` chained max-pools concatenated with their input.

    YOLOv5/v8/11 use it as (k=5, n=3) with SiLU after ``cv1``. YOLO26 leaves ``cv1`` unactivated
    (``cv1_act=False``) and adds the block's input to its output (``shortcut``, when the widths agree).
    """

    def __init__(self, c1: int, c2: int, k: int = 5, n: int = 3, shortcut: bool = False, cv1_act: bool = True):
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, 1, act=cv1_act)
        self.cv2 = Conv(hidden * (n + 1), c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.n = n
        self.add = shortcut and c1 == c2

    @classmethod
    def adjust_yaml_args(cls, args: list, *, scale: str | None, given: int) -> list:
        """[c1, c2, k, ...] of a YAML row: rows that give the pool count (YOLO26: [c2, k, n, shortcut], ``given``
        > 2 values) have an unactivated ``cv1``; shorter rows (YOLOv5/v8/11: [c2, k]) keep SiLU there."""
        if given <= 2:
            return args
        c1, c2, k, n, *rest = args
        return [c1, c2, k, n, rest[0] if rest else False, False]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [self.cv1(x)]
        for _ in range(self.n):
            pooled.append(self.m(pooled[-1]))
        y = self.cv2(torch.cat(pooled, 1))
        return x + y if self.add else y


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``."""

    def __init__(self, dimension: int = 1):
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)


def fuse_conv_and_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A single Conv2d equal to ``bn(conv(x))`` in eval mode, its weight in the memory format of ``conv``'s."""
    assert bn.running_mean is not None and bn.running_var is not None, "a BatchNorm without running statistics"
    fused = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        kernel_size=cast("tuple[int, int]", conv.kernel_size),  # torch types these as tuple[int, ...]
        stride=cast("tuple[int, int]", conv.stride),
        padding=cast("str | tuple[int, int]", conv.padding),
        dilation=cast("tuple[int, int]", conv.dilation),
        groups=conv.groups,
        bias=True,
    ).to(conv.weight.device)
    scale = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    # An elementwise product keeps the layout of conv.weight (channels-last stays channels-last).
    fused.weight = nn.Parameter(conv.weight.detach() * scale.view(-1, 1, 1, 1), requires_grad=False)
    conv_bias = conv.bias.detach() if conv.bias is not None else torch.zeros_like(bn.running_mean)
    fused.bias = nn.Parameter(bn.bias.detach() + (conv_bias - bn.running_mean) * scale, requires_grad=False)
    return fused
