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
from typing import Any, NamedTuple, cast

import torch
import torch.nn as nn
import yaml

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script (python models/yolo.py): make the repository importable, as `python -m models.yolo` does.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.anchor_free import AnchorFreeDetect
from models.blocks import C2PSA, A2C2f, C2f, C3k2, DWConv
from models.common import C3, SPPF, Bottleneck, Concat, Conv, fuse_conv_and_bn
from models.heads import MAX_ANCHORS, Detect, DetectionHead, head_for
from models.summary import model_info
from utils.errors import UserError, describe, first_line
from utils.log import LOGGER
from utils.yaml_reader import load_yaml

# Names a model YAML may use for its blocks. YAMLs are data: they are never passed to eval/exec.
MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv,
    "DWConv": DWConv,
    "Bottleneck": Bottleneck,
    "C3": C3,
    "C2f": C2f,
    "C3k2": C3k2,
    "SPPF": SPPF,
    "C2PSA": C2PSA,
    "A2C2f": A2C2f,
    "Concat": Concat,
    "Upsample": nn.Upsample,
    "nn.Upsample": nn.Upsample,
    "BatchNorm2d": nn.BatchNorm2d,
    "nn.BatchNorm2d": nn.BatchNorm2d,
}
# Heads a YAML may name; of several under one name, the first whose ``accepts`` takes the config is built.
HEADS: dict[str, tuple[type[DetectionHead], ...]] = {"Detect": (Detect, AnchorFreeDetect)}
_CHANNEL_BLOCKS = (Conv, DWConv, Bottleneck, C3, C2f, C3k2, SPPF, C2PSA, A2C2f)
_REPEATED_INSIDE = (C3, C2f, C3k2, C2PSA, A2C2f)  # blocks that take the repeat count as an argument
# A scale letter after the model's number: yolov8n, yolo11s, yolo26x. Files that exist (yolov5n.yaml,
# yolov5n6.yaml) are read as they are; the letter only matters for a config with a ``scales`` table.
_SCALED_NAME = re.compile(r"^(\D*\d+)([nslmx])(.*)$")

# What a model config (a YAML file, or the dict a checkpoint stores) may ask for, checked before anything is
# allocated: a config asking for 64 times the width or ten million classes is refused in one line instead of taking
# the machine's memory. Each bound is well above every published YOLO (at most about 140 million parameters, 1280
# channels, 12 repeats, 80 to a few thousand classes).
MAX_PARAMETERS = 300_000_000  # 1.2 GB of fp32 weights
MAX_CHANNELS = 4096  # per layer: the strides are measured by a forward pass, whose activations this bounds
# MAX_ANCHORS (per level) lives with the anchor-based head that reads the count: models/heads.py
MAX_CLASSES = 100_000
MAX_INPUT_CHANNELS = 64
MAX_REPEATS = 100
MAX_LAYERS = 1000
MAX_UPSAMPLING = 16
MAX_KERNEL = 15  # a Conv's or SPPF's kernel: the forward pass's cost grows with its square
# A layer whose repeats times its largest size argument squared is below this is built directly (a block holds a few
# tens of times that square in parameters at most); above it, its parameters are counted first on the meta device
# (shapes without memory), so the bound holds before any allocation.
_PROBE_ABOVE = 4 * 2**20


def make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


def _resolve_arg(arg: Any, nc: int, anchors: Any) -> Any:
    """Resolve the symbolic names a YAML argument may use, without evaluating anything."""
    if isinstance(arg, str):
        symbols = {"nc": nc, "anchors": anchors, "None": None, "True": True, "False": False}
        return symbols.get(arg, arg)
    return arg


def _number(value: Any, what: str, where: str, low: float, high: float) -> float:
    """``value`` as a finite number in (low, high], else one line naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low < value <= high
    if not ok or not math.isfinite(value):
        raise UserError(f"{where}: {what} must be a number in ({low:g}, {high:g}], got {value!r}")
    return value


def _anchors_ok(anchors: Any) -> bool:
    if anchors is None:
        return True
    if isinstance(anchors, int) and not isinstance(anchors, bool):
        return 1 <= anchors <= MAX_ANCHORS
    if not isinstance(anchors, list) or not 1 <= len(anchors) <= 8 or not isinstance(anchors[0], list):
        return False
    pairs = len(anchors[0])
    return (
        2 <= pairs <= 2 * MAX_ANCHORS
        and pairs % 2 == 0
        and all(
            isinstance(level, list)
            and len(level) == pairs
            and all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < a < 1e5 for a in level)
            for level in anchors
        )
    )


def check_config(cfg: dict, ch: Any) -> None:
    """Refuse, in one line, a config whose sizes are out of every sane bound or whose rows are malformed, before
    anything is built (rows' own arguments are checked as each is built)."""
    where = str(cfg.get("yaml_file", "model config"))
    nc = cfg.get("nc")
    if not isinstance(nc, int) or isinstance(nc, bool) or not 1 <= nc <= MAX_CLASSES:
        raise UserError(f"{where}: nc must be a whole number of classes from 1 to {MAX_CLASSES}, got {nc!r}")
    if not isinstance(ch, int) or isinstance(ch, bool) or not 1 <= ch <= MAX_INPUT_CHANNELS:
        raise UserError(f"{where}: the input channels must be from 1 to {MAX_INPUT_CHANNELS}, got {ch!r}")
    if not _anchors_ok(cfg.get("anchors")):
        raise UserError(
            f"{where}: anchors must be a count per level (1 to {MAX_ANCHORS}) or one list per level of "
            f"positive (width, height) pairs, as many on each level, got {cfg.get('anchors')!r}"[:300]
        )
    backbone, head = cfg.get("backbone"), cfg.get("head")
    if not isinstance(backbone, list) or not isinstance(head, list) or not 1 <= len(backbone) + len(head) <= MAX_LAYERS:
        raise UserError(f"{where}: backbone and head must be lists of at most {MAX_LAYERS} layers in all")
    for i, row in enumerate(backbone + head):
        ok = isinstance(row, (list, tuple)) and len(row) == 4 and isinstance(row[2], str)
        ok = ok and isinstance(row[3], list) and isinstance(row[1], int) and not isinstance(row[1], bool)
        sources = row[0] if ok and isinstance(row[0], list) else [row[0] if ok else None]
        ok = ok and 1 <= row[1] <= MAX_REPEATS and bool(sources)
        # -1 is the previous layer (the input image for layer 0, which has no other to name)
        ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and (-i <= s < i or s == -1) for s in sources)
        if not ok:
            raise UserError(
                f"{where}: layer {i} must be [from, repeats (1 to {MAX_REPEATS}), module, [args]] with 'from' "
                f"naming earlier layers, got {row!r}"[:300]
            )


def _scaling(cfg: dict) -> tuple[float, float, float, str | None]:
    """(depth, width, max_channels, scale letter) of a config in either YAML form, each checked to be sane."""
    where = str(cfg.get("yaml_file", "model config"))
    scales = cfg.get("scales")
    if not scales:
        depth = _number(cfg.get("depth_multiple", 1.0), "depth_multiple", where, 0, 10)
        return depth, _number(cfg.get("width_multiple", 1.0), "width_multiple", where, 0, 10), float("inf"), None
    if not isinstance(scales, dict):
        raise UserError(f"{where}: scales must be a table of [depth, width, max_channels] per scale letter")
    scale = cfg.get("scale")
    if not scale:
        scale = next(iter(scales))
        LOGGER.warning(
            f"{cfg.get('yaml_file', 'model config')}: no model scale given (e.g. yolo11n.yaml for "
            f"scale n); using scale '{scale}'"
        )
    if not isinstance(scale, str) or scale not in scales:
        raise UserError(
            f"{cfg.get('yaml_file', 'model config')}: scale '{scale}' is not among its scales "
            f"{', '.join(map(str, scales))}"
        )
    row = scales[scale]
    if not isinstance(row, (list, tuple)) or len(row) != 3:
        raise UserError(f"{where}: scale '{scale}' must be [depth, width, max_channels], got {row!r}")
    depth = _number(row[0], f"scale '{scale}' depth", where, 0, 10)
    width = _number(row[1], f"scale '{scale}' width", where, 0, 10)
    return depth, width, _number(row[2], f"scale '{scale}' max_channels", where, 0, MAX_CHANNELS * 16), scale


def _layer_args(
    block: type[nn.Module], args: list, where: str, *, channels: list[int], source: Any, repeats: int, scaling: Scaling
) -> tuple[list, int, int]:
    """(constructor arguments, output channels, repeats left to stack) of one YAML row's ``block``."""
    if block in _CHANNEL_BLOCKS:
        if not args or isinstance(args[0], bool) or not isinstance(args[0], (int, float)):
            raise UserError(
                f"{where}: the first argument must be a channel count, got {args[0] if args else 'nothing'!r}"
            )
        c_in, c_out = channels[source], args[0]
        if block in (Conv, DWConv, SPPF) and len(args) > 1 and isinstance(args[1], int) and args[1] > MAX_KERNEL:
            raise UserError(f"{where}: kernel {args[1]} (at most {MAX_KERNEL})")
        if c_out != scaling.head_outputs:
            c_out = make_divisible(min(c_out, scaling.max_channels) * scaling.width, 8)
        built = [c_in, c_out, *args[1:]]
        if block in _REPEATED_INSIDE:
            built.insert(2, repeats)
            repeats = 1
        adjust = getattr(block, "adjust_yaml_args", None)  # a block's own rules for its YAML rows
        if adjust is not None:
            built = adjust(built, scale=scaling.scale, given=len(args))
        return built, int(c_out), repeats
    if block is nn.BatchNorm2d:
        return [channels[source]], channels[source], repeats
    if block is Concat:
        return args, sum(channels[s] for s in source), repeats
    return args, channels[source], repeats


class Scaling(NamedTuple):
    """How a config's rows scale: depth and width multiples, the channel cap, the scale letter, and the output
    channels of an anchor head (YOLOv5 leaves a layer of that width unscaled)."""

    depth: float
    width: float
    max_channels: float
    scale: str | None
    head_outputs: int | None


def parse_model(cfg: dict, ch: int) -> tuple[nn.Sequential, list[int]]:
    """Build the layers described by ``cfg`` and the sorted indices of the outputs later layers reuse."""
    check_config(cfg, ch)
    nc, anchors = cfg["nc"], cfg.get("anchors")
    na = None if anchors is None else (len(anchors[0]) // 2) if isinstance(anchors, list) else anchors
    scaling = Scaling(*_scaling(cfg), head_outputs=None if na is None else na * (nc + 5))

    channels = [ch]
    layers: list[nn.Module] = []
    save: list[int] = []
    total = 0
    LOGGER.debug(f"{'':>3}{'from':>18}{'n':>3}{'params':>10}  {'module':<24}{'arguments':<30}")
    for i, (source, repeats, name, args) in enumerate(cfg["backbone"] + cfg["head"]):
        where = f"model YAML layer {i} ({name})"
        args = [_resolve_arg(a, nc, anchors) for a in args]
        repeats = max(round(repeats * scaling.depth), 1) if repeats > 1 else repeats
        block: type[Any]
        if name not in HEADS and name not in MODULES:
            raise UserError(
                f"model YAML layer {i}: unknown module '{name}'; known modules: {', '.join([*MODULES, *HEADS])}"
            )
        module: Any  # a block, with the routing attributes Model.forward reads
        try:
            if name in HEADS:
                block = head_for(name, cfg, HEADS[name])
                args, c_out = block.yaml_args(args, cfg, [channels[s] for s in source]), channels[source[-1]]
            else:
                block = MODULES[name]
                args, c_out, repeats = _layer_args(
                    block, args, where, channels=channels, source=source, repeats=repeats, scaling=scaling
                )
        except (TypeError, ValueError, IndexError, KeyError, OverflowError) as e:  # the row's own values
            raise UserError(f"{where}: its arguments {args} do not fit ({describe(e)})"[:400]) from e
        if not 1 <= c_out <= MAX_CHANNELS:
            raise UserError(f"{where}: {c_out} output channels (at most {MAX_CHANNELS})")
        module, n_params = _build_layer(block, args, repeats, where, MAX_PARAMETERS - total)
        total += n_params
        module.layer_index, module.source = i, source  # used by Model.forward to route inputs
        LOGGER.debug(f"{i:>3}{str(source):>18}{repeats:>3}{n_params:10.0f}  {name:<24}{str(args):<30}")
        save.extend(s % i for s in ([source] if isinstance(source, int) else source) if s != -1)
        layers.append(module)
        if i == 0:
            channels = []
        channels.append(c_out)
    return nn.Sequential(*layers), sorted(set(save))


def _largest_size(args: Any) -> int:
    """The largest whole number among a row's (possibly nested) arguments: what its size grows with."""
    if isinstance(args, (list, tuple)):
        return max((_largest_size(a) for a in args), default=0)
    return abs(args) if isinstance(args, int) and not isinstance(args, bool) else 0


def _build_layer(block: type[nn.Module], args: list, repeats: int, where: str, budget: int) -> tuple[nn.Module, int]:
    """One YAML row's module and its parameter count; refused in one line when it would hold more than ``budget``
    parameters (counted on the meta device first when it may be large) or its arguments do not fit the block."""

    def make() -> nn.Module:
        return nn.Sequential(*(block(*args) for _ in range(repeats))) if repeats > 1 else block(*args)

    try:
        if block is nn.Upsample and _largest_size(args) > MAX_UPSAMPLING:
            raise ValueError(f"upsampling by more than {MAX_UPSAMPLING}")
        if repeats * _largest_size(args) ** 2 > _PROBE_ABOVE:
            with torch.device("meta"):
                n_params = sum(p.numel() for p in make().parameters())
            if n_params > budget:
                raise UserError(
                    f"{where}: the model would hold over {MAX_PARAMETERS:,} parameters (this layer alone "
                    f"{n_params:,}); check its sizes (nc, width_multiple, channels)"
                )
        module = make()
    except (TypeError, ValueError, OverflowError, RuntimeError, IndexError, KeyError, ZeroDivisionError) as e:
        raise UserError(f"{where}: cannot build it from arguments {args} ({first_line(e)})"[:400]) from e
    n_params = sum(p.numel() for p in module.parameters())
    if n_params > budget:
        raise UserError(f"{where}: the model would hold over {MAX_PARAMETERS:,} parameters; check its sizes")
    return module, n_params


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
        config = load_yaml(path.read_text(encoding="utf-8"), "a model YAML")
    except (yaml.YAMLError, ValueError, OSError, RecursionError) as e:  # ValueError: a 5000-digit integer, bad UTF-8
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
    """A detector whose layers come from a YAML config; the last layer is a detection head (models/heads.py), which
    finishes itself once the model is built (its strides, anchors and first biases)."""

    model: nn.Sequential
    save: list[int]

    def __init__(
        self, cfg: str | Path | dict = "yolov5s.yaml", ch: int = 3, nc: int | None = None, anchors: Any = None
    ):
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
        head = self.model[-1]
        where = self.yaml.get("yaml_file", "model config")
        if not isinstance(head, DetectionHead):
            raise UserError(f"{where}: the last layer must be Detect")
        try:
            head.setup(self)  # a forward pass: layers whose sizes do not fit each other fail here
        except (RuntimeError, ValueError, TypeError, IndexError, ZeroDivisionError) as e:
            raise UserError(f"{where}: its layers do not fit together ({describe(e)})"[:400]) from e

    def forward(self, x: torch.Tensor | list[Any]) -> Any:
        cache: list[Any] = []
        for module in self.model:
            if module.source != -1:
                src: Any = module.source
                x = cache[src] if isinstance(src, int) else [x if j == -1 else cache[j] for j in src]
            x = module(x)
            cache.append(x if module.layer_index in self.save else None)
        return x

    def fuse(self) -> Model:
        """Fold every BatchNorm into its convolution (for inference); every head branch stays."""
        for m in self.modules():
            if isinstance(m, Conv) and isinstance(m.bn, nn.BatchNorm2d):
                m.conv = fuse_conv_and_bn(m.conv, m.bn)
                m.bn = nn.Identity()
        return self

    def info(self, imgsz: int = 640) -> str:
        return model_info(self, imgsz)

    @property
    def stride(self) -> torch.Tensor:
        return cast(torch.Tensor, self.model[-1].stride)


def build_model(
    cfg: str | Path | dict,
    *,
    nc: int | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    transfer: bool = False,
    keep_anchors: bool = True,
    anchors: float | None = None,
    names: list[str] | None = None,
) -> Model:
    """The one way models are made: from a config, then loaded with ``weights`` if given.

    Without ``transfer`` every tensor of ``weights`` must match (resuming, evaluating a checkpoint). With it,
    each tensor whose name and shape fit is copied and the rest keep their initialisation (fine-tuning with
    another number of classes: the head's class outputs do not fit); the count is logged. An anchor-free head
    is then built with the source's class-branch width (``head_class_width``; its default depends on the class
    count), so only the class branch's last layer starts afresh (the head says which config keys keep the source's
    shape: ``DetectionHead.fine_tune_config``). ``keep_anchors`` False leaves the config's anchors (AutoAnchor may
    then fit new ones).
    """
    config = load_model_config(cfg)
    if transfer and weights is not None:
        tuned = _head_class(config).fine_tune_config(weights)
        config.update({k: v for k, v in tuned.items() if k not in config})  # the config's own keys win
    model = Model(config, nc=nc, anchors=anchors)
    if weights is not None:
        if transfer:
            own = model.state_dict()
            fitting = {
                k: v
                for k, v in weights.items()
                if k in own and own[k].shape == v.shape and (keep_anchors or not k.endswith(".anchors"))
            }
            model.load_state_dict(fitting, strict=False)
            LOGGER.info(f"Transferred {len(fitting)}/{len(own)} tensors")
        else:
            model.load_state_dict(weights)
    if names is not None:
        model.names = list(names)
    return model


def _head_class(cfg: dict) -> type[DetectionHead]:
    """The head class the last row of ``cfg`` builds."""
    rows = cfg.get("head") or []
    name = rows[-1][2] if rows and len(rows[-1]) > 2 else None
    if name not in HEADS:
        raise UserError(f"{cfg.get('yaml_file', 'model config')}: the last layer must be one of {', '.join(HEADS)}")
    return head_for(name, cfg, HEADS[name])


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
