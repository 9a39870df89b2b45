"""--evolve: hyper-parameter evolution, generation by generation, recorded in evolve.csv.

``evolve`` trains the generations; the functions before it are the record and the mutation.

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
import torch
import yaml

from models.families import family_of
from utils.checkpoint import load_checkpoint
from utils.distributed import DistInfo, broadcast_object
from utils.engine.config import TrainConfig
from utils.engine.setup import model_config
from utils.engine.trainer import train
from utils.errors import UserError
from utils.hyp import EVOLVE_LIMITS, Hyp, Limit
from utils.log import LOGGER, colorstr
from utils.metrics import fitness
from utils.results_log import METRIC_COLUMNS
from utils.run_dir import increment_path

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


def evolve(config: TrainConfig, device: torch.device, info: DistInfo) -> Path:
    """--evolve N: train generations until evolve.csv holds N; returns the folder (``config.project``/name, or
    that of --resume-evolve's csv).

    Each generation is a normal run (validated after its last epoch only, final weights only) in
    ``<folder>/gen<i>``; every rank of a distributed launch trains it together. Rank 0 keeps the record and
    decides each generation's hyper-parameters, drawn from ``(seed, generation)`` and the csv so far.
    """
    if config.evolve is None:
        raise UserError(f"--resume-evolve {config.resume_evolve} needs --evolve N, the number of generations in total")
    if config.evolve < 1:
        raise UserError(f"--evolve {config.evolve}: give the number of generations, at least 1 (e.g. --evolve 10)")
    family = family_of(model_config(config, None, load_checkpoint(config.weights) if config.weights else None))
    base = Hyp.from_yaml(config.hyp or family.default_hyp_path)
    family.check_hyp(base, config.hyp or family.default_hyp)
    keys, loss_names = family.evolve_keys(base), family.loss_names
    folder, csv_file = _record_files(config, info)
    rows = np.zeros((0, len(result_keys(loss_names)) + len(keys)))
    if info.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        if csv_file.exists():
            rows = read_evolve_csv(csv_file, keys, loss_names)
    rows = broadcast_object(rows, info)
    if len(rows) >= config.evolve:
        LOGGER.info(f"{csv_file} already holds {len(rows)} generations (--evolve {config.evolve}): nothing to do")
        return folder
    LOGGER.info(f"Evolving hyper-parameters: generations {len(rows)} to {config.evolve - 1} in {colorstr(str(folder))}")
    for generation in range(len(rows), config.evolve):
        hyp = next_hyp(base, rows, keys, np.random.default_rng([config.seed, generation]), family.evolve_limits)
        hyp = Hyp.from_dict(broadcast_object(hyp.to_dict(), info), f"generation {generation}")
        generation_config = config.replace(project=str(folder), name=f"gen{generation}", exist_ok=True, noval=True,
                                           nosave=True, noplots=True, evolve=None, resume_evolve=None)
        out = train(generation_config, device, info, None, hyp=hyp)
        if info.is_main:
            append_evolve_row(csv_file, out.results, hyp, keys, loss_names)
            rows = read_evolve_csv(csv_file, keys, loss_names)  # the rounded values, as a resumed evolution reads
            write_best_hyp(rows, keys, base, folder / "hyp_evolve.yaml")
            LOGGER.info(f"generation {generation}: fitness {float(fitness(np.array(out.results[:4]))):.5g}; "
                        f"best so far in {folder / 'hyp_evolve.yaml'}")
        rows = broadcast_object(rows, info)
    if info.is_main:  # once at the end: a figure of every hyper-parameter costs seconds
        plot_evolve(rows, keys, folder / "evolve.png")
    LOGGER.info(f"Evolution done: {csv_file}, {folder / 'hyp_evolve.yaml'}, {folder / 'evolve.png'}")
    return folder


def _record_files(config: TrainConfig, info: DistInfo) -> tuple[Path, Path]:
    """The evolution's folder and evolve.csv: --resume-evolve's, or a new folder under ``config.project``."""
    if config.resume_evolve:
        csv_file = Path(config.resume_evolve)
        if not csv_file.is_file():
            raise UserError(f"--resume-evolve {csv_file}: file not found")
        return csv_file.parent, csv_file
    folder = Path(broadcast_object(str(increment_path(Path(config.project) / config.name,
                                                      config.exist_ok).resolve()), info))
    return folder, folder / "evolve.csv"
