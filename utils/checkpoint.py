"""The checkpoint room: the project's one checkpoint format, saving, loading, stripping and the resume rules.

A checkpoint is a dict of a model config, state_dicts and plain values; it opens with
``torch.load(path, weights_only=True)``, so loading never runs code from the file. Files are written to a
temporary name, flushed and renamed, so a crash never leaves a half-written checkpoint. Building a model from a
checkpoint is the models' job (``models.yolo.build_model``); this module only handles dicts.

Training state (what ``--resume`` and launcher restarts need): ``optimizer``, ``scaler``, ``ema``/``updates``,
``epoch`` (the last completed epoch, -1 before the first), ``mid_epoch`` (None, or where a checkpoint written
inside an epoch stands: the epoch, the batches done and the epoch's loss sums so far), ``best_fitness``,
``best_epoch``, ``lr_schedule`` (see utils/engine/lr_schedule.py), ``optimizer_choice`` (the optimizer, lr0,
momentum and accumulation the run started with; see utils/optimizer.py), ``config`` with ``config_schema`` (the
run's configuration, utils/engine/config.py; files written before it hold the argparse options as ``opt``),
``hyp``, ``world_size``, ``run_id`` and ``class_weights`` (--image-weights: the class weights of the next
epoch's draw, or None). The resume rules are the engine's (utils/engine/resume.py).
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from utils.distributed import de_parallel
from utils.ema import ModelEMA
from utils.errors import UserError, describe
from utils.files import atomic_output
from utils.torch_utils import cpu_fp32_state

FORMAT_VERSION = 1


# ---- format, save, load ----------------------------------------------------------------------------------


def model_state(model: nn.Module) -> dict[str, Any]:
    """The entries that rebuild a model: its config, class names and fp32 weights (on the CPU)."""
    bare: Any = de_parallel(model)  # a Model: yaml and names are untyped nn.Module attributes
    return {"model_cfg": bare.yaml, "names": list(bare.names), "model": cpu_fp32_state(bare)}


def weights_are_finite(ckpt: dict[str, Any]) -> bool:
    """False when the model or EMA weights hold a NaN or an infinity (such a file must not replace a good one)."""
    states = [ckpt.get("model") or {}, ckpt.get("ema") or {}]
    return all(torch.isfinite(v).all() for s in states for v in s.values() if v.is_floating_point())


def save_checkpoint(ckpt: dict[str, Any], path: str | Path) -> None:
    """Write ``ckpt`` atomically and durably: a temporary file in the same folder, flushed, then renamed."""
    with atomic_output(path, durable=True) as tmp:
        torch.save({"format_version": FORMAT_VERSION, **ckpt}, tmp)


def copy_checkpoint(src: str | Path, dst: str | Path) -> None:
    """``src``'s bytes at ``dst``, atomically and durably (best.pt as last.pt: one serialisation, not two)."""
    with atomic_output(dst, durable=True) as tmp:
        shutil.copyfile(src, tmp)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Open a checkpoint safely; a file that needs arbitrary unpickling is refused, never executed.

    Another tool's checkpoint (YOLOv5 v6+, Ultralytics' detection ``.pt``) is imported without running anything from
    it, by the importer of its family (models/families/), and returned in this project's format.
    """
    from models.families import import_checkpoint, missing_weights_message
    from models.families.records import MALFORMED_FILE_ERRORS

    path = Path(path)
    if path.is_dir():  # a Hugging Face folder (config.json + model.safetensors)
        return import_checkpoint(path)
    if not path.is_file():
        raise UserError(missing_weights_message(path))
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # Not our format: another tool's checkpoint, read by its family's allow-list importer; anything else is
        # refused with the global it named.
        return import_checkpoint(path)
    except MALFORMED_FILE_ERRORS as e:
        raise UserError(f"{path}: not a readable checkpoint ({describe(e)})") from e
    if isinstance(ckpt, dict) and ("model" in ckpt or "ema" in ckpt) and "model_cfg" not in ckpt:
        return import_checkpoint(path)  # plain tensors of another tool (the official DETRs' .pth)
    if not isinstance(ckpt, dict) or "model_cfg" not in ckpt or "model" not in ckpt:
        raise UserError(f"{path}: not a checkpoint of this project (no model config and weights)")
    return ckpt


def trained_imgsz(ckpt: dict[str, Any]) -> int | None:
    """The image size a checkpoint was trained at: ours (``config``, or ``opt`` in older files), YOLOv5's (``opt``)
    or Ultralytics' (``train_args``) record; None when it records none."""
    from models.families import imported_records

    imported = [r.get(key) for r in imported_records(ckpt) for key in ("opt", "train_args")]
    for record in (ckpt.get("config"), ckpt.get("opt"), *imported, ckpt.get("train_args")):
        size = record.get("imgsz", record.get("img_size")) if isinstance(record, dict) else None
        if isinstance(size, (list, tuple)) and size:
            size = max(size)
        if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0:
            return int(size)
    return None


def model_weights(ckpt: dict[str, Any], prefer_ema: bool = True) -> dict[str, torch.Tensor]:
    """The weights a model is rebuilt with: the EMA's when present (and wanted), else the raw model's."""
    return ckpt["ema"] if prefer_ema and ckpt.get("ema") is not None else ckpt["model"]


# ---- training state ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands when a checkpoint is written."""

    epoch: int  # the last completed epoch, -1 before the first
    mid_epoch: dict[str, Any] | None  # inside an epoch: the epoch, the batches done, the epoch's loss sums so far
    best_fitness: float
    best_epoch: int


def training_checkpoint(
    model: nn.Module,
    ema: ModelEMA,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    position: RunPosition,
    run: dict[str, Any],
) -> dict[str, Any]:
    """Everything needed to resume, in the safe format: tensors, state_dicts and plain values only.

    ``run`` holds the plain values of the run itself (``lr_schedule``, ``optimizer_choice``, ``config`` and
    ``config_schema``, ``hyp``, ``world_size``, ``run_id``, ``class_weights``). Its tensors are the live ones, on
    the model's device: take a ``host_snapshot`` before training goes on.
    """
    bare: Any = de_parallel(model)  # a Model: yaml and names are untyped nn.Module attributes
    # Left on the device: host_snapshot copies every tensor to the host in one go (one wait, not one per tensor).
    return {
        "model_cfg": bare.yaml,
        "names": list(bare.names),
        "model": _fp32_state(bare),
        "ema": _fp32_state(ema.ema),
        "updates": ema.updates,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "epoch": position.epoch,
        "mid_epoch": position.mid_epoch,
        "best_fitness": float(position.best_fitness),
        "best_epoch": position.best_epoch,
        **run,
        "torch_rng": torch.get_rng_state(),
        "date": datetime.now().isoformat(timespec="seconds"),
    }


def _fp32_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's state_dict where it lies, floating-point tensors in fp32 (the live tensors where they are fp32)."""
    return {k: v.detach().float() if v.is_floating_point() else v.detach() for k, v in module.state_dict().items()}


def host_snapshot(ckpt: Any) -> Any:
    """A copy of ``ckpt`` whose tensors are the host's own: what a background write may hold while training goes on.

    Device tensors (the model, EMA, the optimizer's moments and, in a fused optimizer, its step counters) are
    copied into pinned host memory without waiting, and the device is waited for once at the end; host tensors
    are cloned. Nested dicts, lists and tuples are copied; other values are kept as they are.
    """
    devices: set[torch.device] = set()
    copy = _host_copy(ckpt, devices)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # every copy above was queued on this stream
    return copy


def _host_copy(obj: Any, devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            return obj.detach().clone()
        devices.add(obj.device)
        # The same strides as the device tensor (channels_last moments stay channels_last): CUDA's fused optimizers
        # refuse moments whose layout differs from their parameters'.
        out = torch.empty_like(obj, device="cpu", pin_memory=True)
        return out.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v, devices) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, devices) for v in obj)
    return obj


def checkpoint_label(ckpt: dict[str, Any]) -> str:
    """Where a training checkpoint stands, for the log: ``epoch 3`` (its end) or ``epoch 4 batch 120``."""
    mid = ckpt.get("mid_epoch")
    if mid:
        return f"epoch {mid['epoch']} batch {mid['batch']}"
    return f"epoch {ckpt['epoch']}" if "epoch" in ckpt else "weights"


def has_training_state(ckpt: dict[str, Any]) -> bool:
    return ckpt.get("optimizer") is not None and "epoch" in ckpt and ("config" in ckpt or "opt" in ckpt)


def restore_training_state(
    ckpt: dict[str, Any], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, ema: ModelEMA | None
) -> None:
    """Load the optimizer, scaler, EMA and RNG of a training checkpoint into the freshly built ones."""
    optimizer.load_state_dict(ckpt["optimizer"])
    conform_state_layout(optimizer)
    if ckpt.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and ckpt.get("ema") is not None:
        ema.ema.load_state_dict(ckpt["ema"])
        ema.updates = int(ckpt["updates"])
    if ckpt.get("torch_rng") is not None:
        torch.set_rng_state(ckpt["torch_rng"])


def conform_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each per-parameter state tensor of its parameter's shape (the moments) the parameter's strides.

    A checkpoint may hold them in another layout (contiguous where the model trains channels_last: written on
    another device, or by a writer that did not keep strides); CUDA's fused optimizers refuse such moments.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def strip_training_state(path: Path) -> None:
    """Drop the optimizer and scaler from a final checkpoint (a third of the size); keep it loadable."""
    if not path.exists():
        return
    ckpt = load_checkpoint(path)
    for key in ("optimizer", "scaler"):
        ckpt[key] = None
    ckpt.pop("format_version", None)
    save_checkpoint(ckpt, path)


# ---- resume rules ------------------------------------------------------------------------------------------


RUN_STATE = "run.json"  # in a run folder: whether the run finished, its newest complete checkpoint


def write_run_state(folder: str | Path, state: dict[str, Any]) -> None:
    """The run folder's record of its state, written atomically (``run_state`` reads it)."""
    with atomic_output(Path(folder) / RUN_STATE) as tmp:
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")


def run_state(folder: str | Path) -> dict[str, Any] | None:
    """The record ``write_run_state`` left in ``folder``; None where there is none (or it cannot be read)."""
    try:
        state = json.loads((Path(folder) / RUN_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def run_finished(folder: Path, last: Path) -> bool:
    """Whether the run in ``folder`` trained all its epochs: its record says so; a folder written before the record
    existed is judged by its last.pt (not finished when it cannot be read: a resume then names the problem)."""
    state = run_state(folder)
    if state is not None:
        return state.get("status") == "finished"
    try:
        ckpt = torch.load(last, map_location="cpu", weights_only=True)
        config = ckpt.get("config") or ckpt.get("opt") or {}
        return ckpt.get("mid_epoch") is None and int(ckpt["epoch"]) + 1 >= int(config["epochs"])
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        OSError,
        LookupError,
        TypeError,
        ValueError,
        AttributeError,
    ):  # unreadable, foreign or without the keys: not known to be finished
        return False


def latest_last_checkpoint(*search_dirs: str | Path) -> Path:
    """The ``last.pt`` of the newest interrupted run under any of ``search_dirs`` (newest by modification time;
    a run that finished is passed over: ``--resume PATH --epochs N`` extends one)."""
    candidates = sorted(
        {p.resolve() for d in search_dirs for p in Path(d).glob("**/last.pt")}, key=lambda p: p.stat().st_mtime
    )
    where = " or ".join(str(d) for d in search_dirs)
    if not candidates:
        raise UserError(f"{where}: no last.pt to resume (train first, or pass --resume PATH)")
    for last in reversed(candidates):
        folder = last.parent.parent if last.parent.name == "weights" else last.parent
        if not run_finished(folder, last):
            return last
    raise UserError(
        f"{where}: every run there finished (the newest: {candidates[-1]}); to train one further, pass "
        f"--resume {candidates[-1]} --epochs N"
    )


def run_folder_of(run_id: str, project: str | Path, not_before: float | None = None) -> Path | None:
    """The run folder under ``project`` that a launcher job with ``run_id`` created (restarts find it so).

    The newest such folder, and none marked before ``not_before`` (when this job's launcher started): an
    earlier job that used the same run id is never continued by accident.
    """
    if not run_id:
        return None
    mine = [
        (marker.stat().st_mtime, marker.parent)
        for marker in Path(project).glob("*/run_id")
        if marker.read_text(encoding="utf-8").strip() == run_id
    ]
    mine = [(when, folder) for when, folder in mine if not_before is None or when >= not_before]
    return max(mine)[1].resolve() if mine else None


def not_resumable(path: Path, ckpt: dict[str, Any]) -> UserError:
    from models.families import importer_of_source

    importer = importer_of_source(ckpt.get("source"))
    if importer is not None:
        what = f"a{'n' if importer.title[0] in 'AEIOU' else ''} {importer.title} checkpoint"
        instead = (
            f"fine-tune from it with --weights {path} ({importer.possessive} own training state cannot be "
            "continued here)"
        )
    elif ckpt.get("optimizer") is None and "epoch" in ckpt:
        what = "a final checkpoint (the optimizer state is stripped at the end of training)"
        instead = f"resume from {path.with_name('last.pt')}, or fine-tune from it with --weights {path}"
    else:
        what = "weights without training state"
        instead = f"fine-tune from them with --weights {path}, or resume from a run's weights/last.pt"
    return UserError(f"{path}: cannot resume: {what}; {instead}")
