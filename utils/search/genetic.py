"""YOLOv5's genetic evolution: a parent drawn among the best completed trials, mutated inside the family's limits.

Everything here is a pure function of its arguments; the caller passes ``np.random.default_rng([seed, n])`` for
trial (generation) ``n``, so a trial is repeatable. ``rows`` are evolve.csv's rows (records.py): ``n_results``
validation results (P, R, mAP50, mAP50-95 and the family's validation losses, any number of them), then the
hyper-parameters named by ``keys``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from utils.hyp import HypRecord, Limit
from utils.metrics import fitness

N_PARENTS = 5  # parents are drawn from this many best rows
MUTATION_PROBABILITY = 0.8  # per hyper-parameter
MUTATION_SIGMA = 0.2


def row_fitness(rows: np.ndarray) -> np.ndarray:
    """The fitness (0.1 mAP50 + 0.9 mAP50-95) of each row, from its first four results."""
    return np.asarray(fitness(np.asarray(rows)[:, :4]), dtype=np.float64).reshape(-1)


def select_parent(rows: np.ndarray, n_results: int, rng: np.random.Generator, n_parents: int = N_PARENTS) -> np.ndarray:
    """The hyper-parameter values of one of the best ``n_parents`` rows, drawn with weight by fitness."""
    scores = row_fitness(rows)
    best = np.argsort(-scores, kind="stable")[: min(n_parents, len(rows))]
    weights = scores[best] - scores[best].min() + 1e-6  # the worst of them still has a chance
    pick = best[rng.choice(len(best), p=weights / weights.sum())]
    return rows[pick, n_results:]


def mutate(
    parent: np.ndarray, keys: list[str], rng: np.random.Generator, limits: Mapping[str, Limit]
) -> dict[str, float]:
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


def next_hyp(
    base: HypRecord,
    rows: np.ndarray,
    keys: list[str],
    rng: np.random.Generator,
    limits: Mapping[str, Limit],
    n_results: int,
) -> HypRecord:
    """The next trial's hyper-parameters: ``base`` for the first, a mutated good parent afterwards.
    ``limits``: the model family's table (``Family.evolve_limits``)."""
    if len(rows) == 0:
        return base
    return base.replace(**mutate(select_parent(rows, n_results, rng), keys, rng, limits))
