"""--evolve: a hyper-parameter search of N trials on one Optuna study (utils/search/), each trial a training run.

Every process started on the same study is a worker: it takes the next trial, trains it in ``trial<n>/`` of the
evolution folder and records the outcome, until N trials have finished. In a distributed worker only global
rank 0 talks to the study; the other ranks get each trial's hyper-parameters from it and train the trial with it.

Where the study lives (``study_place``): ``--evolve-storage`` names it (a journal file or an SQL URL) and the
evolution folder is ``--project/--name`` itself, shared by every worker; without it, a new numbered folder holds
the study in ``study.journal``. ``--resume-evolve PATH`` continues the study of an evolution folder (PATH is the
folder or a file in it); a folder whose evolve.csv has no study beside it starts one from the csv's rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.families import family_of
from utils.checkpoint import load_checkpoint
from utils.data.config import load_data_config
from utils.data.labels import load_labels
from utils.distributed import DistInfo, broadcast_object, rank_zero_decides
from utils.engine.config import TrainConfig
from utils.engine.setup import model_config
from utils.engine.trainer import train
from utils.errors import UserError
from utils.log import LOGGER, colorstr
from utils.metrics import fitness
from utils.optimizer import OptimizerChoice, choose_optimizer
from utils.run_dir import increment_path
from utils.search import Search, SearchConfig, SearchSpace
from utils.search.records import read_evolve_csv
from utils.search.study import JOURNAL_NAME
from utils.torch_utils import torch_distributed_zero_first


@dataclass(frozen=True)
class StudyPlace:
    """The evolution folder (trial folders, evolve.csv, hyp_evolve.yaml), the study's storage and name."""

    folder: Path
    storage: str
    name: str
    csv_rows_to_add: bool = False  # a folder with an evolve.csv and no study: the study starts from its rows


def study_place(config: TrainConfig, info: DistInfo) -> StudyPlace:
    """Where the study is: --resume-evolve's folder, --project/--name with --evolve-storage, or a new folder."""
    if config.resume_evolve and config.evolve_storage:
        raise UserError(
            "--resume-evolve names the study of an evolution folder and --evolve-storage names a "
            "study's storage: give one of them"
        )
    if config.resume_evolve:
        given = Path(config.resume_evolve).resolve()
        folder = given if given.is_dir() else given.parent
        journal, csv_file = folder / JOURNAL_NAME, folder / "evolve.csv"
        if not journal.is_file() and not csv_file.is_file():
            raise UserError(
                f"--resume-evolve {config.resume_evolve}: no study here (neither {journal} nor {csv_file} exists)"
            )
        return StudyPlace(folder, str(journal), folder.name, csv_rows_to_add=not journal.is_file())
    if config.evolve_storage:  # every worker of the study shares the folder: no numbering
        folder = (Path(config.project) / config.name).resolve()
        return StudyPlace(folder, config.evolve_storage, config.name)
    folder = Path(
        broadcast_object(str(increment_path(Path(config.project) / config.name, config.exist_ok).resolve()), info)
    )
    return StudyPlace(folder, str(folder / JOURNAL_NAME), folder.name)


def search_space(config: TrainConfig, info: DistInfo) -> tuple[Any, SearchSpace]:
    """The model family and what is searched: the --hyp values (or the family's file) moved within its limits,
    less the values the trials' optimizer sets itself (they would be recorded as evolved while no trial used them)."""
    family = family_of(model_config(config, None, load_checkpoint(config.weights) if config.weights else None))
    base = family.read_hyp(config.hyp or family.default_hyp_path)
    keys = tuple(family.evolve_keys(base))
    choice = trial_optimizer(config, family, base, info)
    limits = dict(family.evolve_limits)
    if ignored := [k for k in choice.hyp_keys_ignored if k in keys and k in limits and limits[k].scale > 0]:
        limits.update({k: dataclasses.replace(limits[k], scale=0.0) for k in ignored})
        LOGGER.info(
            f"evolve: {' and '.join(ignored)} not searched: every trial's optimizer sets its own ({choice.reason}); "
            f"--optimizer SGD or AdamW searches them"
        )
    return family, SearchSpace(base, keys, limits, tuple(family.loss_names))


def trial_optimizer(config: TrainConfig, family: Any, base: Any, info: DistInfo) -> OptimizerChoice:
    """The optimizer every trial will choose: --optimizer auto decides by the length of the run, so by the number of
    training images (the label cache the first trial reuses is built here, by local rank 0 first)."""
    if config.optimizer != "auto":
        return choose_optimizer(config.optimizer, config.epochs, 1, config.batch_size, 1, base)
    with torch_distributed_zero_first(info.local_rank):
        data = load_data_config(config.data)
        table = load_labels(data["train"], nc=data["nc"], workers=config.workers, verbose=False)
    nc = 1 if config.single_cls else data["nc"]
    return choose_optimizer(
        "auto", config.epochs, len(table), config.batch_size, nc, base, family.adamw_lr_per_class_term
    )


def open_search(config: TrainConfig, place: StudyPlace, space: SearchSpace) -> Search:
    """Rank 0's handle on the study (made, or joined)."""
    place.folder.mkdir(parents=True, exist_ok=True)
    rows = read_evolve_csv(place.folder / "evolve.csv", space.keys, space.loss_names) if place.csv_rows_to_add else None
    assert config.evolve is not None, "evolution without --evolve"
    search_config = SearchConfig(
        place.folder,
        config.evolve,
        storage=place.storage,
        study_name=place.name,
        sampler=config.evolve_sampler,
        seed=config.seed,
        pruner=config.evolve_pruner,
    )
    return Search(search_config, space, completed=rows)


def evolve(config: TrainConfig, device: torch.device, info: DistInfo) -> Path:
    """--evolve N: train trials until the study holds N finished ones; returns the evolution folder."""
    if config.evolve is None:
        raise UserError(f"--resume-evolve {config.resume_evolve} needs --evolve N, the number of trials in total")
    if config.evolve < 1:
        raise UserError(f"--evolve {config.evolve}: give the number of trials, at least 1 (e.g. --evolve 30)")
    family, space = search_space(config, info)
    place = study_place(config, info)
    search = open_search(config, place, space) if info.is_main else None
    LOGGER.info(
        f"Evolving hyper-parameters: study '{place.name}' in {place.storage}, {config.evolve} trials in "
        f"total, sampler {config.evolve_sampler}, pruner {config.evolve_pruner}; trials in "
        f"{colorstr(str(place.folder))}"
    )
    for trained in itertools.count():
        trial = search.next_trial() if search is not None else None
        ticket = rank_zero_decides(info, json.dumps(None if trial is None else [trial.number, trial.hyp.to_dict()]))
        if json.loads(ticket) is None:
            if trained == 0 and search is not None:
                LOGGER.info(
                    f"study '{place.name}' already has {search.counts()[0]} finished trials (--evolve "
                    f"{config.evolve}): nothing to train"
                )
            break
        number, values = json.loads(ticket)
        run_trial(config, place.folder, family.read_hyp(values, f"trial {number}"), number, trial, device, info)
        if search is not None:
            search.write_records()
    if search is not None and trained:  # evolve.png once at the end: a figure of every hyper-parameter takes seconds
        done = search.write_records(plot=True)
        LOGGER.info(
            f"Evolution done: {done or 'no trial completed'}; the best hyper-parameters in "
            f"{place.folder / 'hyp_evolve.yaml'}"
        )
    return place.folder


def run_trial(
    config: TrainConfig, folder: Path, hyp: Any, number: int, trial: Any, device: torch.device, info: DistInfo
) -> None:
    """Train trial ``number`` in ``folder/trial<number>`` (every rank); rank 0 (``trial`` not None) reports each
    validated epoch's fitness to the pruner and records how the trial ended."""
    pruning = config.evolve_pruner != "none"
    pruned: list[int] = []

    def report(epoch: int, results: tuple[float, ...]) -> bool:
        if trial is not None and pruning and trial.report(epoch, float(fitness(np.array(results[:4])))):
            pruned.append(epoch)
            LOGGER.info(
                f"trial {number}: pruned after epoch {epoch} (its fitness is below the median of the "
                f"other trials' at that epoch)"
            )
            return True
        return False

    # Trials validate every epoch when a pruner judges them by it, otherwise only after their last epoch.
    trial_config = config.replace(
        project=str(folder),
        name=f"trial{number}",
        exist_ok=True,
        noval=not pruning,
        nosave=True,
        noplots=True,
        evolve=None,
        resume_evolve=None,
        evolve_storage="",
    )
    try:
        out = train(trial_config, device, info, None, hyp=hyp, on_validated=report)
    except BaseException as e:
        if trial is not None:
            trial.fail(f"{e.__class__.__name__}: {e}")
        raise
    if trial is None:
        return
    if pruned:
        trial.prune()
        return
    trial.complete(out.results)
    LOGGER.info(f"trial {number}: fitness {float(fitness(np.array(out.results[:4]))):.5g}")
