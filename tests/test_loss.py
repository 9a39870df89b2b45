"""Tests of the training loss and its target assignment, on the real yolov5n head and synthetic predictions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.families import YOLOV5
from models.loss import ComputeLoss
from models.yolo import Model

HYP = YOLOV5.hyp_type(box=0.05, obj=1.0, cls=0.5, cls_pw=1.0, obj_pw=1.0, anchor_t=4.0, fl_gamma=0.0)
NC = 3
IMGSZ = 64  # grids 8x8, 4x4, 2x2


@pytest.fixture(scope="module")
def model() -> Model:
    torch.manual_seed(0)
    return Model("models/yolov5n.yaml", nc=NC).train()


def random_preds(model: Model, batch_size: int = 2, imgsz: int = IMGSZ, seed: int = 0) -> list[torch.Tensor]:
    detect = model.model[-1]
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch_size, detect.na, imgsz // int(s), imgsz // int(s), detect.no, generator=gen)
        for s in detect.stride
    ]


def random_targets(n: int, batch_size: int, nc: int = NC, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    image = torch.randint(0, batch_size, (n, 1), generator=gen).float()
    cls = torch.randint(0, nc, (n, 1), generator=gen).float()
    xy = torch.rand(n, 2, generator=gen)
    wh = torch.rand(n, 2, generator=gen) * 0.9 + 0.02
    return torch.cat((image, cls, xy, wh), 1)


def test_loss_is_finite_and_positive(model: Model) -> None:
    loss, items = ComputeLoss(model, HYP)(random_preds(model), random_targets(12, 2))
    assert loss.shape == () and torch.isfinite(loss) and loss > 0
    assert items.shape == (3,) and not items.requires_grad
    assert (items > 0).all()
    assert torch.isclose(loss, items.sum() * 2)


def test_no_targets_gives_only_objectness_loss(model: Model) -> None:
    loss, items = ComputeLoss(model, HYP)(random_preds(model), torch.zeros(0, 6))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    assert torch.isclose(loss, items[1] * 2)


def test_objectness_term_is_additive_over_batch_splits(model: Model) -> None:
    preds = random_preds(model, batch_size=4)
    compute = ComputeLoss(model, HYP)
    whole, _ = compute(preds, torch.zeros(0, 6))
    first, _ = compute([p[:2] for p in preds], torch.zeros(0, 6))
    second, _ = compute([p[2:] for p in preds], torch.zeros(0, 6))
    assert torch.isclose(whole, first + second, rtol=1e-5)


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p / (1 - p))


def perfect_preds(model: Model, targets: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Predictions that decode exactly to every assigned target box, with confident objectness and class."""
    compute = ComputeLoss(model, HYP)
    preds = [torch.full_like(p, -12.0) for p in random_preds(model, batch_size)]  # no object, no class
    for pi, lt in zip(preds, compute.build_targets([p.shape[2:4] for p in preds], targets)):
        v = lt.valid
        b, a, gy, gx = lt.image[v], lt.anchor[v], lt.gy[v], lt.gx[v]
        txy, twh = lt.tbox[v, :2], lt.tbox[v, 2:]
        pi[b, a, gy, gx, 0:2] = _logit((txy + 0.5) / 2)
        pi[b, a, gy, gx, 2:4] = _logit((twh / lt.anchor_wh[v]).sqrt() / 2)
        pi[b, a, gy, gx, 4] = 12.0
        pi[b, a, gy, gx, 5 + lt.tcls[v]] = 12.0
    return preds


def test_perfect_predictions_give_near_zero_box_loss_and_lower_loss(model: Model) -> None:
    # One target per image, well apart, so no two targets compete for a cell.
    targets = torch.tensor(
        [[0, 1, 0.30, 0.40, 0.20, 0.30], [1, 2, 0.70, 0.60, 0.50, 0.40], [2, 0, 0.55, 0.35, 0.08, 0.10]]
    )
    compute = ComputeLoss(model, HYP)
    perfect_loss, perfect_items = compute(perfect_preds(model, targets, 3), targets)
    random_loss, random_items = compute(random_preds(model, 3), targets)
    assert perfect_items[0] < 1e-5
    assert perfect_items[2] < 1e-3
    assert perfect_loss < 0.05 * random_loss
    assert (perfect_items < random_items).all()


def test_gradient_reaches_every_level(model: Model) -> None:
    preds = [p.requires_grad_() for p in random_preds(model)]
    loss, _ = ComputeLoss(model, HYP)(preds, random_targets(20, 2))
    loss.backward()
    for p in preds:
        assert p.grad is not None and torch.isfinite(p.grad).all()
        assert p.grad[..., 4].abs().sum() > 0  # objectness everywhere
        assert p.grad[..., :4].abs().sum() > 0  # boxes at the assigned cells
        assert p.grad[..., 5:].abs().sum() > 0


def test_gradient_reaches_every_head_conv_of_the_real_model(model: Model) -> None:
    model.zero_grad()
    preds = model(torch.rand(2, 3, IMGSZ, IMGSZ))
    loss, _ = ComputeLoss(model, HYP)(preds, random_targets(10, 2))
    loss.backward()
    for conv in model.model[-1].m:
        assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    model.zero_grad()


def reference_assignments(
    targets: torch.Tensor, anchors: torch.Tensor, grids: list[tuple[int, int]], anchor_t: float
) -> dict[tuple[int, int, int, int, int, int], tuple[float, float, float, float]]:
    """Loop-based assignment: {(level, image, anchor, gy, gx, target): (tx, ty, tw, th)}."""
    out = {}
    for level, (ny, nx) in enumerate(grids):
        for t in range(targets.shape[0]):
            # The same float32 products as the vectorised code, so cell boundaries round identically.
            x = float(targets[t, 2] * nx)
            y = float(targets[t, 3] * ny)
            w = float(targets[t, 4] * nx)
            h = float(targets[t, 5] * ny)
            for a in range(anchors.shape[1]):
                aw, ah = float(anchors[level, a, 0]), float(anchors[level, a, 1])
                worst = max(w / aw, aw / w if w else math.inf, h / ah, ah / h if h else math.inf)
                if not worst < anchor_t:
                    continue
                cx = min(max(math.floor(x), 0), nx - 1)
                cy = min(max(math.floor(y), 0), ny - 1)
                cells = [(cx, cy)]
                nbx = cx - 1 if x - cx < 0.5 else cx + 1  # nearer horizontal neighbour
                nby = cy - 1 if y - cy < 0.5 else cy + 1  # nearer vertical neighbour
                if 0 <= nbx < nx:
                    cells.append((nbx, cy))
                if 0 <= nby < ny:
                    cells.append((cx, nby))
                for gx, gy in cells:
                    key = (level, int(targets[t, 0]), a, gy, gx, t)
                    assert key not in out
                    out[key] = (x - gx, y - gy, w, h)
    return out


def test_vectorised_assignment_equals_loop_reference(model: Model) -> None:
    batch_size = 3
    targets = random_targets(40, batch_size, seed=1)
    targets[:, 4:] = torch.rand(40, 2, generator=torch.Generator().manual_seed(2)) ** 2  # tiny to huge boxes
    edges = torch.tensor(
        [
            [0, 0, 0.0, 0.0, 0.2, 0.2],  # on the top-left corner
            [1, 1, 1.0, 1.0, 0.3, 0.2],  # on the bottom-right corner
            [2, 2, 0.5, 0.25, 0.1, 0.1],  # exactly on cell boundaries
            [0, 1, 0.999, 0.001, 0.05, 0.4],
            [1, 0, 0.3, 0.7, 0.0, 0.2],  # zero width: matches nothing
        ]
    )
    targets = torch.cat((targets, edges))
    preds = random_preds(model, batch_size)
    compute = ComputeLoss(model, HYP)
    got = {}
    for level, lt in enumerate(compute.build_targets([p.shape[2:4] for p in preds], targets)):
        for i in torch.nonzero(lt.valid).flatten().tolist():
            key = (level, int(lt.image[i]), int(lt.anchor[i]), int(lt.gy[i]), int(lt.gx[i]), int(lt.target[i]))
            assert key not in got, "duplicate assignment"
            got[key] = tuple(lt.tbox[i].tolist())
            assert lt.tcls[i] == targets[int(lt.target[i]), 1]
            assert torch.equal(lt.anchor_wh[i], model.model[-1].anchors[level, lt.anchor[i]])
    grids = [(p.shape[2], p.shape[3]) for p in preds]
    expected = reference_assignments(targets, model.model[-1].anchors, grids, HYP.anchor_t)
    assert len(expected) > 50
    assert got.keys() == expected.keys()
    for key, box in expected.items():
        assert got[key] == pytest.approx(box, abs=1e-5)
    # Every candidate box lies where the decoded centre can reach: (-0.5, 1.5) from its cell.
    offsets = torch.tensor([v[:2] for v in got.values()])
    assert (offsets >= -0.5).all() and (offsets <= 1.5).all()


def test_label_smoothing_sets_class_targets(model: Model) -> None:
    # With every class logit equal to z, the class BCE has a closed form in the positive/negative targets.
    z = 2.0
    targets = random_targets(6, 2)
    preds = random_preds(model)
    for p in preds:
        p[..., 5:] = z
    for eps in (0.0, 0.1):
        compute = ComputeLoss(model, HYP, label_smoothing=eps)
        _, items = compute(preds, targets)
        positive, negative = 1 - 0.5 * eps, 0.5 * eps
        mean_target = (positive + (NC - 1) * negative) / NC
        levels_with_targets = sum(
            bool(lt.valid.any()) for lt in compute.build_targets([p.shape[2:4] for p in preds], targets)
        )
        expected = HYP.cls * (F.softplus(torch.tensor(z)) - z * mean_target) * levels_with_targets
        assert items[2] == pytest.approx(float(expected), rel=1e-5)


def test_focal_loss_downweights_easy_examples(model: Model) -> None:
    preds, targets = random_preds(model), random_targets(12, 2)
    _, plain = ComputeLoss(model, HYP)(preds, targets)
    _, focal = ComputeLoss(model, HYP.replace(fl_gamma=1.5))(preds, targets)
    assert torch.isfinite(focal).all()
    assert focal[1] < plain[1] and focal[2] < plain[2]
    assert focal[0] == plain[0]  # the box loss is not a BCE


def test_loss_is_fp32_for_bf16_predictions(model: Model) -> None:
    preds = [p.bfloat16() for p in random_preds(model)]
    targets = random_targets(12, 2)
    loss, items = ComputeLoss(model, HYP)(preds, targets)
    reference, _ = ComputeLoss(model, HYP)([p.float() for p in preds], targets)
    assert loss.dtype == torch.float32 and items.dtype == torch.float32
    assert torch.equal(loss, reference)


def test_fitting_learnable_predictions_reduces_the_loss(model: Model) -> None:
    targets = random_targets(8, 2)
    preds = [(p * 0.1).requires_grad_() for p in random_preds(model)]
    compute = ComputeLoss(model, HYP)
    optimizer = torch.optim.Adam(preds, lr=0.1)
    first = None
    for _ in range(50):
        loss, _ = compute(preds, targets)
        first = float(loss.detach()) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final, items = compute(preds, targets)
    assert float(final.detach()) < 0.2 * first
    assert items[0] < 0.02  # boxes mostly fitted: CIoU > 0.6 on average
