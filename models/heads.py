"""Detection heads: what every head gives the model that ends with it, and YOLOv5's anchor-based head.

A model YAML names its head ``Detect`` whatever its kind; the head classes decide which of them a config builds
(:meth:`DetectionHead.accepts`), what their constructor takes from the YAML row (:meth:`DetectionHead.yaml_args`)
and what they set once the model around them exists (:meth:`DetectionHead.setup`: strides, anchors in stride
units, the first biases). ``models.yolo.Model`` calls these and never asks which head it has. The anchor-free head
is in models/anchor_free.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn as nn

from utils.log import LOGGER

MAX_ANCHORS = 20  # per level: a model YAML asking for more is refused (YOLOv5 has 3)

PROBE_SIZE = 256  # the side of the blank image a head's strides are measured with


class DetectionHead(nn.Module):
    """The last layer of a detector built from a YAML (see the module docstring)."""

    stride: torch.Tensor  # (levels,) input pixels per cell of each output level, set by ``setup``

    @classmethod
    def accepts(cls, cfg: Mapping[str, Any]) -> bool:
        """Whether a ``Detect`` row of the model config ``cfg`` builds this head."""
        raise NotImplementedError

    @classmethod
    def yaml_args(cls, args: list, cfg: Mapping[str, Any], channels: list[int]) -> list:
        """Constructor arguments from the YAML row's ``args`` and the input channels of each level."""
        raise NotImplementedError

    def setup(self, model: nn.Module) -> None:
        """Finish the head inside ``model`` (all its layers built): strides and the first biases."""
        raise NotImplementedError

    @classmethod
    def fine_tune_config(cls, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Config keys that build this head in the shape of ``weights``' head where the class count alone would
        build it otherwise (fine-tuning to another number of classes); none by default."""
        return {}


def probe_input(model: nn.Module) -> torch.Tensor:
    """The blank image a head's strides are measured with: the model's input channels, ``PROBE_SIZE`` square."""
    cfg = cast("dict[str, Any]", model.yaml)  # nn.Module's attributes are untyped; Model sets this one
    return torch.zeros(1, cfg["ch"], PROBE_SIZE, PROBE_SIZE)


class Detect(DetectionHead):
    """YOLOv5's anchor-based head: a 1x1 conv per level predicting (x, y, w, h, obj, classes) for each anchor."""

    anchors: torch.Tensor  # buffers, registered in __init__
    stride: torch.Tensor

    def __init__(self, nc: int = 80, anchors: list | tuple = (), ch: list[int] | tuple[int, ...] = ()):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        # Anchors in pixels until setup() divides them by the strides; registered so they move with .to() and
        # are saved and broadcast with the weights.
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32).view(self.nl, -1, 2))
        self.register_buffer("stride", torch.zeros(self.nl))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self._grid_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def accepts(cls, cfg: Mapping[str, Any]) -> bool:
        return "anchors" in cfg

    @classmethod
    def yaml_args(cls, args: list, cfg: Mapping[str, Any], channels: list[int]) -> list:
        args = [*args, channels]
        if isinstance(args[1], int):  # a number of anchors per level instead of their sizes
            if not 1 <= args[1] <= MAX_ANCHORS:
                raise ValueError(f"{args[1]} anchors per level (1 to {MAX_ANCHORS})")
            args[1] = [list(range(args[1] * 2))] * len(channels)
        return args

    def setup(self, model: nn.Module) -> None:
        """Strides from a probe forward (in training mode, as YOLOv5 measures them), anchors in stride units,
        then the prior biases."""
        with torch.no_grad():
            outputs = model(probe_input(model))
        self.stride.copy_(torch.tensor([PROBE_SIZE / o.shape[-2] for o in outputs]))
        self._check_anchor_order()
        self.anchors /= self.stride.view(-1, 1, 1)
        self._initialize_biases()

    def _check_anchor_order(self) -> None:
        """Pixel anchors must grow with the stride; flip them if a config lists them the other way round."""
        area = self.anchors.prod(-1).mean(-1).view(-1)
        if (area[-1] - area[0]).sign() != (self.stride[-1] - self.stride[0]).sign():
            LOGGER.info("Reversing anchor order to match the strides")
            self.anchors[:] = self.anchors.flip(0)

    def _initialize_biases(self) -> None:
        """Start objectness near 8 objects per 640 image and classes near 0.6 / nc, so early losses are sane."""
        for conv, s in zip(self.m, self.stride):
            b = cast(torch.Tensor, conv.bias).view(self.na, -1)
            with torch.no_grad():
                b[:, 4] += math.log(8 / (640 / float(s)) ** 2)
                b[:, 5 : 5 + self.nc] += math.log(0.6 / (self.nc - 0.99999))

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        outputs = []
        for i in range(self.nl):
            bs, _, ny, nx = x[i].shape
            # (bs, na, ny, nx, no) as a view, not a copy: on channels-last activations the memory already
            # holds the values in that order, so neither forward nor backward copies them.
            y = self.m[i](x[i]).permute(0, 2, 3, 1).view(bs, ny, nx, self.na, self.no)
            outputs.append(y.permute(0, 3, 1, 2, 4))
        if self.training:
            return outputs
        decoded = [self._decode(i, p) for i, p in enumerate(outputs)]
        return torch.cat(decoded, 1), outputs

    def _decode(self, level: int, p: torch.Tensor) -> torch.Tensor:
        bs, _, ny, nx, _ = p.shape
        grid, anchor_grid = self._grids(level, nx, ny, p.device, p.dtype)
        y = p.sigmoid()
        xy = (y[..., :2] * 2 + grid) * self.stride[level]
        wh = y[..., 2:4] * 2
        wh = wh * wh * anchor_grid  # not ** 2: LiteRT's converter has no legal lowering of a float power
        return torch.cat((xy, wh, y[..., 4:]), -1).reshape(bs, -1, self.no)

    def _grids(
        self, level: int, nx: int, ny: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The anchors' version counter changes with every in-place edit (AutoAnchor, EMA, loading weights),
        # and reading it does not wait for the device.
        # Under torch.export (LiteRT's converter) the anchors are fake tensors, without storage: no cache then.
        tracing = torch.compiler.is_compiling()
        key: Any = None if tracing else (level, nx, ny, device, dtype, self.anchors.data_ptr(), self.anchors._version)
        if tracing or key not in self._grid_cache:
            # arange in fp32, then cast: the ONNX exporter cannot infer a Range of fp16 (an --half export fails).
            ys, xs = torch.meshgrid(
                torch.arange(ny, device=device, dtype=torch.float32).to(dtype),
                torch.arange(nx, device=device, dtype=torch.float32).to(dtype),
                indexing="ij",
            )
            grid = torch.stack((xs, ys), 2).view(1, 1, ny, nx, 2) - 0.5
            anchor_grid = (self.anchors[level] * self.stride[level]).view(1, self.na, 1, 1, 2).to(dtype)
            if tracing:
                return grid, anchor_grid
            self._grid_cache = {k: v for k, v in self._grid_cache.items() if k[0] != level}
            self._grid_cache[key] = (grid, anchor_grid)
        return self._grid_cache[key]


def head_for(name: str, cfg: Mapping[str, Any], heads: Sequence[type[DetectionHead]]) -> type[DetectionHead]:
    """The head a ``name`` row of ``cfg`` builds: the first of ``heads`` that accepts the config."""
    for head in heads:
        if head.accepts(cfg):
            return head
    raise ValueError(f"no {name} head fits this model config")
