"""The configuration of a training run: what train.py's options say, as one typed record the engine takes.

The checkpoint stores it under its own schema (``"config"`` with ``"config_schema"``), not the command line's
option names: a flag can be renamed (the parser's ``dest`` keeps the field's name) without breaking the resume of
runs written before. Checkpoints written before the schema existed carry the argparse options as ``"opt"``; they
are read as schema 1, whose fields have the names those options had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import UserError

CONFIG_SCHEMA = 1


@dataclass(frozen=True)
class TrainConfig:
    """Every choice a training run makes up front; the field names are the stored schema's."""

    # data
    data: str = ""
    imgsz: int = 640
    rect: bool = False
    single_cls: bool = False
    cache: str = "auto"  # auto, ram, disk or off
    workers: int = 8
    shard_window: int = 1000
    resampled: bool = False
    # model
    weights: str = ""  # a checkpoint to start from ('' trains from scratch)
    cfg: str | None = None
    freeze: tuple[int, ...] = (0,)
    noautoanchor: bool = False
    sync_bn: bool = False
    # schedule
    epochs: int = 100
    time: float | None = None  # hours the epochs are fitted to (--time)
    time_includes_startup: bool = False  # the budget counts from the process start, final validation included
    time_max_epochs: int | None = None  # the most epochs the budget may fit (None: as many as fit)
    batch_size: int = 16  # global, over all ranks
    hyp: str = ""
    optimizer: str = "auto"
    cos_lr: bool = False
    label_smoothing: float = 0.0
    patience: int = 100
    noval: bool = False
    seed: int = 0
    deterministic: bool = False
    amp: bool = True
    evolve: int | None = None  # trials of the search in total
    resume_evolve: str | None = None  # an evolution folder (or a file in it) whose study continues
    evolve_storage: str = ""  # the study's journal file or SQL URL ('' : study.journal in a new evolution folder)
    evolve_sampler: str = "genetic"  # genetic, tpe or cmaes
    evolve_pruner: str = "median"  # median or none
    # augmentation
    multi_scale: bool = False
    close_mosaic: int = 10
    image_weights: bool = False
    quad: bool = False
    # device and distributed runs
    device: str = ""
    dist_timeout: float = 10.0
    compile: str = ""  # torch.compile's backend for the model's forward ('': not compiled)
    # output and checkpoints
    project: str = "runs/train"
    name: str = "exp"
    exist_ok: bool = False
    nosave: bool = False
    noplots: bool = False
    save_period: int = -1
    save_steps: int = 0
    save_minutes: float = 10.0
    log_interval: int = 10  # optimizer steps between read-backs of the losses (utils/engine/step.py)
    loggers: tuple[str, ...] = ("tensorboard",)  # experiment trackers (utils/trackers/)
    profile: int = 0  # optimizer steps of a torch.profiler trace (0: none)
    save_dir: str | None = None  # the run folder, once made (absolute)

    def __post_init__(self) -> None:
        object.__setattr__(self, "freeze", tuple(self.freeze))  # a list from argparse or a checkpoint
        object.__setattr__(self, "loggers", tuple(self.loggers))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: plain values (lists, str paths), as the checkpoint and opt.yaml hold them."""
        out = {}
        for name in field_names():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """A config from stored values; unknown keys are left out, missing ones take their defaults."""
        return cls(**{k: v for k, v in values.items() if k in field_names()})


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig))


def stored_config(ckpt: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """A checkpoint's run configuration as schema-1 values: its ``config``, or the argparse ``opt`` of a
    checkpoint written before the schema (only the keys that are fields; the others described the command)."""
    if "config" in ckpt:
        schema = int(ckpt.get("config_schema", 1))
        if schema > CONFIG_SCHEMA:
            raise UserError(
                f"{source}: its run configuration has schema {schema}, newer than this code's "
                f"{CONFIG_SCHEMA}: resume it with the version that wrote it"
            )
        return dict(ckpt["config"])
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in ckpt["opt"].items() if k in field_names()}
