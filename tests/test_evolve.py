"""--evolve through train.py: YOLOv5's genetic operations inside the limits, a study of trials recorded in evolve.csv
and continued from its folder, and trained by every rank of a distributed worker (the study itself, its workers and
samplers: tests/test_search.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml
from conftest import write_rectangles_dataset

from models.families import YOLOV5
from utils.hyp import EVOLVE_LIMITS
from utils.search.genetic import mutate, next_hyp, select_parent
from utils.search.records import append_evolve_row, read_evolve_csv

BASE = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
KEYS = YOLOV5.evolve_keys(BASE)
LOSS_NAMES = YOLOV5.loss_names
LIMITS = YOLOV5.evolve_limits
N_RESULTS = 4 + len(LOSS_NAMES)
# Short runs' --optimizer auto is AdamW, which sets its own lr0 and momentum: --evolve leaves them alone.
LIMITS_UNDER_ADAMW = {
    k: dataclasses.replace(v, scale=0.0) if k in ("lr0", "momentum") else v for k, v in LIMITS.items()
}


def _row(score: float, hyp) -> np.ndarray:
    return np.array([0.5, 0.5, score, score, 0.1, 0.1, 0.1, *(hyp.to_dict()[k] for k in KEYS)])


def test_mutation_stays_inside_every_limit_and_leaves_fixed_values_alone() -> None:
    # Parents at both ends of every range: mutation must clip them back in.
    lows = BASE.replace(**{k: LIMITS[k].low for k in KEYS})
    highs = BASE.replace(**{k: LIMITS[k].high for k in KEYS})
    rng = np.random.default_rng(0)
    changed = set()
    for parent in (BASE, lows, highs):
        values = np.array([parent.to_dict()[k] for k in KEYS])
        for _ in range(200):
            child = mutate(values, KEYS, rng, LIMITS)
            for k, v in child.items():
                assert LIMITS[k].low <= v <= LIMITS[k].high, (k, v)
                if LIMITS[k].scale == 0:
                    assert v == parent.to_dict()[k], k
                elif v != parent.to_dict()[k]:
                    changed.add(k)
    # Every value with a mutation scale moved at some point (those that are non-zero in some parent).
    assert changed == {k for k in KEYS if EVOLVE_LIMITS[k].scale > 0}


def test_parents_come_from_the_best_rows_and_a_trial_is_repeatable() -> None:
    rows = np.stack([_row(0.01 * i, BASE.replace(lr0=0.001 * (i + 1))) for i in range(10)])
    picked = {round(select_parent(rows, N_RESULTS, np.random.default_rng(s))[KEYS.index("lr0")], 6) for s in range(50)}
    assert picked <= {0.006, 0.007, 0.008, 0.009, 0.010} and len(picked) > 1  # drawn among the 5 best
    a = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 10]), LIMITS, N_RESULTS)
    b = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 10]), LIMITS, N_RESULTS)
    assert a == b and a != BASE and type(a) is type(BASE)  # the family's own record
    assert next_hyp(BASE, rows[:0], KEYS, np.random.default_rng(0), LIMITS, N_RESULTS) == BASE  # trial 0: the base


def test_evolve_csv_round_trip_any_number_of_loss_terms_and_wrong_columns(tmp_path) -> None:
    from utils.errors import UserError

    csv_file = tmp_path / "evolve.csv"
    append_evolve_row(csv_file, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7), BASE.to_dict(), KEYS, LOSS_NAMES)
    append_evolve_row(csv_file, (0.2, 0.2, 0.3, 0.5, 0.5, 0.6, 0.7), BASE.replace(lr0=0.02).to_dict(), KEYS, LOSS_NAMES)
    rows = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert rows.shape == (2, N_RESULTS + len(KEYS))
    assert rows[1, N_RESULTS + KEYS.index("lr0")] == 0.02
    with pytest.raises(UserError, match="not an evolve.csv"):
        read_evolve_csv(csv_file, KEYS[:-1], LOSS_NAMES)
    two_terms = tmp_path / "two.csv"  # a loss of two terms: six results, parents read after them
    append_evolve_row(two_terms, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6), {"lr0": 0.01}, ["lr0"], ("box", "cls"))
    rows = read_evolve_csv(two_terms, ["lr0"], ("box", "cls"))
    assert rows.shape == (1, 7) and select_parent(rows, 6, np.random.default_rng(0)).tolist() == [0.01]
    with pytest.raises(ValueError, match="expected 6 validation results"):
        append_evolve_row(two_terms, (0.1,) * 7, {"lr0": 0.01}, ["lr0"], ("box", "cls"))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return write_rectangles_dataset(tmp_path_factory.mktemp("small"), n_train=8, n_val=4)


def _study(folder):
    import optuna

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.journal")))
    return optuna.load_study(study_name=folder.name, storage=storage)


@pytest.mark.slow
def test_evolve_one_trial_then_continue_the_study_to_two(train_here, small_data, tmp_path) -> None:
    common = ("--data", small_data, "--epochs", "1", "--project", tmp_path / "evolve", "--name", "ev")
    status, log = train_here(*common, "--evolve", "1")
    assert status == 0, log
    folder = tmp_path / "evolve/ev"
    csv_file = folder / "evolve.csv"
    rows = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert len(rows) == 1
    assert sorted(p.name for p in folder.glob("trial*")) == ["trial0"]
    assert (folder / "evolve.png").stat().st_size > 0 and (folder / "study.journal").is_file()
    best = yaml.safe_load((folder / "hyp_evolve.yaml").read_text())
    assert YOLOV5.read_hyp(best) is not None and set(best) == set(KEYS)
    np.testing.assert_allclose(rows[0, N_RESULTS:], [BASE.to_dict()[k] for k in KEYS], rtol=1e-4)

    status, log = train_here(*common, "--evolve", "2", "--resume_evolve", csv_file)  # YOLOv5's spelling, its csv
    assert status == 0, log
    more = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert len(more) == 2 and np.array_equal(more[:1], rows)
    # Trial 1 is what (seed, 1) and the first row give: the same as an uninterrupted search.
    # A 1-epoch run's --optimizer auto is AdamW, which sets its own lr0 and momentum: they are not searched.
    assert "evolve: lr0 and momentum not searched" in log, log
    expected = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 1]), LIMITS_UNDER_ADAMW, N_RESULTS)
    assert expected != BASE and (expected.lr0, expected.momentum) == (BASE.lr0, BASE.momentum)
    np.testing.assert_allclose(more[1, N_RESULTS:], [expected.to_dict()[k] for k in KEYS], rtol=1e-4)
    assert (
        sorted(p.name for p in folder.glob("trial*")) == ["trial0", "trial1"] and not (tmp_path / "evolve/ev2").exists()
    )
    # Each trial reported its validated epoch to the pruner: the fitness evolve.csv's row gives.
    trials = _study(folder).get_trials()
    assert [t.intermediate_values.keys() for t in trials] == [{0}, {0}]
    np.testing.assert_allclose(
        [t.intermediate_values[0] for t in trials], 0.1 * more[:, 2] + 0.9 * more[:, 3], rtol=1e-4, atol=1e-6
    )

    status, log = train_here(*common, "--evolve", "2", "--resume-evolve", folder)
    assert status == 0 and "study 'ev' already has 2 finished trials (--evolve 2): nothing to train" in log, log
    assert len(_study(folder).get_trials()) == 2  # nothing more to train


@pytest.mark.slow
def test_evolve_under_two_gloo_ranks_trains_each_trial_together(small_data, tmp_path) -> None:
    from conftest import main_on_ranks

    import train

    argv = [
        "--data",
        str(small_data),
        "--epochs",
        "1",
        "--imgsz",
        "64",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--noautoanchor",
        "--device",
        "cpu",
        "--project",
        str(tmp_path / "evolve"),
        "--name",
        "ev",
        "--evolve",
        "2",
    ]
    codes, outputs = main_on_ranks(train.main, argv, 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    assert "world size 2" in outputs[0]
    assert sorted(p.name for p in (tmp_path / "evolve").iterdir()) == ["ev"]  # one folder, made by rank 0
    rows = read_evolve_csv(tmp_path / "evolve/ev/evolve.csv", KEYS, LOSS_NAMES)
    assert len(rows) == 2  # each trial recorded once, not once per rank
    np.testing.assert_allclose(rows[0, N_RESULTS:], [BASE.to_dict()[k] for k in KEYS], rtol=1e-4)
    expected = next_hyp(BASE, rows[:1], KEYS, np.random.default_rng([0, 1]), LIMITS_UNDER_ADAMW, N_RESULTS)
    np.testing.assert_allclose(rows[1, N_RESULTS:], [expected.to_dict()[k] for k in KEYS], rtol=1e-4)
    assert len({t.user_attrs["pid"] for t in _study(tmp_path / "evolve/ev").get_trials()}) == 1  # rank 0 asked


def test_a_trial_that_falls_behind_is_pruned_after_its_warmup_epoch_and_not_recorded(tmp_path, monkeypatch) -> None:
    """The engine's side of pruning, with training replaced by a fitness curve: trials validate every epoch, report
    it, stop when the pruner says so, and end PRUNED; evolve.csv holds the completed ones."""
    import types

    import torch

    import train
    import utils.engine.evolve as evolution
    import utils.search.records as records
    from utils.distributed import DistInfo

    epochs_seen = []

    def fake_train(config, device, info, resumed, hyp=None, on_validated=None):
        assert not config.noval  # the pruner judges every epoch
        number = int(config.name.removeprefix("trial"))
        curve = [0.01, 0.01, 0.01] if number == 6 else [0.2, 0.3, 0.4]  # trial 6 learns nothing
        for epoch, value in enumerate(curve):
            epochs_seen.append((number, epoch))
            if on_validated(epoch, (0.5, 0.5, value, value, 0.1, 0.1, 0.1)):
                break
        return types.SimpleNamespace(results=(0.5, 0.5, value, value, 0.1, 0.1, 0.1))

    monkeypatch.setattr(evolution, "train", fake_train)
    monkeypatch.setattr(records, "plot_evolve", lambda *a: None)
    launch = train.make_launch(*train.parse_opt(["--evolve", "7", "--project", str(tmp_path), "--name", "ev"]))
    folder = evolution.evolve(launch.config, torch.device("cpu"), DistInfo(rank=-1, local_rank=-1, world_size=1))
    assert [e for n, e in epochs_seen if n == 6] == [0, 1]  # never in its first epoch; at once after it
    assert len(epochs_seen) == 6 * 3 + 2
    import optuna

    states = [t.state for t in _study(folder).get_trials()]
    assert states == [optuna.trial.TrialState.COMPLETE] * 6 + [optuna.trial.TrialState.PRUNED]
    family, space = evolution.search_space(launch.config, DistInfo(rank=-1, local_rank=-1, world_size=1))
    assert len(read_evolve_csv(folder / "evolve.csv", space.keys, family.loss_names)) == 6
