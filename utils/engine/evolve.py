"""--evolve: hyper-parameter evolution, generation by generation, recorded in evolve.csv.

A generation mutates a parent chosen from the best rows of evolve.csv (the first generation trains the base
hyper-parameters as given), trains, and appends its validation results and hyper-parameters as one row.
Mutation scales and bounds are the model family's (``utils.hyp.EVOLVE_LIMITS`` for YOLOv5); everything here
is a pure function of its arguments (the caller passes ``np.random.default_rng([seed, generation])``), so a
generation is repeatable.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml

from utils.errors import UserError
from utils.hyp import EVOLVE_LIMITS, Hyp, Limit
from utils.metrics import fitness
from utils.results_log import METRIC_COLUMNS

N_RESULTS = 7  # a row's validation results: P, R, mAP50, mAP50-95 and the three validation losses
N_PARENTS = 5  # parents are drawn from this many best rows
MUTATION_PROBABILITY = 0.8  # per hyper-parameter
MUTATION_SIGMA = 0.2


def result_keys(loss_names: tuple[str, str, str]) -> tuple[str, ...]:
    """The names of a row's validation results, for a loss with these three terms (the model family's)."""
    return (*METRIC_COLUMNS, *(f"val/{n}_loss" for n in loss_names))


def read_evolve_csv(path: Path, keys: list[str], loss_names: tuple[str, str, str]) -> np.ndarray:
    """(rows, 7 + len(keys)) values of an evolve.csv; a file with other columns is a one-line error."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the evolution record ({e.__class__.__name__})") from e
    expected = [*result_keys(loss_names), *keys]
    header = [c.strip() for c in lines[0].split(",")] if lines else []
    if header != expected:
        raise UserError(f"{path}: not an evolve.csv of these hyper-parameters (expected the columns "
                        f"{', '.join(expected)})")
    try:
        return np.array([[float(v) for v in line.split(",")] for line in lines[1:]]).reshape(-1, len(expected))
    except ValueError as e:
        raise UserError(f"{path}: a row is not all numbers ({e})") from e


def append_evolve_row(path: Path, results: tuple[float, ...], hyp: Hyp, keys: list[str],
                      loss_names: tuple[str, str, str]) -> None:
    """Append one generation: its 7 validation results, then its hyper-parameters (header first if new)."""
    values = hyp.to_dict()
    new = not Path(path).exists()
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write(",".join(f"{c:>20}" for c in (*result_keys(loss_names), *keys)) + "\n")
        f.write(",".join(f"{v:>20.5g}" for v in (*results, *(values[k] for k in keys))) + "\n")


def select_parent(rows: np.ndarray, rng: np.random.Generator, n_parents: int = N_PARENTS) -> np.ndarray:
    """The hyper-parameter values of one of the best ``n_parents`` rows, drawn with weight by fitness."""
    scores = np.asarray(fitness(rows[:, : N_RESULTS]), dtype=np.float64).reshape(-1)
    best = np.argsort(-scores, kind="stable")[: min(n_parents, len(rows))]
    weights = scores[best] - scores[best].min() + 1e-6  # the worst of them still has a chance
    pick = best[rng.choice(len(best), p=weights / weights.sum())]
    return rows[pick, N_RESULTS:]


def mutate(parent: np.ndarray, keys: list[str], rng: np.random.Generator,
           limits: dict[str, Limit] = EVOLVE_LIMITS) -> dict[str, float]:
    """``parent`` values each multiplied by a random factor in [0.3, 3] (scale 0: left alone), then clipped to
    their limits and rounded to 5 significant digits. At least one value with a scale changes its factor.
    """
    scales = np.array([limits[k].scale if k in limits else 0.0 for k in keys])
    factors = np.ones(len(keys))
    while scales.any() and (factors == 1).all():
        chosen = rng.random(len(keys)) < MUTATION_PROBABILITY
        factors = (scales * chosen * rng.standard_normal(len(keys)) * rng.random() * MUTATION_SIGMA + 1).clip(0.3, 3.0)
    out = {}
    for key, value in zip(keys, np.asarray(parent, dtype=np.float64) * factors):
        if key in limits:
            value = min(max(value, limits[key].low), limits[key].high)
        out[key] = float(f"{value:.5g}")
    return out


def next_hyp(base: Hyp, rows: np.ndarray, keys: list[str], rng: np.random.Generator,
             limits: dict[str, Limit] = EVOLVE_LIMITS) -> Hyp:
    """The next generation's hyper-parameters: ``base`` for the first, a mutated good parent afterwards.
    ``limits``: the model family's table (models/families.py)."""
    if len(rows) == 0:
        return base
    return base.replace(**mutate(select_parent(rows, rng), keys, rng, limits))


def best_row(rows: np.ndarray) -> int:
    return int(np.argmax(np.asarray(fitness(rows[:, : N_RESULTS])).reshape(-1)))


def write_best_hyp(rows: np.ndarray, keys: list[str], base: Hyp, path: Path) -> Hyp:
    """hyp_evolve.yaml: the best generation's hyper-parameters, a file --hyp reads."""
    i = best_row(rows)
    best = base.replace(**{k: float(v) for k, v in zip(keys, rows[i, N_RESULTS:])})
    score = float(np.asarray(fitness(rows[i, : N_RESULTS])))
    header = (f"# Hyper-parameter evolution: best of {len(rows)} generations (generation {i}, fitness {score:.5g})\n"
              f"# Train with: python train.py --hyp {path.name}\n")
    path.write_text(header + yaml.safe_dump(best.to_dict(), sort_keys=False), encoding="utf-8")
    return best


def plot_evolve(rows: np.ndarray, keys: list[str], path: Path) -> Path:
    """evolve.png: each hyper-parameter against fitness, one point per generation, the best one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = np.asarray(fitness(rows[:, : N_RESULTS])).reshape(-1)
    best = best_row(rows)
    n_cols = 6
    n_rows = max(1, math.ceil(len(keys) / n_cols))
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(3 * n_cols, 2.6 * n_rows), squeeze=False)
    for ax, (j, key) in zip(axes.flat, enumerate(keys)):
        values = rows[:, N_RESULTS + j]
        ax.scatter(values, scores, c=np.arange(len(rows)), cmap="viridis", s=14, alpha=0.8)
        ax.plot(values[best], scores[best], "k+", markersize=12)
        ax.set_title(f"{key} = {values[best]:.3g}", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.supylabel("fitness (0.1 mAP50 + 0.9 mAP50-95)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
