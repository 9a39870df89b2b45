"""--evolve: mutation inside the limits, generations recorded in evolve.csv, continued from it."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest import write_rectangles_dataset

from models.families import YOLOV5
from utils.engine.evolve import (N_RESULTS, append_evolve_row, mutate, next_hyp, read_evolve_csv,
                          select_parent)
from utils.hyp import EVOLVE_LIMITS, Hyp

BASE = Hyp()
KEYS = YOLOV5.evolve_keys(BASE)
LOSS_NAMES = YOLOV5.loss_names


def _row(score: float, hyp: Hyp) -> np.ndarray:
    return np.array([0.5, 0.5, score, score, 0.1, 0.1, 0.1, *(hyp.to_dict()[k] for k in KEYS)])


def test_mutation_stays_inside_every_limit_and_leaves_fixed_values_alone() -> None:
    # Parents at both ends of every range: mutation must clip them back in.
    lows = BASE.replace(**{k: EVOLVE_LIMITS[k].low for k in KEYS})
    highs = BASE.replace(**{k: EVOLVE_LIMITS[k].high for k in KEYS})
    rng = np.random.default_rng(0)
    changed = set()
    for parent in (BASE, lows, highs):
        values = np.array([parent.to_dict()[k] for k in KEYS])
        for _ in range(200):
            child = mutate(values, KEYS, rng)
            for k, v in child.items():
                assert EVOLVE_LIMITS[k].low <= v <= EVOLVE_LIMITS[k].high, (k, v)
                if EVOLVE_LIMITS[k].scale == 0:
                    assert v == parent.to_dict()[k], k
                elif v != parent.to_dict()[k]:
                    changed.add(k)
    # Every value with a mutation scale moved at some point (those that are non-zero in some parent).
    assert changed == {k for k in KEYS if EVOLVE_LIMITS[k].scale > 0}


def test_parents_come_from_the_best_rows_and_a_generation_is_repeatable() -> None:
    rows = np.stack([_row(0.01 * i, BASE.replace(lr0=0.001 * (i + 1))) for i in range(10)])
    picked = {round(select_parent(rows, np.random.default_rng(s))[KEYS.index("lr0")], 6) for s in range(50)}
    assert picked <= {0.006, 0.007, 0.008, 0.009, 0.010} and len(picked) > 1  # drawn among the 5 best
    a = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 10]))
    b = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 10]))
    assert a == b and a != BASE
    assert next_hyp(BASE, rows[:0], KEYS, np.random.default_rng(0)) == BASE  # generation 0 trains the base


def test_evolve_csv_round_trip_and_wrong_columns(tmp_path) -> None:
    csv_file = tmp_path / "evolve.csv"
    append_evolve_row(csv_file, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7), BASE, KEYS, LOSS_NAMES)
    append_evolve_row(csv_file, (0.2, 0.2, 0.3, 0.5, 0.5, 0.6, 0.7), BASE.replace(lr0=0.02), KEYS, LOSS_NAMES)
    rows = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert rows.shape == (2, N_RESULTS + len(KEYS))
    assert rows[1, N_RESULTS + KEYS.index("lr0")] == 0.02
    from utils.errors import UserError

    with pytest.raises(UserError, match="not an evolve.csv"):
        read_evolve_csv(csv_file, KEYS[:-1], LOSS_NAMES)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return write_rectangles_dataset(tmp_path_factory.mktemp("small"), n_train=8, n_val=4)


@pytest.mark.slow
def test_evolve_one_generation_then_continue_to_two(train_here, small_data, tmp_path) -> None:
    common = ("--data", small_data, "--epochs", "1", "--project", tmp_path / "evolve", "--name", "ev")
    status, log = train_here(*common, "--evolve", "1")
    assert status == 0, log
    folder = tmp_path / "evolve/ev"
    csv_file = folder / "evolve.csv"
    rows = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert len(rows) == 1
    assert sorted(p.name for p in folder.glob("gen*")) == ["gen0"]
    assert (folder / "evolve.png").stat().st_size > 0
    best = yaml.safe_load((folder / "hyp_evolve.yaml").read_text())
    assert Hyp.from_dict(best) is not None and set(best) == set(KEYS)
    np.testing.assert_allclose(rows[0, N_RESULTS:], [BASE.to_dict()[k] for k in KEYS], rtol=1e-4)

    status, log = train_here(*common, "--evolve", "2", "--resume_evolve", csv_file)  # YOLOv5's spelling
    assert status == 0, log
    more = read_evolve_csv(csv_file, KEYS, LOSS_NAMES)
    assert len(more) == 2 and np.array_equal(more[:1], rows)
    # Generation 1 is what (seed, 1) and the first row give: the same as an uninterrupted evolution.
    expected = next_hyp(BASE, rows, KEYS, np.random.default_rng([0, 1]))
    assert expected != BASE
    np.testing.assert_allclose(more[1, N_RESULTS:], [expected.to_dict()[k] for k in KEYS], rtol=1e-4)
    assert sorted(p.name for p in folder.glob("gen*")) == ["gen0", "gen1"] and not (tmp_path / "evolve/ev2").exists()

    status, log = train_here(*common, "--evolve", "2", "--resume-evolve", csv_file)
    assert status == 0 and "already holds 2 generations" in log


@pytest.mark.slow
def test_evolve_under_two_gloo_ranks_trains_each_generation_together(small_data, tmp_path) -> None:
    import train
    from conftest import main_on_ranks

    argv = ["--data", str(small_data), "--epochs", "1", "--imgsz", "64", "--batch-size", "8", "--workers", "0",
            "--noautoanchor", "--device", "cpu", "--project", str(tmp_path / "evolve"), "--name", "ev", "--evolve", "2"]
    codes, outputs = main_on_ranks(train.main, argv, 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    assert "world size 2" in outputs[0]
    assert sorted(p.name for p in (tmp_path / "evolve").iterdir()) == ["ev"]  # one folder, made by rank 0
    rows = read_evolve_csv(tmp_path / "evolve/ev/evolve.csv", KEYS, LOSS_NAMES)
    assert len(rows) == 2  # each generation recorded once, not once per rank
    np.testing.assert_allclose(rows[0, N_RESULTS:], [BASE.to_dict()[k] for k in KEYS], rtol=1e-4)
    expected = next_hyp(BASE, rows[:1], KEYS, np.random.default_rng([0, 1]))
    np.testing.assert_allclose(rows[1, N_RESULTS:], [expected.to_dict()[k] for k in KEYS], rtol=1e-4)
