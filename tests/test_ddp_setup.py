"""How the engine wraps the model in DDP (utils/engine/parallel.py): buffers broadcast once, not before every
forward, with rank 0's state exactly as with the per-forward broadcast; gradient buckets sized to the model.

No `from __future__ import annotations` here: DDP checks the comm hook's annotations at run time.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import fork_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from utils.distributed import DistInfo
from utils.ema import ModelEMA
from utils.engine.parallel import share_buffers, wrap_ddp

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    # About 7 MiB of gradients in 8 layers of about 1 MiB each (torch's default makes 2 buckets of them).
    layers = [
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 512),
    ]
    return nn.Sequential(*layers, *(nn.Linear(512, 512) for _ in range(7)))


def _count_allreduces(counter: list, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    counter[0] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _train(ddp: DDP, rank: int) -> tuple[ModelEMA, int]:
    """STEPS steps on this rank's own images, the EMA following; returns it and the all-reduces of the last step
    (DDP rebuilds its buckets in the order of the first step's gradients)."""
    ema = ModelEMA(ddp.module, tau=1.0)
    counter = [0]
    ddp.register_comm_hook(counter, _count_allreduces)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        counter[0] = 0
        ddp(torch.rand(4, 3, 12, 12, generator=g) * (1 + rank)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(ddp)
    return ema, counter[0]


def _worker(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo")
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2)
    bn_of = lambda model: model[1]  # noqa: E731
    # Made equal once: rank 1's own statistics are replaced by rank 0's when it is wrapped ...
    model = _net()
    if rank == 1:
        bn_of(model).running_mean.fill_(100.0)
    ddp = wrap_ddp(model, torch.device("cpu"))
    made_equal = float(bn_of(model).running_mean.abs().max())
    # ... and not before each forward: rank 1's forward updates its own statistics (a broadcast would reset them).
    if rank == 1:
        bn_of(model).running_mean.fill_(100.0)
    ddp(torch.rand(2, 3, 12, 12)).sum().backward()
    kept_own = float(bn_of(model).running_mean.min())
    ema, per_step = _train(wrap_ddp(_net(), torch.device("cpu")), rank)
    share_buffers(ema.ema, info)
    reference_ema, default_per_step = _train(DDP(_net()), rank)  # torch's defaults: buffers broadcast every forward
    torch.save(
        {
            "made_equal": made_equal,
            "kept_own": kept_own,
            "per_step": per_step,
            "default_per_step": default_per_step,
            "ema": ema.ema.state_dict(),
            "reference_ema": reference_ema.ema.state_dict(),
        },
        f"{out_dir}/{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_buffers_broadcast_once_rank_0_exact_and_buckets_sized_to_the_model(tmp_path) -> None:
    assert fork_ranks(_worker, 2, str(tmp_path)) == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert r1["made_equal"] == 0.0  # rank 0's fresh statistics
    assert r1["kept_own"] > 50.0  # 0.9 * 100 plus its batch's share: not overwritten by rank 0's zeros
    # Rank 0 (whose model and EMA are saved) is bit for bit what the per-forward broadcast gives.
    for name, value in r0["reference_ema"].items():
        assert torch.equal(r0["ema"][name], value), name
    # Every rank validates rank 0's EMA: weights (all-reduced gradients) and, once shared, the BN statistics.
    for name, value in r0["ema"].items():
        assert torch.equal(r1["ema"][name], value), name
    # The reference's rank 1 EMA read statistics its own batches had moved: not what rank 0 saves.
    assert not torch.equal(r1["reference_ema"]["1.running_mean"], r0["reference_ema"]["1.running_mean"])
    assert r0["default_per_step"] == 2  # torch's 25 MiB: a 1 MiB first bucket and the rest
    assert r0["per_step"] >= 6  # about 1 MiB each: the late layers' all-reduces overlap the backward pass
