"""The loss of a batch split over 2 gloo ranks equals the loss of the whole batch on 1 process (issue 19).

Each rank counts its positives, the counts are all-reduced and the means divide by the global counts (as
train.py does); DDP then averages the gradients of ``loss * world_size``. The positives are split unevenly
between the ranks (8 targets against 1), which is where per-rank means differ from the global mean.

No ``from __future__ import annotations``: DDP inspects annotations at run time.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import fork_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from models.families import YOLOV5
from models.loss import ComputeLoss, LossNorm
from models.yolo import Model

IMGSZ, NC, WORLD = 64, 3, 2
HYP = YOLOV5.hyp_type()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 images; images 0-1 (rank 0) hold 8 targets, images 2-3 (rank 1) hold 1."""
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, IMGSZ, IMGSZ, generator=gen)
    per_image = [5, 3, 0, 1]
    rows = []
    for i, n in enumerate(per_image):
        for _ in range(n):
            cls = torch.randint(0, NC, (1,), generator=gen).float()
            xy = torch.rand(2, generator=gen) * 0.6 + 0.2
            wh = torch.rand(2, generator=gen) * 0.4 + 0.05
            rows.append(torch.cat((torch.tensor([float(i)]), cls, xy, wh)))
    return images, torch.stack(rows)


def _model() -> Model:
    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml", nc=NC).train()
    for m in model.modules():  # fixed BN statistics: the loss normalisation is what is compared here
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    return model


def _gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _rank_worker(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo")
    images, targets = _batch()
    mine = targets[:, 0].div(2, rounding_mode="floor") == rank
    local_images, local_targets = images[2 * rank : 2 * rank + 2], targets[mine].clone()
    local_targets[:, 0] -= 2 * rank
    results = {}
    for normalisation in ("global", "per_rank"):
        model = DDP(_model())
        compute_loss = ComputeLoss(model, HYP)
        if normalisation == "global":
            counts = compute_loss.positives(local_targets, (IMGSZ, IMGSZ))
            dist.all_reduce(counts)
            norm = LossNorm(counts, len(images))
            loss, items = compute_loss(model(local_images), local_targets, norm)
            (loss * WORLD).backward()  # DDP averages gradients; the global loss sums over ranks
        else:  # YOLOv5's way: each rank's mean over its own positives, then DDP's average
            loss, items = compute_loss(model(local_images), local_targets)
            loss.backward()
        dist.all_reduce(loss.detach())
        dist.all_reduce(items)
        results[normalisation] = {
            "loss": loss.detach() / (1 if normalisation == "global" else WORLD),
            "items": items,
            "grad": _gradients(model.module),
        }
    if rank == 0:
        torch.save(results, f"{out_dir}/ranks.pt")
    dist.destroy_process_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.slow
def test_loss_and_gradients_of_a_split_batch_equal_the_whole_batch(tmp_path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same kernels
    try:
        _compare(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _compare(tmp_path) -> None:
    images, targets = _batch()
    model = _model()
    loss, items = ComputeLoss(model, HYP)(model(images), targets)
    loss.backward()
    reference = {"loss": loss.detach(), "items": items, "grad": _gradients(model)}

    assert fork_ranks(_rank_worker, WORLD, str(tmp_path)) == [0] * WORLD
    ranks = torch.load(tmp_path / "ranks.pt", weights_only=True)
    split = ranks["global"]
    assert float(split["loss"]) == pytest.approx(float(reference["loss"]), rel=1e-6)
    assert split["items"].tolist() == pytest.approx(reference["items"].tolist(), rel=1e-6)
    assert _relative(split["grad"], reference["grad"]) < 1e-6
    # The check can fail: per-rank means (YOLOv5's normalisation) are far from the whole batch's gradient.
    assert _relative(ranks["per_rank"]["grad"], reference["grad"]) > 1e-3
