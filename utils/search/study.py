"""One Optuna study shared by any number of workers: ``--evolve N`` runs N trials in total.

A worker is one training process (global rank 0 of a distributed training: only it talks to the study and
broadcasts each trial's hyp to the other ranks). Workers on one machine or many share a study through its
storage: a journal file (on a shared file system for several machines) or an SQL database URL. A worker takes
trials until N have finished (completed or pruned); while the last ones run elsewhere it waits, so that a trial
whose worker died is run again and the study ends with exactly N. Each running trial records its worker
(host:pid) and beats a heartbeat (a user attribute) every ``heartbeat_s``; any worker marks a trial failed
when its heartbeat is older than ``stale_s`` (Optuna's journal has no heartbeat of its own). A study killed
with all its workers continues when any worker starts again on the same storage.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from utils.errors import UserError
from utils.files import atomic_output
from utils.hyp import HypRecord
from utils.log import LOGGER
from utils.metrics import fitness
from utils.search.records import append_evolve_row, write_best_hyp
from utils.search.space import SearchSpace

if TYPE_CHECKING:  # optuna is imported only when a search runs
    import optuna

    from utils.search.sampler import GeneticSampler

SAMPLERS = ("genetic", "tpe", "cmaes")
PRUNERS = ("median", "none")
JOURNAL_NAME = "study.journal"
WORKER_ATTR, HEARTBEAT_ATTR, FAILED_ATTR, SPACE_ATTR = "worker", "heartbeat", "failed", "space"


@dataclass(frozen=True)
class SearchConfig:
    """How a worker joins a study. ``folder``: where evolve.csv and hyp_evolve.yaml are written (and the
    default journal); ``storage``: ``--evolve-storage``, a journal file path or an SQL URL ('' = the default)."""

    folder: Path
    n_trials: int
    storage: str = ""
    study_name: str = "evolve"
    sampler: str = "genetic"
    seed: int = 0
    pruner: str = "median"
    prune_startup: int = 5  # completed trials before any is pruned
    prune_warmup: int = 1  # epochs of a trial that are never pruned
    heartbeat_s: float = 30.0
    stale_s: float = 600.0  # a running trial without a heartbeat this long is marked failed
    poll_s: float = 10.0  # how often a worker with nothing to start looks again
    # A journal's lock file older than this was left by a worker killed while writing (Optuna's default grace).
    lock_grace_s: float = 30.0

    def storage_name(self) -> str:
        return self.storage or str(Path(self.folder) / JOURNAL_NAME)


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def import_optuna() -> ModuleType:
    try:
        import optuna
    except ImportError as e:
        raise UserError("--evolve needs the optuna package (pip install optuna)") from e
    return optuna


def open_storage(spec: str, lock_grace_s: float) -> optuna.storages.BaseStorage:
    """An SQL URL (``sqlite:///...``, ``postgresql://...``) as Optuna's RDB storage; any other string is a
    journal file, locked by a lock file that network file systems honour too (one left by a killed writer is taken
    over after ``lock_grace_s``)."""
    optuna = import_optuna()
    if "://" in spec:
        return optuna.storages.RDBStorage(spec)
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    path = Path(spec).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = JournalFileOpenLock(str(path), grace_period=max(1, round(lock_grace_s)))
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=lock))


def make_sampler(name: str, space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """The sampler ``--evolve-sampler`` names; ``seed`` is the trial's own (see ``Search.ask``)."""
    optuna = import_optuna()
    if name == "genetic":
        from utils.search.sampler import GeneticSampler

        return GeneticSampler(space, seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CMA-ES sampler needs it)
        except ImportError as e:
            raise UserError("--evolve-sampler cmaes needs the cmaes package (pip install cmaes)") from e
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    raise UserError(f"--evolve-sampler {name}: not a sampler (choose from {', '.join(SAMPLERS)})")


def make_pruner(config: SearchConfig) -> optuna.pruners.BasePruner:
    optuna = import_optuna()
    if config.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=config.prune_startup, n_warmup_steps=config.prune_warmup)
    if config.pruner == "none":
        return optuna.pruners.NopPruner()
    raise UserError(f"--evolve-pruner {config.pruner}: not a pruner (choose from {', '.join(PRUNERS)})")


def trial_seed(seed: int, number: int) -> int:
    """A sampler seed of its own for every trial: workers that share a seed still draw different trials."""
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


class SearchTrial:
    """One running trial: its hyp, its pruning decisions, its end; beats its heartbeat until it ends."""

    def __init__(self, search: Search, trial: Any):
        self.search, self.trial = search, trial
        self.hyp: HypRecord = search.space.base  # drawn by Search.ask once the trial beats
        self.number: int = trial.number
        self.name = f"trial{trial.number}"  # its run folder in the evolution folder
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{self.name}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(self.search.config.heartbeat_s):
            try:
                self.trial.set_user_attr(HEARTBEAT_ATTR, time.time())
            except Exception as e:  # a storage hiccup: the next beat tries again
                if not warned:
                    LOGGER.warning(f"WARNING {self.name}: heartbeat not recorded ({e.__class__.__name__}: {e})")
                    warned = True

    def _end(self) -> bool:
        """Stop beating; False when another worker already marked the trial failed (it stopped beating)."""
        self._stop.set()
        self._beat.join()
        from optuna.trial import TrialState

        state = self.search.storage.get_trial(self.trial._trial_id).state
        if state == TrialState.RUNNING:
            return True
        LOGGER.warning(
            f"WARNING {self.name} was marked {state.name.lower()} meanwhile (no heartbeat for "
            f"{self.search.config.stale_s:.0f} s): its end is not recorded"
        )
        return False

    def report(self, epoch: int, fitness_value: float) -> bool:
        """Record an epoch's fitness; True when the trial is clearly worse than the others and should stop."""
        self.trial.report(float(fitness_value), int(epoch))
        return bool(self.trial.should_prune())

    def complete(self, results: tuple[float, ...]) -> None:
        """Record the trial's validation results (evolve.csv's first columns); its value is their fitness."""
        if self._end():
            from optuna.trial import TrialState

            self.trial.set_user_attr("results", [float(v) for v in results])
            self.search.study.tell(
                self.trial, float(np.asarray(fitness(np.array(results[:4]))).reshape(-1)[0]), state=TrialState.COMPLETE
            )

    def prune(self) -> None:
        if self._end():
            from optuna.trial import TrialState

            self.search.study.tell(self.trial, state=TrialState.PRUNED)

    def fail(self, reason: str) -> None:
        if self._end():
            from optuna.trial import TrialState

            self.trial.set_user_attr(FAILED_ATTR, reason)
            self.search.study.tell(self.trial, state=TrialState.FAIL)


class Search:
    """A worker's handle on the study: the next trial to train, failing dead workers' trials, the records."""

    def __init__(self, config: SearchConfig, space: SearchSpace, completed: np.ndarray | None = None):
        """Join (or start) the study; ``completed``: evolve.csv rows that a new study takes as its first trials."""
        optuna = import_optuna()
        if config.n_trials < 1:
            raise UserError(f"--evolve {config.n_trials}: give the number of trials, at least 1 (e.g. --evolve 30)")
        make_sampler(config.sampler, space, config.seed)  # an unknown name or a missing package, before anything
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the study's progress is this project's log's to tell
        self.config, self.space = config, space
        self.storage = open_storage(config.storage_name(), config.lock_grace_s)
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=config.study_name,
            direction="maximize",
            sampler=make_sampler(config.sampler, space, config.seed),
            pruner=make_pruner(config),
            load_if_exists=True,
        )
        if completed is not None and len(completed) and not self.study.trials:
            self._add_completed(completed)
        self._check_space()
        self.worker = worker_name()
        self._waiting_said = False

    def _add_completed(self, rows: np.ndarray) -> None:
        """evolve.csv's rows as completed trials, in order (trial n is row n, as generation n was)."""
        from optuna.trial import TrialState, create_trial

        distributions, n = self.space.distributions(), self.space.n_results
        for row in rows:
            values = dict(zip(self.space.keys, map(float, row[n:])))
            params = {k: values[k] for k, d in distributions.items() if d.low <= values[k] <= d.high}
            score = float(np.asarray(fitness(np.array(row[:4]))).reshape(-1)[0])
            attrs = {
                "results": [float(v) for v in row[:n]],
                "hyp": self.space.base.replace(**values).to_dict(),
                WORKER_ATTR: "evolve.csv",
            }
            self.study.add_trial(
                create_trial(
                    state=TrialState.COMPLETE,
                    value=score,
                    params=params,
                    distributions={k: distributions[k] for k in params},
                    user_attrs=attrs,
                )
            )
        LOGGER.info(f"evolve: the study starts from {len(rows)} completed trials of evolve.csv")

    def _check_space(self) -> None:
        recorded = self.study.user_attrs.get(SPACE_ATTR)
        if recorded is None:
            self.study.set_user_attr(SPACE_ATTR, self.space.describe())
            if self.config.sampler != "genetic" and not self.study.trials:  # the first trial trains the base hyp
                base = self.space.base.to_dict()
                self.study.enqueue_trial({k: base[k] for k in self.space.distributions()})
        elif recorded != self.space.describe():
            raise UserError(
                f"{self.config.storage_name()}: study '{self.config.study_name}' searches other "
                f"hyper-parameters ({', '.join(recorded.get('keys', []))}); give another "
                f"--evolve-storage or --name"
            )

    def counts(self) -> tuple[int, int]:
        """(finished, under way): completed or pruned trials; running or waiting ones."""
        from optuna.trial import TrialState

        states = [t.state for t in self.study.get_trials(deepcopy=False)]
        finished = sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states)
        return finished, sum(s in (TrialState.RUNNING, TrialState.WAITING) for s in states)

    def fail_stale(self) -> list[int]:
        """Mark failed every running trial whose heartbeat is older than ``stale_s``; their numbers."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        failed, now = [], time.time()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            last = t.user_attrs.get(HEARTBEAT_ATTR) or (t.datetime_start.timestamp() if t.datetime_start else now)
            if now - last <= self.config.stale_s:
                continue
            with contextlib.suppress(UpdateFinishedTrialError):  # another worker was quicker
                reason = f"no heartbeat from {t.user_attrs.get(WORKER_ATTR, '?')} for {now - last:.0f} s"
                self.storage.set_trial_user_attr(t._trial_id, FAILED_ATTR, reason)
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                LOGGER.warning(f"WARNING trial {t.number} marked failed: {reason}")
                failed.append(t.number)
        return failed

    def next_trial(self) -> SearchTrial | None:
        """The next trial for this worker; None once N trials have finished. Waits while the last ones run."""
        while True:
            self.fail_stale()
            finished, under_way = self.counts()
            if finished >= self.config.n_trials:
                return None
            if finished + under_way >= self.config.n_trials:
                self._say_waiting(finished, under_way)
                time.sleep(self.config.poll_s)
                continue
            trial = self.ask()
            if trial is not None:
                return trial

    def _say_waiting(self, finished: int, under_way: int) -> None:
        if not self._waiting_said:
            LOGGER.info(
                f"evolve: {finished} of {self.config.n_trials} trials finished and {under_way} under way "
                f"elsewhere; waiting for them (a trial whose worker stops for {self.config.stale_s:.0f} s "
                f"is run again)"
            )
            self._waiting_said = True

    def ask(self) -> SearchTrial | None:
        """A new trial, its hyp drawn by the sampler; None when other workers claimed the last places first."""
        from optuna.trial import TrialState

        trial = self.study.ask()
        claimed = sum(
            t.number < trial.number and t.state != TrialState.FAIL for t in self.study.get_trials(deepcopy=False)
        )
        if claimed >= self.config.n_trials:  # workers asked at once: trial numbers decide who runs the last ones
            trial.set_user_attr(FAILED_ATTR, f"not needed: {self.config.n_trials} trials were under way")
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        for key, value in {
            WORKER_ATTR: self.worker,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            HEARTBEAT_ATTR: time.time(),
        }.items():
            trial.set_user_attr(key, value)
        running = SearchTrial(self, trial)  # beating from here on: drawing a hyp may take a while
        try:
            running.hyp = self._draw(trial)
            trial.set_user_attr("hyp", running.hyp.to_dict())
        except BaseException as e:
            running.fail(f"drawing its hyper-parameters failed ({e.__class__.__name__}: {e})")
            raise
        return running

    def _draw(self, trial: Any) -> HypRecord:
        """The trial's hyp from the sampler, seeded for this trial."""
        genetic = self.config.sampler == "genetic"
        sampler = make_sampler(
            self.config.sampler, self.space, self.config.seed if genetic else trial_seed(self.config.seed, trial.number)
        )
        self.study.sampler = sampler
        for key, dist in self.space.distributions().items():
            trial.suggest_float(key, dist.low, dist.high, log=dist.log)
        if genetic:
            genetic_sampler = cast("GeneticSampler", sampler)
            return genetic_sampler.drawn.pop(trial.number, None) or genetic_sampler.hyp_for(self.study, trial.number)
        return self.space.hyp_of(trial.params)

    def write_records(self, plot: bool = False) -> Path | None:
        """evolve.csv and hyp_evolve.yaml (and evolve.png with ``plot``) from the completed trials, in trial
        order, in YOLOv5's columns; None while no trial has completed."""
        from optuna.trial import TrialState

        from utils.search.sampler import evolve_rows

        done = sorted(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number)
        done = [t for t in done if "results" in t.user_attrs and "hyp" in t.user_attrs]
        if not done:
            return None
        folder, keys = Path(self.config.folder), list(self.space.keys)
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_output(folder / "evolve.csv") as tmp:
            tmp.unlink()
            for t in done:
                append_evolve_row(tmp, t.user_attrs["results"], t.user_attrs["hyp"], keys, self.space.loss_names)
        rows = evolve_rows(done, self.space)
        # hyp_evolve.yaml names itself: written under its own name in a folder of this worker's, then moved
        staging = folder / f".records-{socket.gethostname()}-{os.getpid()}"
        staging.mkdir(exist_ok=True)
        write_best_hyp(rows, keys, self.space.base, staging / "hyp_evolve.yaml", self.space.n_results)
        os.replace(staging / "hyp_evolve.yaml", folder / "hyp_evolve.yaml")
        staging.rmdir()
        if plot:
            from utils.search.records import plot_evolve

            plot_evolve(rows, keys, folder / "evolve.png", self.space.n_results)
        return folder / "evolve.csv"
