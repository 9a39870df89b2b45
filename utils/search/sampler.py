"""YOLOv5's genetic evolution as an Optuna sampler: ``--evolve-sampler genetic``, the default.

A trial's hyper-parameters are ``genetic.next_hyp`` of the study's completed trials, drawn from
``np.random.default_rng([seed, trial number])``: the first trial trains the base values, each later one mutates
a parent drawn among the 5 best (a trial that starts beside the first one, before any has completed, mutates
the base values). The completed trials are read as evolve.csv holds them (5 significant digits, in trial
order), so with one worker a seed draws what YOLOv5's evolution draws generation by generation: trial n is
generation n. Optuna is imported with this module, which only a search imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from utils.hyp import HypRecord
from utils.search.genetic import mutate, next_hyp
from utils.search.space import SearchSpace, round_like_csv

HYP_ATTR, RESULTS_ATTR = "hyp", "results"  # user attributes of a trial: its full hyp, its validation results


def evolve_rows(trials: Sequence[FrozenTrial], space: SearchSpace) -> np.ndarray:
    """evolve.csv's rows of the completed trials, in trial order: validation results, then hyper-parameters."""
    rows = [
        [*t.user_attrs[RESULTS_ATTR], *(t.user_attrs[HYP_ATTR][k] for k in space.keys)]
        for t in sorted(trials, key=lambda t: t.number)
        if t.state == TrialState.COMPLETE and RESULTS_ATTR in t.user_attrs and HYP_ATTR in t.user_attrs
    ]
    width = space.n_results + len(space.keys)
    return np.array([[round_like_csv(float(v)) for v in row] for row in rows], dtype=np.float64).reshape(-1, width)


class GeneticSampler(optuna.samplers.BaseSampler):
    """Samples every searched key at once from ``next_hyp``; never samples one key alone."""

    def __init__(self, space: SearchSpace, seed: int):
        self.space = space
        self.seed = seed
        self.drawn: dict[int, HypRecord] = {}  # trial number -> its whole hyp (scale-0 keys too), for the caller

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.space.distributions()

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        self.drawn[trial.number] = self.hyp_for(study, trial.number)
        values = self.drawn[trial.number].to_dict()
        return {k: values[k] for k in search_space}

    def hyp_for(self, study: optuna.Study, number: int) -> HypRecord:
        """The hyp of trial ``number``, from the study's completed trials."""
        space = self.space
        rows = evolve_rows(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), space)
        rng, keys = np.random.default_rng([self.seed, number]), list(space.keys)
        if len(rows) == 0 and number > 0:  # a worker beside the first: nothing completed yet, the base is the parent
            values = space.base.to_dict()
            return space.base.replace(**mutate(np.array([values[k] for k in keys]), keys, rng, space.limits))
        return next_hyp(space.base, rows, keys, rng, space.limits, space.n_results)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        # Only a key outside the space comes here: it keeps its base value (the space's bounds hold it).
        return self.space.base.to_dict()[param_name]
