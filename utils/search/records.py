"""YOLOv5's records of an evolution: evolve.csv, hyp_evolve.yaml and evolve.png.

evolve.csv has one row per completed trial: P, R, mAP50, mAP50-95 and the family's validation losses (as many
as its loss has terms), then the hyper-parameters evolved (``Family.evolve_keys``), each to 5 significant
digits. hyp_evolve.yaml holds the best row's hyper-parameters, a file ``--hyp`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import yaml

from utils.errors import UserError
from utils.hyp import HypRecord
from utils.results_log import METRIC_COLUMNS
from utils.search.genetic import row_fitness


def result_keys(loss_names: Sequence[str]) -> tuple[str, ...]:
    """The names of a row's validation results, for a loss with these terms (the model family's)."""
    return (*METRIC_COLUMNS, *(f"val/{n}_loss" for n in loss_names))


def read_evolve_csv(path: Path, keys: Sequence[str], loss_names: Sequence[str]) -> np.ndarray:
    """(rows, results + keys) values of an evolve.csv; a file with other columns is a one-line error."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the evolution record ({e.__class__.__name__})") from e
    expected = [*result_keys(loss_names), *keys]
    header = [c.strip() for c in lines[0].split(",")] if lines else []
    if header != expected:
        raise UserError(
            f"{path}: not an evolve.csv of these hyper-parameters (expected the columns {', '.join(expected)})"
        )
    try:
        return np.array([[float(v) for v in line.split(",")] for line in lines[1:]]).reshape(-1, len(expected))
    except ValueError as e:
        raise UserError(f"{path}: a row is not all numbers ({e})") from e


def append_evolve_row(
    path: Path, results: Sequence[float], values: Mapping[str, float], keys: Sequence[str], loss_names: Sequence[str]
) -> None:
    """Append one trial: its validation results, then its hyper-parameter ``values`` (header first if new)."""
    if len(results) != 4 + len(loss_names):
        raise ValueError(f"expected {4 + len(loss_names)} validation results, got {len(results)}")
    new = not Path(path).exists()
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write(",".join(f"{c:>20}" for c in (*result_keys(loss_names), *keys)) + "\n")
        f.write(",".join(f"{v:>20.5g}" for v in (*results, *(values[k] for k in keys))) + "\n")


def best_row(rows: np.ndarray) -> int:
    return int(np.argmax(row_fitness(rows)))


def write_best_hyp(rows: np.ndarray, keys: Sequence[str], base: HypRecord, path: Path, n_results: int) -> HypRecord:
    """hyp_evolve.yaml: the best row's hyper-parameters (``base`` for the others), a file --hyp reads."""
    i = best_row(rows)
    best = base.replace(**{k: float(v) for k, v in zip(keys, rows[i, n_results:])})
    score = float(row_fitness(rows[i : i + 1])[0])
    header = (
        f"# Hyper-parameter evolution: best of {len(rows)} generations (generation {i}, fitness {score:.5g})\n"
        f"# Train with: python train.py --hyp {path.name}\n"
    )
    path.write_text(header + yaml.safe_dump(best.to_dict(), sort_keys=False), encoding="utf-8")
    return best


def plot_evolve(rows: np.ndarray, keys: Sequence[str], path: Path, n_results: int) -> Path:
    """evolve.png: each hyper-parameter against fitness, one point per trial, the best one marked."""
    from utils.plots import panel_grid, save_figure

    scores = row_fitness(rows)
    best = best_row(rows)
    fig, axes = panel_grid(len(keys), 6, 3, 2.6, left=1.0)
    for ax, (j, key) in zip(axes, enumerate(keys)):
        values = rows[:, n_results + j]
        ax.scatter(values, scores, c=np.arange(len(rows)), cmap="viridis", s=14, alpha=0.8)
        ax.plot(values[best], scores[best], "k+", markersize=12)
        ax.set_title(f"{key} = {values[best]:.3g}", fontsize=9, y=1.0)  # a fixed place: not measured per panel
        ax.tick_params(labelsize=7)
    fig.supylabel("fitness (0.1 mAP50 + 0.9 mAP50-95)")
    return save_figure(fig, path, dpi=100)
