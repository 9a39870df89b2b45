"""Hyper-parameter search on one Optuna study: YOLOv5's genetic evolution as a sampler, several workers at once,
a worker killed mid-trial, pruning. A cheap objective stands in for training, so these take seconds."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import optuna  # a test requirement: missing, this module fails rather than skips
import pytest
import yaml
from optuna.trial import TrialState

from models.families import YOLO11, YOLOV5
from tests.fixtures.evolve.make_evolve_fixture import SEED, fixture_path, pretend_results
from utils.errors import UserError
from utils.search import Search, SearchConfig, SearchSpace
from utils.search.records import read_evolve_csv

BASE = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
KEYS = YOLOV5.evolve_keys(BASE)
SPACE = SearchSpace(BASE, tuple(KEYS), YOLOV5.evolve_limits, YOLOV5.loss_names)


def results_of(hyp) -> tuple[float, ...]:
    """Validation results of a pretend training (the one the committed evolve.csv fixtures were made with)."""
    return pretend_results(hyp.to_dict())


def fast(folder: Path, n: int, **changes) -> SearchConfig:
    # A worker killed while its heartbeat writes to the journal leaves the lock file: taken over after 1 s here.
    return SearchConfig(
        folder,
        n,
        **{"heartbeat_s": 0.2, "stale_s": 5.0, "poll_s": 0.1, "pruner": "none", "lock_grace_s": 1.0, **changes},
    )


def trials_of(folder: Path, name: str = "evolve") -> list:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.journal")))
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


@pytest.mark.parametrize("family", [YOLOV5, YOLO11], ids=lambda f: f.name)
def test_genetic_default_draws_yolov5s_generations_and_writes_its_evolve_csv(tmp_path, family) -> None:
    """One worker and a seed draw, trial by trial, the generations YOLOv5's evolution drew (generation by
    generation, as the committed fixture recorded them: tests/fixtures/evolve/make_evolve_fixture.py), and write
    the same evolve.csv byte for byte."""
    reference = fixture_path(family.name)
    base = family.read_hyp(family.default_hyp_path)
    keys = tuple(family.evolve_keys(base))
    space = SearchSpace(base, keys, family.evolve_limits, family.loss_names)
    n = len(reference.read_text().splitlines()) - 1
    search = Search(fast(tmp_path / "study", n, seed=SEED), space)
    drawn = []
    while (trial := search.next_trial()) is not None:
        drawn.append(trial.hyp)
        trial.complete(results_of(trial.hyp))
        search.write_records()
    written = tmp_path / "study/evolve.csv"
    assert written.read_text() == reference.read_text()  # the same hyper-parameters, trial n for generation n
    assert len({tuple(sorted(h.to_dict().items())) for h in drawn}) == n and type(drawn[0]) is family.hyp_type
    best = yaml.safe_load((tmp_path / "study/hyp_evolve.yaml").read_text())
    assert family.read_hyp(best) in drawn
    workers = {t.user_attrs["worker"] for t in trials_of(tmp_path / "study")}
    assert workers == {f"{socket.gethostname()}:{os.getpid()}"}


def test_a_study_started_from_an_evolve_csv_draws_its_next_generation(tmp_path) -> None:
    """An evolve.csv without a study (YOLOv5's record): its rows become completed trials 0..k-1, and trial k draws
    what YOLOv5's generation k drew from them."""
    rows = read_evolve_csv(fixture_path("yolov5"), KEYS, YOLOV5.loss_names)
    search = Search(fast(tmp_path / "study", 9, seed=SEED), SPACE, completed=rows[:7])
    trial = search.next_trial()
    assert trial.number == 7
    np.testing.assert_array_equal([trial.hyp.to_dict()[k] for k in KEYS], rows[7, 7:])
    imported = trials_of(tmp_path / "study")[:7]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["worker"] == "evolve.csv" for t in imported)
    np.testing.assert_allclose([t.value for t in imported], 0.1 * rows[:7, 2] + 0.9 * rows[:7, 3])
    trial.fail("test")


def test_a_loss_of_two_terms_searches_and_records_six_results(tmp_path) -> None:
    space = SearchSpace(BASE, ("lr0", "momentum"), YOLOV5.evolve_limits, ("box", "cls"))
    search = Search(fast(tmp_path / "study", 3, seed=1), space)
    while (trial := search.next_trial()) is not None:
        trial.complete(results_of(trial.hyp)[:6])
        search.write_records(plot=True)
    rows = read_evolve_csv(tmp_path / "study/evolve.csv", ["lr0", "momentum"], ("box", "cls"))
    assert rows.shape == (3, 8) and len({tuple(r) for r in rows[:, 6:]}) == 3
    assert (tmp_path / "study/evolve.png").stat().st_size > 0


def _worker(config: SearchConfig, block_trial: int = -1, marker: Path | None = None) -> int:
    search = Search(config, SPACE)
    while (trial := search.next_trial()) is not None:
        for epoch in range(3):
            time.sleep(0.03)
            trial.report(epoch, results_of(trial.hyp)[3])
        if trial.number == block_trial:
            marker.write_text(str(os.getpid()))
            time.sleep(600)  # killed here
        trial.complete(results_of(trial.hyp))
        search.write_records()
    return 0


def _start(config: SearchConfig, **kwargs) -> multiprocessing.Process:
    process = multiprocessing.get_context("fork").Process(target=lambda: os._exit(_worker(config, **kwargs)))
    process.start()
    return process


def _wait(processes: list[multiprocessing.Process], timeout: float = 60) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.exitcode is None:
            p.kill()
            p.join()
    return [p.exitcode for p in processes]


@pytest.mark.slow
def test_two_workers_share_one_study_and_finish_exactly_n_trials(tmp_path) -> None:
    config = fast(tmp_path / "ev", 8, seed=1)
    workers = [_start(config), _start(config)]
    assert _wait(workers) == [0, 0]
    trials = trials_of(tmp_path / "ev")
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 8
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    pids = {t.user_attrs["pid"] for t in finished}
    assert pids == {w.pid for w in workers}  # both took trials
    assert all(t.user_attrs["host"] == socket.gethostname() for t in finished)
    rows = read_evolve_csv(tmp_path / "ev/evolve.csv", KEYS, YOLOV5.loss_names)
    assert len(rows) == 8
    assert len({tuple(r) for r in rows[:, 7:]}) == 8  # every trial its own hyper-parameters


@pytest.mark.slow
def test_a_killed_workers_trial_is_failed_and_a_restarted_study_finishes_n(tmp_path) -> None:
    config = fast(tmp_path / "ev", 5, seed=2, stale_s=1.0)
    marker = tmp_path / "blocked"
    first = _start(config, block_trial=2, marker=marker)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the first worker never reached trial 2"
    os.kill(first.pid, signal.SIGKILL)  # every worker of the study is gone, trial 2 RUNNING
    assert _wait([first]) == [-signal.SIGKILL]
    assert [t.state for t in trials_of(tmp_path / "ev")][:3] == [
        TrialState.COMPLETE,
        TrialState.COMPLETE,
        TrialState.RUNNING,
    ]
    (tmp_path / "ev/study.journal.lock").touch()  # as a worker killed while writing leaves it (taken over after 1 s)
    second = _start(config)  # the study restarted: it waits out trial 2's heartbeat, fails it, finishes
    assert _wait([second]) == [0]
    trials = trials_of(tmp_path / "ev")
    dead = trials[2]
    assert dead.state == TrialState.FAIL
    assert dead.user_attrs["failed"].startswith(f"no heartbeat from {socket.gethostname()}:{first.pid}")
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 5
    assert {t.user_attrs["pid"] for t in finished} == {first.pid, second.pid}
    assert len(read_evolve_csv(tmp_path / "ev/evolve.csv", KEYS, YOLOV5.loss_names)) == 5


def test_pruning_stops_a_trial_that_is_clearly_worse(tmp_path) -> None:
    search = Search(fast(tmp_path / "ev", 5, pruner="median", prune_startup=3, prune_warmup=1), SPACE)
    stopped_at = {}
    while (trial := search.next_trial()) is not None:
        curve = [0.01] * 5 if trial.number == 3 else [0.2, 0.3, 0.4, 0.45, 0.5]  # trial 3 learns nothing
        for epoch, value in enumerate(curve):
            if trial.report(epoch, value):
                stopped_at[trial.number] = epoch
                trial.prune()
                break
        else:
            trial.complete((0.5, 0.5, 0.55, curve[-1], 0.1, 0.1, 0.1))
        search.write_records()
    assert stopped_at == {3: 1}  # after the warmup epoch, and only the bad one
    states = [t.state for t in search.study.trials]
    assert states.count(TrialState.PRUNED) == 1 and states.count(TrialState.COMPLETE) == 4  # 5 finished
    assert len(read_evolve_csv(tmp_path / "ev/evolve.csv", KEYS, YOLOV5.loss_names)) == 4


@pytest.mark.parametrize("sampler", ["tpe", "cmaes"])
def test_optuna_samplers_start_from_the_base_and_stay_inside_the_limits(tmp_path, sampler) -> None:
    search = Search(fast(tmp_path / sampler, 4, sampler=sampler, seed=0), SPACE)
    drawn = []
    while (trial := search.next_trial()) is not None:
        drawn.append(trial.hyp)
        trial.complete(results_of(trial.hyp))
    assert drawn[0] == BASE  # the first trial trains the hyp file's values, as the genetic default does
    for hyp in drawn[1:]:
        values = hyp.to_dict()
        assert hyp != BASE
        for key in SPACE.searched:
            low, high = SPACE.bounds(key)
            assert low <= values[key] <= high, (key, values[key])
        for key in set(KEYS) - set(SPACE.searched):
            assert values[key] == BASE.to_dict()[key], key  # scale 0: never moved


def test_a_study_of_other_hyper_parameters_and_unknown_names_are_one_line_errors(tmp_path) -> None:
    Search(fast(tmp_path / "ev", 2), SPACE)
    other = SearchSpace(BASE, tuple(KEYS[:-1]), YOLOV5.evolve_limits, YOLOV5.loss_names)
    with pytest.raises(UserError, match="searches other hyper-parameters"):
        Search(fast(tmp_path / "ev", 2), other)
    with pytest.raises(UserError, match="--evolve-sampler grid: not a sampler"):
        Search(fast(tmp_path / "ev2", 2, sampler="grid"), SPACE)
    with pytest.raises(UserError, match="at least 1"):
        Search(fast(tmp_path / "ev3", 0), SPACE)
