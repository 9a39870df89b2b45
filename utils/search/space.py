"""What a hyper-parameter search explores: a base hyp, the values evolve.csv records, the limits they move in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from utils.hyp import HypRecord, Limit
from utils.search.records import result_keys

LOG_SCALE_RATIO = 100.0  # a range spanning this factor or more (lr0: 1e-5 to 0.1) is searched on a log scale


def round_like_csv(value: float) -> float:
    """``value`` as evolve.csv holds it (5 significant digits), as a continued evolution reads it back."""
    return float(f"{value:.5g}")


@dataclass(frozen=True)
class SearchSpace:
    """``keys``: evolve.csv's hyper-parameter columns (the family's ``evolve_keys(base)``); ``limits``: the
    family's evolution table; ``loss_names``: its loss terms (evolve.csv's validation-loss columns)."""

    base: HypRecord  # the family's record (``Family.read_hyp``)
    keys: tuple[str, ...]
    limits: Mapping[str, Limit]
    loss_names: tuple[str, ...]

    @property
    def searched(self) -> tuple[str, ...]:
        """The keys a sampler moves: those with a mutation scale (scale 0 keeps the base value)."""
        return tuple(k for k in self.keys if k in self.limits and self.limits[k].scale > 0)

    @property
    def result_keys(self) -> tuple[str, ...]:
        return result_keys(self.loss_names)

    @property
    def n_results(self) -> int:
        """evolve.csv's validation results per row: P, R, mAP50, mAP50-95 and one loss per term."""
        return len(self.result_keys)

    def bounds(self, key: str) -> tuple[float, float]:
        """The key's limits, widened to hold the base value (a hyp file may start outside them)."""
        value = self.base.to_dict()[key]
        return min(self.limits[key].low, value), max(self.limits[key].high, value)

    def distributions(self) -> dict[str, Any]:
        """Optuna's distributions of the searched keys."""
        from optuna.distributions import FloatDistribution

        out = {}
        for key in self.searched:
            low, high = self.bounds(key)
            if low < high:
                out[key] = FloatDistribution(low, high, log=low > 0 and high / low >= LOG_SCALE_RATIO)
        return out

    def hyp_of(self, params: Mapping[str, float]) -> HypRecord:
        """The base hyp with a sampler's values of the searched keys."""
        return self.base.replace(**{k: float(v) for k, v in params.items() if k in self.keys})

    def describe(self) -> dict[str, Any]:
        """What a study records of its space, so that a worker of another search is refused."""
        return {"keys": list(self.keys), "loss_names": list(self.loss_names)}
