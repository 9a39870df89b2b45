"""Where a DETR's training on 2 ranks parts from one process's, step by step: the narrow D-FINE, data and recipe of
tests/test_detr_train.py's world-size test (global batch 4, --sync-bn, rank 1's first batch without a box, 2
epochs), with the optimizer asked for.

    python bench/detr_world_size_drift.py --out /tmp/drift --optimizer AdamW [--float64] [--threads]

Each run records, at every optimizer step, the gradients the optimizer sees (all-reduced), the weights after the
step, the AdamW state, the encoder's top-k queries of each image and the Hungarian matches, and the bench prints
per step: the gradients' and the weights' relative difference, the largest difference of one weight's update (in
units of the learning rate), the images whose top-k queries come in another order or are another set, and the
matched (encoder token, box) pairs that differ; then the final weights' and EMA's relative difference.

- ``--float64``: both runs in float64 (every ``Tensor.float()`` of the code made a float64 cast, for this
  measurement only): a difference the world size makes beyond rounding stays; rounding shrinks by 1e9.
- ``--threads``: the control; instead of 1 process against 2 ranks, one process with 1 thread against one with 2,
  whose kernels only sum in another order.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models.detr_matcher as detr_matcher  # noqa: E402
import train  # noqa: E402
from models.families import DFINE  # noqa: E402
from tests.conftest import _main_writing_to, rank_jobs, run_forked, write_rectangles_dataset  # noqa: E402
from tests.test_detr_train import FAMILIES, relative_difference  # noqa: E402
from utils.checkpoint import load_checkpoint  # noqa: E402
from utils.data.samplers import ShardedSampler  # noqa: E402
from utils.engine import optimization  # noqa: E402

SEED = 3
STEPS = 4  # 8 images, global batch 4, 2 epochs
QUERIES = 30  # the narrow model's num_queries: the encoder's top-k


def use_float64() -> None:
    """Every float tensor of the run in float64. A bool's ``.float()`` stays float32: a fused optimizer's
    ``found_inf`` must be."""
    torch.set_default_dtype(torch.float64)
    to_float32 = torch.Tensor.float

    def to_float64(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return to_float32(self) if self.dtype == torch.bool else self.double()

    torch.Tensor.float = to_float64  # type: ignore[method-assign, assignment]


def record(out: Path) -> None:
    """Patches (in this process, inherited by the forked runs) that save each optimizer step of a run to
    ``out/<name>_step<n>.pt``, the run's name in the environment variable DRIFT_NAME."""
    seen: dict[str, list[Any]] = {"topk": [], "matches": []}
    steps = [0]
    topk, solve, step = torch.topk, detr_matcher.solve, optimization.Optimization.step

    def recording_topk(x: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
        found = topk(x, k, *args, **kwargs)
        if x.dim() == 2 and k == QUERIES and torch.is_grad_enabled():  # the encoder's queries (training)
            seen["topk"].append(found.indices.clone())
        return found

    def recording_solve(cost: Any, per_image: list[int]) -> Any:
        found = solve(cost, per_image)
        seen["matches"].append((list(per_image), [tuple(a.tolist() for a in triple) for triple in found]))
        return found

    def recording_step(self: optimization.Optimization, model: torch.nn.Module) -> Any:
        named = [(n.removeprefix("module."), p) for n, p in model.named_parameters() if p.requires_grad]
        grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
        finite = step(self, model)
        names = {id(p): n for n, p in named}
        state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in self.optimizer.state.items()}
        after = {n: p.detach().clone() for n, p in named}
        saved = {"grads": grads, "after": after, "state": state, "lr": self.optimizer.param_groups[0]["lr"], **seen}
        torch.save(saved, out / f"{os.environ['DRIFT_NAME']}_step{steps[0]}.pt")
        steps[0] += 1
        seen["topk"], seen["matches"] = [], []
        return finite

    torch.topk = recording_topk  # type: ignore[assignment]
    detr_matcher.solve = recording_solve
    optimization.Optimization.step = recording_step  # type: ignore[method-assign]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300))


def pairs(found: tuple, per_image: list[int], image: int, tokens: list[int]) -> set[tuple[int, int]]:
    """One image's matched pairs of one set, as (encoder token, box of that image): a query is named by the token
    whose top-k place it takes, so the same matching of queries in another order is the same set."""
    first = sum(per_image[:image])
    return {(tokens[q], r - first) for i, q, r in zip(*found) if i == image}


def compare(out: Path, names: tuple[str, ...], ranks: int) -> None:
    """Prints the per-step differences of run ``names[1]`` (``ranks`` of them, each holding every ``ranks``-th
    image of the global batch) from run ``names[0]``."""
    print("step  grads      weights    max|du|/lr  top-k order  top-k set  pairs")
    for n in range(STEPS):
        one = torch.load(out / f"{names[0]}_step{n}.pt", weights_only=False)
        each = [
            torch.load(out / f"{names[1]}{r if ranks > 1 else ''}_step{n}.pt", weights_only=False) for r in range(ranks)
        ]
        other = each[0]
        keys = sorted(one["grads"])
        grads = rel(
            torch.cat([other["grads"][p].flatten() for p in keys]), torch.cat([one["grads"][p].flatten() for p in keys])
        )
        weights = rel(
            torch.cat([other["after"][p].flatten() for p in keys]), torch.cat([one["after"][p].flatten() for p in keys])
        )
        update = (
            max(float((other["after"][p].double() - one["after"][p].double()).abs().max()) for p in keys) / one["lr"]
        )
        order = sets = differing = 0
        per_image = one["matches"][0][0]
        for image in range(len(per_image)):
            mine, local = each[image % ranks], image // ranks
            assert mine["matches"][0][0][local] == per_image[image], "the global batch is not interleaved over ranks"
            a, b = one["topk"][0][image], mine["topk"][0][local]
            order += not torch.equal(a, b)
            sets += set(a.tolist()) != set(b.tolist())
            for found, theirs in zip(one["matches"][0][1], mine["matches"][0][1]):
                ours = pairs(found, per_image, image, a.tolist())
                differing += len(ours ^ pairs(theirs, mine["matches"][0][0], local, b.tolist())) // 2
        print(f"{n:<5} {grads:<10.2e} {weights:<10.2e} {update:<11.3f} {order:<12} {sets:<10} {differing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the data, runs and records")
    parser.add_argument("--optimizer", default="AdamW", choices=["AdamW", "SGD"])
    parser.add_argument("--float64", action="store_true", help="both runs in float64")
    parser.add_argument("--threads", action="store_true", help="1 process of 1 thread against 1 of 2 threads")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True)
    for family, table in FAMILIES.values():
        family.scales = functools.partial(dict, table)  # type: ignore[method-assign]  # the narrow scales, here
    DFINE.recipe_optimizer = args.optimizer  # type: ignore[misc]
    data = write_rectangles_dataset(out / "data", n_train=8, n_val=2, size=64)
    for i in ShardedSampler(8, world_size=2, rank=1, shuffle=True, seed=SEED).shard(0)[:2]:
        (data.parent / "labels" / "train" / f"{i:04d}.txt").write_text("")  # rank 1's first batch: no boxes
    recipe = yaml.safe_load((ROOT / DFINE.default_hyp).read_text())
    hyp = out / "hyp.yaml"
    hyp.write_text(yaml.safe_dump({**recipe, "warmup_steps": 0}))
    if args.float64:
        use_float64()
    record(out)
    common = [
        "--data", str(data), "--cfg", "dfine-tiny.yaml", "--hyp", str(hyp), "--epochs", "2", "--batch-size", "4",
        "--noval", "--deterministic", "--no-amp", "--seed", str(SEED), "--sync-bn", "--name", "exp",
        "--imgsz", "64", "--workers", "0", "--device", "cpu", "--noplots",
    ]  # fmt: skip

    def run(name: str, project: str, threads: int = 1) -> int:
        os.environ["DRIFT_NAME"] = name  # the records' name; the ranks of one world share their project
        torch.set_num_threads(threads)
        return _main_writing_to(train.main, [*common, "--project", str(out / project)], str(out / f"{name}.log"))

    jobs: list[tuple[Callable[..., int | None], tuple, dict[str, str]]]
    if args.threads:
        names, ranks = ("single", "threads"), 1
        jobs = [(run, ("single", "single"), {}), (run, ("threads", "threads", 2), {})]
    else:
        names, ranks = ("single", "rank"), 2
        jobs = [(run, ("single", "single"), {}), *rank_jobs(lambda rank: run(f"rank{rank}", "rank"), 2)]
    codes = run_forked(jobs, timeout=900)
    assert not any(codes), f"exit codes {codes}: see {out}/*.log"
    compare(out, names, ranks)
    final = [load_checkpoint(out / name / "exp" / "weights" / "last.pt") for name in names]
    for key in ("model", "ema"):
        print(f"final {key}: {relative_difference(final[1][key], final[0][key]):.2e} relative")


if __name__ == "__main__":
    main()
