"""Export formats, one module each, found by the registry here: export.py, val.py and detect.py never name one.

A format module defines ``FORMAT`` (a ``utils.formats.base.Format``; its docstring says what it provides). Adding a
format is adding its module to this folder. ``format_named`` is what ``--include`` asks; ``format_of`` recognises
a path (a file by its suffix, a folder by its name or contents), and ``open_runner`` opens any artifact that
val.py or detect.py is given.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from pathlib import Path

import torch

from utils.errors import UserError
from utils.formats.base import Format, Runner

# Formats that export.py names in its help and that come as modules of their own; until a module is here, asking
# for one is a one-line error.
PLANNED: tuple[str, ...] = ()
_ORDER = ("pytorch", "onnx", "torchscript", "openvino", "litert", "ncnn", *PLANNED)


@lru_cache(maxsize=1)
def registered() -> dict[str, Format]:
    """Every format module of this package, by name (found once, on first use; importing a format module imports
    none of its optional packages)."""
    found: dict[str, Format] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if isinstance(fmt, Format):
            found[fmt.name] = fmt
    rank = {name: i for i, name in enumerate(_ORDER)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def export_names() -> list[str]:
    """What ``--include`` takes: every export format, registered or planned (the PyTorch checkpoint is the source)."""
    names = [n for n in registered() if n != "pytorch"]
    return names + [n for n in PLANNED if n not in names]


def format_named(name: str) -> Format:
    """The format ``--include`` names; one line when it is unknown, not in this version, or its package is missing."""
    formats = registered()
    if name not in formats or name == "pytorch":
        if name in PLANNED:
            raise UserError(
                f"--include {name}: not available in this version (no format module utils/formats/{name}.py)"
            )
        raise UserError(f"--include {name}: unknown format; choose from {', '.join(export_names())}")
    fmt = formats[name]
    reason = fmt.unavailable()
    if reason:
        raise UserError(f"--include {name}: {reason}")
    return fmt


def format_of(path: str | Path) -> Format:
    """The format of a weights file or export folder."""
    path = Path(path)
    for fmt in registered().values():
        if fmt.recognizes(path):
            return fmt
    accepted = ", ".join(f.suffix + ("/ folder" if f.is_folder else "") for f in registered().values())
    raise UserError(f"{path}: unknown weights format (expected one of: {accepted})")


def open_runner(path: str | Path, device: torch.device | str = "cpu", end2end: bool = False) -> Runner:
    """A runner for any artifact: a ``.pt`` checkpoint, or a file or folder export.py wrote. ``end2end``: YOLO26's
    NMS-free output (a .pt is switched to it; an exported file must have been exported so)."""
    from models.families import missing_weights_message

    path = Path(path)
    if not path.exists():
        raise UserError(missing_weights_message(path, "weights file"))
    fmt = format_of(path)
    reason = fmt.unavailable()
    if reason:
        raise UserError(f"{path}: {reason}")
    runner = fmt.open(path, torch.device(device))
    if end2end:
        runner.use_end2end(path)
    return runner
