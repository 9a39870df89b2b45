"""Resuming: which checkpoint a run continues, with which configuration, and from where in which epoch.

``--resume PATH``, ``--resume`` alone (the newest last.pt) and a launcher restart (the run folder this launcher
job made) all end in a checkpoint; its stored configuration is the run's, with the options given now applied
when they may change (``RESUME_OVERRIDABLE``) and checked against the run's own otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from utils.checkpoint import has_training_state, latest_last_checkpoint, load_checkpoint, not_resumable, run_folder_of
from utils.distributed import DistInfo, broadcast_object
from utils.engine.config import TrainConfig, field_names, stored_config
from utils.engine.lr_schedule import LrSchedule
from utils.engine.run_upload import job_run_folder, newest_interrupted_run
from utils.engine.tally import LossTally
from utils.errors import UserError
from utils.hyp import OptimisationHyp
from utils.log import LOGGER
from utils.storage import is_url, join, local_copy, local_path, open_storage, split

# Fields a resumed run may take anew; any other field given with --resume must equal the run's own.
RESUME_OVERRIDABLE = frozenset(
    {
        "epochs",
        "device",
        "workers",
        "patience",
        "save_period",
        "save_steps",
        "save_minutes",
        "log_interval",
        "noval",
        "nosave",
        "noplots",
        "cache",
        "exist_ok",
        "deterministic",
        "amp",
        "dist_timeout",
        "time",
        "time_includes_startup",
        "time_max_epochs",
        "loggers",
        "profile",
        "compile",  # how the forward is computed, not what
    }
)


@dataclass(frozen=True)
class ResumeRequest:
    """What the command line asks to continue."""

    path: str | None = None  # --resume PATH
    latest_under: tuple[str, ...] = ()  # --resume alone: the newest last.pt under these folders
    explicit: frozenset[str] = frozenset()  # the config fields given on the command line

    @property
    def asked(self) -> bool:
        return self.path is not None or bool(self.latest_under)


@dataclass
class Resumed:
    """The checkpoint a run continues from."""

    path: Path | str  # a local file, or a URL (a run folder on object storage)
    ckpt: dict[str, Any]


@dataclass
class ResumePosition:
    """Where a resumed run goes on: its schedule, epoch, batch and the epoch's losses so far."""

    schedule: LrSchedule
    start_epoch: int
    start_batch: int
    tally: LossTally


def resume_point(config: TrainConfig, request: ResumeRequest, info: DistInfo) -> tuple[TrainConfig, Resumed | None]:
    """The configuration and checkpoint to continue from: --resume, or the run a restarted launcher group was
    training. Rank 0 decides which file; every rank then reads it (on several machines the run folder must be
    shared)."""
    path: Path | str | None = None
    if request.path is not None:
        # Every node reads the same file, whatever its working directory; a URL is read through the storage seam.
        path = request.path if is_url(request.path) else local_path(request.path).resolve()
    elif request.latest_under and info.is_main:  # the newest run rank 0 sees; the other nodes need not see it
        path = latest_checkpoint(request.latest_under, config.dist_timeout)  # under their own working directory
    elif not request.asked and info.restart_count > 0 and info.is_main:
        path = restarted_checkpoint(config, info)
    path = broadcast_object(None if path is None else str(path), info)
    if path is None:
        return config, None
    with local_copy(path) as local:  # every rank downloads a URL's checkpoint itself (no shared disk needed)
        ckpt = load_checkpoint(local)
    location: Path | str = path if is_url(path) else Path(path)
    explicit = request.explicit if request.asked else frozenset()  # a restart: the run's own command line
    return resumed_config(config, explicit, location, ckpt), Resumed(location, ckpt)


def latest_checkpoint(folders: tuple[str, ...], dist_timeout: float) -> Path | str:
    """--resume alone: the newest interrupted run's last.pt under local folders, or its newest complete checkpoint
    in a project at a URL (whose heartbeat is older than twice --dist-timeout, in minutes)."""
    urls = [folder for folder in folders if is_url(folder)]
    if urls:
        return newest_interrupted_run(urls[0], stale_after_s=2 * dist_timeout * 60)
    return latest_last_checkpoint(*folders)


def restarted_checkpoint(config: TrainConfig, info: DistInfo) -> Path | str | None:
    """A launcher restart: the last.pt of the run folder this launcher job made, when it has one."""
    if is_url(config.project):
        url = job_run_folder(config.project, info)
        if url is None or not open_storage(url).exists("weights/last.pt"):
            return None
        LOGGER.info(f"restart {info.restart_count} of launcher run {info.run_id}: continuing {url}")
        return join(url, "weights/last.pt")
    folder = run_folder_of(info.run_id, config.project, info.launcher_started)
    if folder is None or not (folder / "weights/last.pt").is_file():
        return None
    LOGGER.info(f"restart {info.restart_count} of launcher run {info.run_id}: continuing {folder}")
    return folder / "weights/last.pt"


def resumed_config(
    given: TrainConfig, explicit: frozenset[str] | set[str], path: Path | str, ckpt: dict[str, Any]
) -> TrainConfig:
    """The run's own configuration with the fields given now applied: overridable ones replace, others must agree.

    ``epochs`` may extend (or shorten) a run, a finished one included; see lr_schedule.py for how the learning
    rate continues. Any other field that differs from the run's is a one-line error naming its option. Fields the
    checkpoint does not hold (added after it was written) take the values given now.
    """
    if not has_training_state(ckpt):
        raise not_resumable(Path(path), ckpt)
    saved = stored_config(ckpt, path)
    restored = given.replace(**{k: v for k, v in saved.items() if k in field_names()})
    changes = {}
    for name in sorted(explicit):
        given_value, saved_value = getattr(given, name), saved.get(name)
        if name in RESUME_OVERRIDABLE:
            changes[name] = given_value
        elif saved_value is not None and _comparable(given_value) != _comparable(saved_value):
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} {_shown(given_value)} cannot change when resuming {path} (the run has "
                f"{_shown(saved_value)}); start a new run with --weights {path} instead"
            )
    folder = split(str(path))[0]
    if is_url(path) and split(folder)[1] == "weights":  # a run folder on object storage
        changes["save_dir"] = split(folder)[0]
    elif Path(path).parent.name == "weights":  # the run folder is where its checkpoint lies now (moved, mounted ...)
        changes["save_dir"] = str(Path(path).parent.parent.resolve())
    return restored.replace(**changes)


def is_finished(resumed: Resumed, config: TrainConfig) -> bool:
    """Whether the checkpoint ends a run that has trained all of ``config.epochs`` (nothing to resume)."""
    ckpt = resumed.ckpt
    return ckpt["mid_epoch"] is None and ckpt["epoch"] + 1 >= config.epochs


def resumed_position(ckpt: dict[str, Any], config: TrainConfig, hyp: OptimisationHyp, n_losses: int) -> ResumePosition:
    """Where a resumed run goes on (epoch, batch, the epoch's losses so far) and its learning-rate schedule."""
    saved = stored_config(ckpt, "checkpoint")
    schedule = LrSchedule(ckpt.get("lr_schedule") or [[0, saved["epochs"], 1.0, hyp.lrf]], config.cos_lr)
    mid = ckpt.get("mid_epoch")
    start_epoch, start_batch, tally = int(ckpt["epoch"]) + 1, 0, LossTally(n_losses)
    if mid:
        start_epoch = int(mid["epoch"])
        if config.batch_size == saved["batch_size"]:  # the same global batches, whatever the number of ranks
            start_batch = int(mid["batch"])
            tally = LossTally(n_losses, np.array(mid["sums"]), float(mid["micro_batches"]), int(mid["skipped_steps"]))
        else:
            start_epoch += 1
            LOGGER.warning(
                f"WARNING the global batch changed: epoch {start_epoch - 1} is not finished, training "
                f"goes on from the next epoch boundary ({start_epoch})"
            )
    if config.epochs != saved["epochs"]:
        schedule = schedule.extended(start_epoch, config.epochs, hyp.lrf)
        LOGGER.info(
            f"--epochs {config.epochs} (was {saved['epochs']}): the learning rate goes on from "
            f"{schedule(start_epoch):.4g} x lr0 to {hyp.lrf} x lr0 at epoch {config.epochs - 1}"
        )
    where = f"batch {start_batch} of epoch {start_epoch}" if start_batch else f"epoch {start_epoch}"
    LOGGER.info(f"Resuming training at {where}")
    return ResumePosition(schedule, start_epoch, start_batch, tally)


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _comparable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return str(value) if isinstance(value, Path) else value
