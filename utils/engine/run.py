"""A run from its configuration, as train.py starts it: the device and process group, then an evolution, or a
training run (new, resumed, or continued after a launcher restart); a failed collective ends it in one line."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils.distributed import DistInfo, collective_failure, destroy_process_group, init_process_group
from utils.engine.config import TrainConfig
from utils.engine.evolve import evolve
from utils.engine.interrupt import Interrupted
from utils.engine.phases import PhaseClock
from utils.engine.resume import ResumeRequest, is_finished, resume_point
from utils.engine.setup import check_global_batch
from utils.engine.trainer import train
from utils.errors import EveryRankError, UserError
from utils.log import LOGGER
from utils.storage import is_url, open_storage
from utils.torch_utils import local_ranks_share_a_gpu, select_device
from utils.trackers import check_trackers


@dataclass(frozen=True)
class Launch:
    """What a process is asked to do."""

    config: TrainConfig
    resume: ResumeRequest = ResumeRequest()
    process_started: float | None = None  # the monotonic clock at the process start (a whole-run time budget)


def run(launch: Launch, info: DistInfo) -> int:
    """Train (or evolve) as ``launch`` says; the exit status."""
    config = launch.config
    clock = PhaseClock(launch.process_started)
    clock.stamp("imports and process set-up")
    check_trackers(config.loggers)  # before joining the process group: every rank stops at once, in one line
    check_storage(launch)  # wrong credentials or an unreachable endpoint: one line, before any training
    if not launch.resume.asked:  # before joining the process group, so that every rank says so at once
        check_global_batch(config.batch_size, info.world_size)
    device = setup_device(config, info)
    clock.stamp("device and process group")
    try:
        if config.evolve is not None or config.resume_evolve:
            if launch.resume.asked:
                raise UserError(
                    "--evolve trains new runs and cannot --resume one; continue an evolution's study with "
                    "--resume-evolve runs/evolve/exp (or --evolve-storage naming its storage)"
                )
            evolve(config, device, info)
            return 0
        config, resumed = resume_point(config, launch.resume, info)
        if resumed is not None:
            clock.stamp(f"resume: {resumed.path} read")
        if resumed is not None and is_finished(resumed, config):
            LOGGER.info(
                f"{resumed.path}: this run already finished its {config.epochs} epochs; nothing to resume "
                f"(add --epochs N to train it further)"
            )
            return 0
        train(config, device, info, resumed, process_started=launch.process_started, clock=clock)
    except Interrupted as e:
        if info.is_main:
            LOGGER.warning(f"Stopped by signal {e.signum} with a checkpoint; resume with: {e.resume_command}")
        return e.exit_status
    except KeyboardInterrupt:  # outside the epochs, where no checkpoint could be exact
        if info.is_main:
            LOGGER.warning("Interrupted (Ctrl-C) outside the training epochs: stopped at once")
        return 128 + signal.SIGINT
    except RuntimeError as e:  # dist.DistError and CollectiveError are RuntimeErrors
        failure = collective_failure(e, info)
        if failure is None:
            raise
        LOGGER.error(failure)
        return 1
    finally:
        destroy_process_group()
        clock.stamp("exit")
    return 0


def setup_device(config: TrainConfig, info: DistInfo) -> torch.device:
    """This process's device; in a distributed run, also join the process group."""
    device = select_device(config.device, local_rank=info.local_rank, local_world_size=info.local_world_size)
    if info.is_distributed:
        init_process_group(
            device, info, config.dist_timeout, shared_gpu=local_ranks_share_a_gpu(config.device, info.local_world_size)
        )
        LOGGER.info(f"DDP: world size {info.world_size}, backend {dist.get_backend()}, rank {info.rank} on {device}")
    return device


def check_storage(launch: Launch) -> None:
    """Every URL the run reads or writes, opened with the credentials at hand on every rank before the process group
    is joined: a problem is one line (from rank 0) and every rank stops at once."""
    config, resume = launch.config, launch.resume
    named = (config.project, resume.path, *resume.latest_under, config.weights, config.data)
    urls = [str(u) for u in named if u and is_url(u)]
    if not urls:
        return
    if (config.evolve is not None or config.resume_evolve) and is_url(config.project):
        raise EveryRankError(f"--project {config.project}: an evolution keeps its study and runs in a local folder")
    for url in dict.fromkeys(urls):
        try:
            open_storage(url).check_access()
        except UserError as e:
            raise EveryRankError(str(e)) from None
