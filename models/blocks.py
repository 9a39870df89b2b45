"""Blocks of the anchor-free families: DWConv, C2f, C3k, C3k2, Attention, PSABlock, C2PSA; area attention and A2C2f.

Attribute names follow the published checkpoints (``cv1``, ``cv2``, ``m``, ``attn.qkv``, ``ffn.0``, ...) so that
their state_dicts load into these modules by name. Shapes, not code, come from Ultralytics' models.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.common import C3, Bottleneck, Conv


class DWConv(Conv):
    """Conv with one group per shared channel (depthwise when ``c1 == c2``)."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, d: int = 1, act: bool = True):
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), d=d, act=act)


class C2f(nn.Module):
    """CSP block with two halves: ``cv1`` splits, a chain of blocks grows from the second half, and ``cv2``
    mixes both halves with every block's output."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, g: int = 1, e: float = 0.5):
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, g, e=1.0, k=(3, 3)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = list(self.cv1(x).chunk(2, 1))
        for block in self.m:
            outputs.append(block(outputs[-1]))
        return self.cv2(torch.cat(outputs, 1))


class C3k(C3):
    """C3 whose inner bottlenecks are k x k then k x k (YOLOv5's C3 uses 1x1 then 3x3)."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5, k: int = 3):
        super().__init__(c1, c2, n, shortcut, g, e)
        hidden = int(c2 * e)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, g, e=1.0, k=(k, k)) for _ in range(n)))


class C3k2(C2f):
    """C2f wiring on ``c2 * e`` channels with one of three inner blocks per repeat:

    - plain: a 3x3/3x3 Bottleneck with half-width hidden layer;
    - ``c3k``: a C3k of two bottlenecks;
    - ``attn`` (YOLO26's last neck block): a Bottleneck followed by a PSABlock.
    """

    C3K_SCALES = ("m", "l", "x")  # scales at which every C3k2 uses C3k inner blocks, whatever the YAML says

    def __init__(
        self,
        c1: int,
        c2: int,
        n: int = 1,
        c3k: bool = False,
        e: float = 0.5,
        attn: bool = False,
        g: int = 1,
        shortcut: bool = True,
    ):
        super().__init__(c1, c2, n, shortcut, g, e)
        self.m = nn.ModuleList(self._inner_block(c3k, attn, g, shortcut) for _ in range(n))

    @classmethod
    def adjust_yaml_args(cls, args: list, *, scale: str | None, given: int) -> list:
        """[c1, c2, n, c3k, ...] of a YAML row at ``scale``: ``c3k`` forced on at the large scales."""
        if scale in cls.C3K_SCALES:
            args[3:4] = [True]
        return args

    def _inner_block(self, c3k: bool, attn: bool, g: int, shortcut: bool) -> nn.Module:
        c = self.c
        if attn:
            return nn.Sequential(
                Bottleneck(c, c, shortcut, g, k=(3, 3)), PSABlock(c, attn_ratio=0.5, num_heads=max(c // 64, 1))
            )
        if c3k:
            return C3k(c, c, 2, shortcut, g)
        return Bottleneck(c, c, shortcut, g, k=(3, 3))


class Attention(nn.Module):
    """Multi-head self-attention over the H*W positions of a feature map, plus a depthwise 3x3 positional term.

    ``qkv`` produces, per head, ``key_dim`` query rows, ``key_dim`` key rows and ``head_dim`` value rows, in that
    order (head-major), which is how the published weights are laid out.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.scale = self.key_dim**-0.5
        self.qkv = Conv(dim, dim + 2 * self.key_dim * num_heads, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, 1, g=dim, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        per_head = self.qkv(x).view(b, self.num_heads, 2 * self.key_dim + self.head_dim, h * w)
        q, k, v = per_head.split((self.key_dim, self.key_dim, self.head_dim), dim=2)
        # weights[b, head, i, j]: how much position i attends to position j.
        weights = ((q * self.scale).transpose(-2, -1) @ k).softmax(dim=-1)
        attended = (v @ weights.transpose(-2, -1)).view(b, c, h, w)
        return self.proj(attended + self.pe(v.reshape(b, c, h, w)))


class PSABlock(nn.Module):
    """Attention then a 1x1 feed-forward pair, each added to its input when ``shortcut``."""

    def __init__(self, c: int, attn_ratio: float = 0.5, num_heads: int = 4, shortcut: bool = True):
        super().__init__()
        self.attn = Attention(c, attn_ratio=attn_ratio, num_heads=num_heads)
        self.ffn = nn.Sequential(Conv(c, c * 2, 1), Conv(c * 2, c, 1, act=False))
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """``cv1`` splits the input in two halves; ``n`` PSABlocks refine the second; ``cv2`` joins them again."""

    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5):
        super().__init__()
        if c1 != c2:
            raise ValueError(f"C2PSA keeps its width: input {c1} and output {c2} channels differ")
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        self.m = nn.Sequential(*(PSABlock(self.c, attn_ratio=0.5, num_heads=max(self.c // 64, 1)) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).split((self.c, self.c), dim=1)
        return self.cv2(torch.cat((a, self.m(b)), 1))


class AreaAttention(nn.Module):
    """Multi-head self-attention within areas: the H*W positions, in row-major order, are cut into ``area``
    consecutive runs of equal length, and each attends only within its own run (YOLO12's "area attention"; 4 runs
    at P4, i.e. horizontal bands, 1 at P5). A 7x7 depthwise conv of the values adds a positional term.

    ``qkv`` produces, per head, ``head_dim`` query, key and value rows in that order (head-major), which is how
    the published weights are laid out. H*W must divide by ``area``: true at P4 for inputs that are multiples of 32.
    """

    def __init__(self, dim: int, num_heads: int, area: int = 1):
        super().__init__()
        self.area = area
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        inner = self.head_dim * num_heads
        self.qkv = Conv(dim, 3 * inner, 1, act=False)
        self.proj = Conv(inner, dim, 1, act=False)
        self.pe = Conv(inner, inner, 7, 1, 3, g=inner, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        if (h * w) % self.area:
            raise ValueError(f"area attention: a {h}x{w} feature map does not split into {self.area} equal areas")
        runs, length = b * self.area, h * w // self.area
        tokens = self.qkv(x).flatten(2).transpose(1, 2).reshape(runs, length, -1)  # (runs, length, 3 * inner)
        per_head = tokens.view(runs, length, self.num_heads, 3 * self.head_dim).permute(0, 2, 3, 1)
        q, k, v = per_head.split(self.head_dim, dim=2)  # (runs, heads, head_dim, length) each
        # weights[r, head, i, j]: how much position i of a run attends to its position j.
        weights = ((q * self.scale).transpose(-2, -1) @ k).softmax(dim=-1)
        attended = v @ weights.transpose(-2, -1)
        return self.proj(self._as_map(attended, b, h, w) + self.pe(self._as_map(v, b, h, w)))

    @staticmethod
    def _as_map(t: torch.Tensor, b: int, h: int, w: int) -> torch.Tensor:
        """(runs, heads, head_dim, length) -> (b, heads * head_dim, h, w): the runs laid back in row-major order."""
        return t.permute(0, 3, 1, 2).reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous()


class AreaAttentionBlock(nn.Module):
    """Area attention then a 1x1 feed-forward pair (hidden width ``mlp_ratio`` times), each added to its input.

    Its convolutions start from a normal distribution of std 0.02 (truncated at +/-2), as YOLO12's do."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 1.2, area: int = 1):
        super().__init__()
        self.attn = AreaAttention(dim, num_heads=num_heads, area=area)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(Conv(dim, hidden, 1), Conv(hidden, dim, 1, act=False))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.trunc_normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class A2C2f(nn.Module):
    """YOLO12's block: ``cv1`` narrows to ``c2 * e`` channels, a chain of ``n`` inner blocks grows from it and
    ``cv2`` mixes all their outputs. Inner blocks: two area-attention blocks (``a2``; heads of 32 channels), or a
    C3k. With ``residual`` (attention at scales l and x) the input is added back, the block's output scaled by a
    learnt per-channel ``gamma`` starting at 0.01."""

    RESIDUAL_SCALES = ("l", "x")  # scales whose attention blocks are residual, with a narrower feed-forward (1.2)

    def __init__(
        self,
        c1: int,
        c2: int,
        n: int = 1,
        a2: bool = True,
        area: int = 1,
        residual: bool = False,
        mlp_ratio: float = 2.0,
        e: float = 0.5,
        g: int = 1,
        shortcut: bool = True,
    ):
        super().__init__()
        hidden = int(c2 * e)
        if hidden % 32:
            raise ValueError(f"A2C2f: {hidden} hidden channels (c2 {c2} x e {e}) do not make heads of 32 channels")
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv((1 + n) * hidden, c2, 1)
        self.gamma = nn.Parameter(torch.full((c2,), 0.01)) if a2 and residual else None
        self.m = nn.ModuleList(
            nn.Sequential(*(AreaAttentionBlock(hidden, hidden // 32, mlp_ratio, area) for _ in range(2)))
            if a2
            else C3k(hidden, hidden, 2, shortcut, g)
            for _ in range(n)
        )

    @classmethod
    def adjust_yaml_args(cls, args: list, *, scale: str | None, given: int) -> list:
        """[c1, c2, n, a2, area] of a YAML row; at the large scales residual attention with mlp_ratio 1.2."""
        return [*args, True, 1.2] if scale in cls.RESIDUAL_SCALES else args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [self.cv1(x)]
        for block in self.m:
            outputs.append(block(outputs[-1]))
        y = self.cv2(torch.cat(outputs, 1))
        return x + self.gamma.view(1, -1, 1, 1) * y if self.gamma is not None else y
