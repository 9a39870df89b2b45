"""Under DDP with gradient accumulation, gradients are all-reduced once per optimizer step.

No `from __future__ import annotations` here: DDP checks the comm hook's annotations at run time.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import fork_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from utils.engine.step import gradient_sync

ACCUMULATE = 4
STEPS = 2


def _count_allreduces(counter: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    counter[0] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _worker(rank: int, out_dir: str, use_no_sync: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Conv2d(3, 8, 3), nn.SiLU(), nn.Conv2d(8, 4, 3)))
    counter = [0]
    model.register_comm_hook(counter, _count_allreduces)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        before = counter[0]
        for i in range(ACCUMULATE):
            step_now = i == ACCUMULATE - 1
            x = torch.rand(2, 3, 12, 12, generator=g)
            with gradient_sync(model, step_now or not use_no_sync):
                model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(counter[0] - before)
    torch.save({"per_step": per_step, "weights": model.module.state_dict()}, f"{out_dir}/{int(use_no_sync)}_{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_one_allreduce_per_optimizer_step_and_same_weights(tmp_path) -> None:
    for use_no_sync in (True, False):
        assert fork_ranks(_worker, 2, str(tmp_path), use_no_sync) == [0, 0]
    synced_once = [torch.load(tmp_path / f"1_{r}.pt") for r in range(2)]
    synced_always = [torch.load(tmp_path / f"0_{r}.pt") for r in range(2)]
    assert synced_once[0]["per_step"] == [1] * STEPS  # the small model fits in one bucket
    assert synced_always[0]["per_step"] == [ACCUMULATE] * STEPS
    for key, value in synced_once[0]["weights"].items():
        assert torch.allclose(value, synced_always[0]["weights"][key], atol=1e-6), key
        assert torch.equal(value, synced_once[1]["weights"][key]), key  # ranks stay identical
