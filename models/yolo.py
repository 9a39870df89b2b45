"""Detectors built from a YAML description, through an explicit registry of blocks.

Two YAML forms are read: YOLOv5's (``depth_multiple``/``width_multiple``, ``anchors``, anchor-based ``Detect``) and
Ultralytics' later form (a ``scales`` table of [depth, width, max_channels] per scale letter, the letter taken from
the file name, e.g. ``yolo11n.yaml`` -> ``yolo11.yaml`` at scale n), whose ``Detect`` is the anchor-free head.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script (python models/yolo.py): make the repository importable, as `python -m models.yolo` does.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.anchor_free import AnchorFreeDetect
from models.blocks import C2PSA, C2f, C3k2, DWConv
from models.families import family_name
from models.common import C3, SPPF, Bottleneck, Concat, Conv, fuse_conv_and_bn
from models.summary import model_info
from utils.errors import UserError
from utils.log import LOGGER


class Detect(nn.Module):
    """Detection head: a 1x1 conv per level predicting (x, y, w, h, obj, classes) for each anchor."""

    def __init__(self, nc: int = 80, anchors: list | tuple = (), ch: list[int] | tuple[int, ...] = ()):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        # Anchors in pixels until Model divides them by the strides; registered so they move with .to() and
        # are saved and broadcast with the weights.
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32).view(self.nl, -1, 2))
        self.register_buffer("stride", torch.zeros(self.nl))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self._grid_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

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
        wh = (y[..., 2:4] * 2) ** 2 * anchor_grid
        return torch.cat((xy, wh, y[..., 4:]), -1).reshape(bs, -1, self.no)

    def _grids(self, level: int, nx: int, ny: int, device: torch.device, dtype: torch.dtype):
        # The anchors' version counter changes with every in-place edit (AutoAnchor, EMA, loading weights),
        # and reading it does not wait for the device.
        key = (level, nx, ny, device, dtype, self.anchors.data_ptr(), self.anchors._version)
        if key not in self._grid_cache:
            # arange in fp32, then cast: the ONNX exporter cannot infer a Range of fp16 (an --half export fails).
            ys, xs = torch.meshgrid(torch.arange(ny, device=device, dtype=torch.float32).to(dtype),
                                    torch.arange(nx, device=device, dtype=torch.float32).to(dtype), indexing="ij")
            grid = torch.stack((xs, ys), 2).view(1, 1, ny, nx, 2) - 0.5
            anchor_grid = (self.anchors[level] * self.stride[level]).view(1, self.na, 1, 1, 2).to(dtype)
            self._grid_cache = {k: v for k, v in self._grid_cache.items() if k[0] != level}
            self._grid_cache[key] = (grid, anchor_grid)
        return self._grid_cache[key]


# Names a model YAML may use for its blocks. YAMLs are data: they are never passed to eval/exec. "Detect" is
# YOLOv5's anchor head in a config with ``anchors`` and the anchor-free head otherwise.
MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv,
    "DWConv": DWConv,
    "Bottleneck": Bottleneck,
    "C3": C3,
    "C2f": C2f,
    "C3k2": C3k2,
    "SPPF": SPPF,
    "C2PSA": C2PSA,
    "Concat": Concat,
    "Detect": Detect,
    "Upsample": nn.Upsample,
    "nn.Upsample": nn.Upsample,
    "BatchNorm2d": nn.BatchNorm2d,
    "nn.BatchNorm2d": nn.BatchNorm2d,
}
_CHANNEL_BLOCKS = (Conv, DWConv, Bottleneck, C3, C2f, C3k2, SPPF, C2PSA)
_REPEATED_INSIDE = (C3, C2f, C3k2, C2PSA)  # blocks that take the repeat count as an argument
_FORCED_C3K_SCALES = ("m", "l", "x")  # C3k2 uses C3k inner blocks at these scales whatever the YAML says
# A scale letter after the family's number: yolov8n, yolo11s, yolo26x. Files that exist (yolov5n.yaml, yolov5n6.yaml)
# are read as they are; the letter only matters for a config with a ``scales`` table.
_SCALED_NAME = re.compile(r"^(yolo(?:v)?\d+)([nslmx])(.*)$")


def make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


def _resolve_arg(arg: Any, nc: int, anchors: Any) -> Any:
    """Resolve the symbolic names a YAML argument may use, without evaluating anything."""
    if isinstance(arg, str):
        symbols = {"nc": nc, "anchors": anchors, "None": None, "True": True, "False": False}
        return symbols.get(arg, arg)
    return arg


def _scaling(cfg: dict) -> tuple[float, float, float, str | None]:
    """(depth, width, max_channels, scale letter) of a config in either YAML form."""
    scales = cfg.get("scales")
    if not scales:
        return cfg.get("depth_multiple", 1.0), cfg.get("width_multiple", 1.0), float("inf"), None
    scale = cfg.get("scale")
    if not scale:
        scale = next(iter(scales))
        LOGGER.warning(f"{cfg.get('yaml_file', 'model config')}: no model scale given (e.g. yolo11n.yaml for "
                       f"scale n); using scale '{scale}'")
    if scale not in scales:
        raise UserError(f"{cfg.get('yaml_file', 'model config')}: scale '{scale}' is not among its scales "
                        f"{', '.join(map(str, scales))}")
    depth, width, max_channels = scales[scale]
    return depth, width, max_channels, scale


def parse_model(cfg: dict, ch: int) -> tuple[nn.Sequential, list[int]]:
    """Build the layers described by ``cfg`` and the sorted indices of the outputs later layers reuse."""
    nc, anchors = cfg["nc"], cfg.get("anchors")
    depth, width, max_channels, scale = _scaling(cfg)
    anchor_based = anchors is not None
    if anchor_based:
        na = (len(anchors[0]) // 2) if isinstance(anchors, list) else anchors
        no = na * (nc + 5)
    else:
        no = None
    # YOLOv8's head keeps full 3x3 convs in its class branch; configs with the newer blocks use depthwise ones.
    legacy_head = not any(row[2] == "C3k2" for row in cfg["backbone"] + cfg["head"])

    channels = [ch]
    layers, save = [], []
    LOGGER.debug(f"{'':>3}{'from':>18}{'n':>3}{'params':>10}  {'module':<24}{'arguments':<30}")
    for i, (source, repeats, name, args) in enumerate(cfg["backbone"] + cfg["head"]):
        if name not in MODULES:
            raise UserError(f"model YAML layer {i}: unknown module '{name}'; known modules: {', '.join(MODULES)}")
        block = MODULES[name]
        args = [_resolve_arg(a, nc, anchors) for a in args]
        repeats = max(round(repeats * depth), 1) if repeats > 1 else repeats
        yaml_arg_count = len(args)

        if block in _CHANNEL_BLOCKS:
            if not args or isinstance(args[0], bool) or not isinstance(args[0], (int, float)):
                raise UserError(f"model YAML layer {i} ({name}): the first argument must be a channel count, "
                                f"got {args[0] if args else 'nothing'!r}")
            c_in, c_out = channels[source], args[0]
            if c_out != no:
                c_out = make_divisible(min(c_out, max_channels) * width, 8)
            args = [c_in, c_out, *args[1:]]
            if block in _REPEATED_INSIDE:
                args.insert(2, repeats)
                repeats = 1
            if block is C3k2 and scale in _FORCED_C3K_SCALES:
                args[3:4] = [True]
            if block is SPPF and yaml_arg_count > 2:
                # Rows that give the pool count (YOLO26: [c2, k, n, shortcut]) have an unactivated cv1;
                # shorter rows (YOLOv5/v8/11: [c2, k]) keep SiLU there.
                c1, c2, k, n, *rest = args
                args = [c1, c2, k, n, rest[0] if rest else False, False]
        elif block is nn.BatchNorm2d:
            args = [channels[source]]
            c_out = channels[source]
        elif block is Concat:
            c_out = sum(channels[s] for s in source)
        elif block is Detect and anchor_based:
            args.append([channels[s] for s in source])
            if isinstance(args[1], int):  # a number of anchors per level instead of their sizes
                args[1] = [list(range(args[1] * 2))] * len(source)
            c_out = channels[source[-1]]
        elif block is Detect:
            block = AnchorFreeDetect
            args = [args[0], cfg.get("reg_max", 16), bool(cfg.get("end2end", False)),
                    [channels[s] for s in source], legacy_head, cfg.get("head_class_width")]
            c_out = channels[source[-1]]
        else:
            c_out = channels[source]

        try:
            module = nn.Sequential(*(block(*args) for _ in range(repeats))) if repeats > 1 else block(*args)
        except (TypeError, ValueError) as e:
            raise UserError(f"model YAML layer {i} ({name}): cannot build it from arguments {args} ({e})") from e
        module.layer_index, module.source = i, source  # used by Model.forward to route inputs
        n_params = sum(p.numel() for p in module.parameters())
        LOGGER.debug(f"{i:>3}{str(source):>18}{repeats:>3}{n_params:10.0f}  {name:<24}{str(args):<30}")
        save.extend(s % i for s in ([source] if isinstance(source, int) else source) if s != -1)
        layers.append(module)
        if i == 0:
            channels = []
        channels.append(c_out)
    return nn.Sequential(*layers), sorted(set(save))


def _config_path(cfg: str | Path) -> tuple[Path, str | None]:
    """The YAML file ``cfg`` names and the scale letter its name selects, if any.

    ``yolo11n.yaml`` (or ``models/yolo11n.yaml``) that does not exist resolves to ``yolo11.yaml`` at scale n;
    a name without a folder is also looked up in models/.
    """
    path = Path(cfg)
    candidates = [path]
    if not path.exists():
        candidates.append(Path(__file__).parent / path.name)
    match = _SCALED_NAME.match(path.stem)
    for candidate in candidates:
        if candidate.exists():
            return candidate, match.group(2) if match else None
    if match:
        unscaled = f"{match.group(1)}{match.group(3)}{path.suffix}"
        for candidate in (path.with_name(unscaled), Path(__file__).parent / unscaled):
            if candidate.exists():
                return candidate, match.group(2)
    raise UserError(f"{cfg}: model config not found")


def load_model_config(cfg: str | Path | dict) -> dict:
    """A model config as a dict, from a dict or a YAML path (safe loader).

    For a config with a ``scales`` table the scale letter of the file name is stored as ``scale`` (unless the
    file sets one), so the dict alone (as a checkpoint keeps it) rebuilds the same model.
    """
    if isinstance(cfg, dict):
        return deepcopy(cfg)
    path, scale = _config_path(cfg)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({e.__class__.__name__})") from e
    # Without ``anchors`` the config describes an anchor-free model.
    missing = [k for k in ("nc", "backbone", "head") if not isinstance(config, dict) or k not in config]
    if missing:
        raise UserError(f"{path}: model config lacks {', '.join(missing)}")
    if config.get("scales") and scale is not None and not config.get("scale"):
        config["scale"] = scale
    config["yaml_file"] = Path(cfg).name  # the name asked for: yolo11n.yaml, not yolo11.yaml
    return config


class Model(nn.Module):
    """A detector whose layers come from a YAML config; the last layer is a detection head (anchor-based Detect for
    YOLOv5, AnchorFreeDetect for YOLOv8/11/26)."""

    def __init__(self, cfg: str | Path | dict = "yolov5s.yaml", ch: int = 3, nc: int | None = None, anchors=None):
        super().__init__()
        self.yaml = load_model_config(cfg)
        # Ultralytics' configs name the input channels 'channels'.
        ch = self.yaml["ch"] = self.yaml.get("ch", self.yaml.get("channels", ch))
        if nc is not None and nc != self.yaml["nc"]:
            LOGGER.info(f"Overriding model YAML nc={self.yaml['nc']} with nc={nc}")
            self.yaml["nc"] = nc
        if anchors is not None and "anchors" in self.yaml:
            LOGGER.info(f"Overriding model YAML anchors with anchors={anchors}")
            self.yaml["anchors"] = round(anchors) if isinstance(anchors, float) else anchors
        self.model, self.save = parse_model(self.yaml, ch)
        self.nc = self.yaml["nc"]
        self.names = [str(i) for i in range(self.nc)]
        self.family = family_name(self.yaml)

        detect = self.model[-1]
        probe_size = 256
        if isinstance(detect, Detect):
            with torch.no_grad():
                outputs = self.forward(torch.zeros(1, ch, probe_size, probe_size))
            detect.stride.copy_(torch.tensor([probe_size / o.shape[-2] for o in outputs]))
            _check_anchor_order(detect)
            detect.anchors /= detect.stride.view(-1, 1, 1)
            self._initialize_detect_biases()
        elif isinstance(detect, AnchorFreeDetect):
            # In eval mode, so the probe leaves the BatchNorm statistics as they are.
            self.eval()
            with torch.no_grad():
                _, raw = self.forward(torch.zeros(1, ch, probe_size, probe_size))
            self.train()
            levels = raw["one2many"] if isinstance(raw, dict) else raw
            detect.stride.copy_(torch.tensor([probe_size / o.shape[-2] for o in levels]))
            detect.bias_init()
        else:
            raise UserError(f"{self.yaml.get('yaml_file', 'model config')}: the last layer must be Detect")

    def forward(self, x: torch.Tensor):
        cache: list[torch.Tensor | None] = []
        for module in self.model:
            if module.source != -1:
                src = module.source
                x = cache[src] if isinstance(src, int) else [x if j == -1 else cache[j] for j in src]
            x = module(x)
            cache.append(x if module.layer_index in self.save else None)
        return x

    def _initialize_detect_biases(self) -> None:
        """Start objectness near 8 objects per 640 image and classes near 0.6 / nc, so early losses are sane."""
        detect = self.model[-1]
        for conv, s in zip(detect.m, detect.stride):
            b = conv.bias.view(detect.na, -1)
            with torch.no_grad():
                b[:, 4] += math.log(8 / (640 / float(s)) ** 2)
                b[:, 5:5 + detect.nc] += math.log(0.6 / (detect.nc - 0.99999))

    def fuse(self) -> Model:
        """Fold every BatchNorm into its convolution (for inference); both YOLO26 heads stay."""
        for m in self.modules():
            if isinstance(m, Conv) and isinstance(m.bn, nn.BatchNorm2d):
                m.conv = fuse_conv_and_bn(m.conv, m.bn)
                m.bn = nn.Identity()
        return self

    def info(self, imgsz: int = 640) -> str:
        return model_info(self, imgsz)

    @property
    def stride(self) -> torch.Tensor:
        return self.model[-1].stride


def _check_anchor_order(detect: Detect) -> None:
    """Pixel anchors must grow with the stride; flip them if a config lists them the other way round."""
    area = detect.anchors.prod(-1).mean(-1).view(-1)
    if (area[-1] - area[0]).sign() != (detect.stride[-1] - detect.stride[0]).sign():
        LOGGER.info("Reversing anchor order to match the strides")
        detect.anchors[:] = detect.anchors.flip(0)


def build_model(cfg: str | Path | dict, *, nc: int | None = None, weights: dict[str, torch.Tensor] | None = None,
                transfer: bool = False, keep_anchors: bool = True, anchors: float | None = None,
                names: list[str] | None = None) -> Model:
    """The one way models are made: from a config, then loaded with ``weights`` if given.

    Without ``transfer`` every tensor of ``weights`` must match (resuming, evaluating a checkpoint). With it,
    each tensor whose name and shape fit is copied and the rest keep their initialisation (fine-tuning with
    another number of classes: the head's class outputs do not fit); the count is logged. An anchor-free head
    is then built with the source's class-branch width (``head_class_width``; its default depends on the class
    count), so only the class branch's last layer starts afresh. ``keep_anchors`` False leaves the config's
    anchors (AutoAnchor may then fit new ones).
    """
    config = load_model_config(cfg)
    if transfer and weights is not None and "head_class_width" not in config:
        width = _class_branch_width(weights)
        if width is not None:
            config["head_class_width"] = width
    model = Model(config, nc=nc, anchors=anchors)
    if weights is not None:
        if transfer:
            own = model.state_dict()
            fitting = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape
                       and (keep_anchors or not k.endswith(".anchors"))}
            model.load_state_dict(fitting, strict=False)
            LOGGER.info(f"Transferred {len(fitting)}/{len(own)} tensors")
        else:
            model.load_state_dict(weights)
    if names is not None:
        model.names = list(names)
    return model


def _class_branch_width(weights: dict[str, torch.Tensor]) -> int | None:
    """The hidden width of an anchor-free head's class branch in ``weights`` (input channels of its last layer)."""
    for key, tensor in weights.items():
        if key.endswith(".cv3.0.2.weight") and tensor.ndim == 4:
            return int(tensor.shape[1])
    return None


def main() -> None:
    from utils.log import setup_logging

    parser = argparse.ArgumentParser(description="Build a model from its YAML and print a summary")
    parser.add_argument("--cfg", default="yolov5s.yaml")
    parser.add_argument("--imgsz", type=int, default=640)
    opt = parser.parse_args()
    setup_logging()
    Model(opt.cfg).info(opt.imgsz)


if __name__ == "__main__":
    main()
