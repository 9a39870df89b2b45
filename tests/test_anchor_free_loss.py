"""The anchor-free loss and its task-aligned assigner: equal to Ultralytics' (committed fixtures), any world size.

tests/fixtures/ultralytics/anchor_free_loss.pt holds Ultralytics' numbers (see the README beside it). Ultralytics' loss returns the gained terms times the batch size and its trainer
sums them; ours returns that sum directly (times the global image count, the local batch here), so our loss is
compared with the sum of theirs, and the items one for one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from models.anchor_free_loss import AnchorFreeLoss, End2EndLoss, pad_targets
from models.loss import LossNorm

FIXTURE = Path(__file__).parent / "fixtures" / "ultralytics" / "anchor_free_loss.pt"
GAINS = (7.5, 0.5, 1.5)
V8_CASES = ["v8_forward", "v8_random", "v8_many"]
E2E_CASES = ["yolo26_forward", "yolo26_random"]


class _Head(nn.Module):
    """What the loss reads of a Detect head: nc, reg_max, stride."""

    def __init__(self, nc: int, reg_max: int, stride: torch.Tensor) -> None:
        super().__init__()
        self.nc, self.reg_max = nc, reg_max
        self.register_buffer("stride", stride.float())


class _Model(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.model = nn.ModuleList([head])


@pytest.fixture(scope="module")
def cases() -> dict:
    return torch.load(FIXTURE, weights_only=True)


def _model(case: dict) -> _Model:
    return _Model(_Head(case["nc"], case["reg_max"], case["strides"]))


def _loss(case: dict, **kwargs) -> AnchorFreeLoss:
    if case["reg_max"] > 1:
        return AnchorFreeLoss(_model(case), gains=GAINS, **kwargs)
    loss = End2EndLoss(_model(case), gains=GAINS, **kwargs)
    loss.set_epoch(case["epoch"], case["epochs"])
    return loss


def _preds(case: dict, grad: bool = False):
    def levels(key):
        return [p.float().requires_grad_(grad) for p in case[key]]

    return levels("levels") if case["reg_max"] > 1 else {"one2many": levels("one2many"), "one2one": levels("one2one")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-12)).max())


@pytest.mark.parametrize("name", V8_CASES + E2E_CASES)
def test_items_and_total_equal_ultralytics(cases, name):
    case = cases[name]
    loss, items = _loss(case)(_preds(case), case["targets"])
    assert _rel(items, case["items"]) < 1e-5, (items, case["items"])
    assert _rel(loss.detach(), case["total"]) < 1e-5, (loss, case["total"])


@pytest.mark.parametrize("name", V8_CASES + E2E_CASES)
def test_without_small_object_widening_equals_ultralytics_without_it(cases, name):
    case = cases[name]
    _, items = _loss(case, small_object_px=None)(_preds(case), case["targets"])
    assert _rel(items, case["no_stal_items"]) < 1e-5


def test_small_object_widening_changes_the_assignment(cases):
    # The option is not a no-op: on the many-targets batch the two reference losses differ, and so do ours.
    case = cases["v8_many"]
    assert _rel(case["no_stal_items"], case["items"]) > 1e-4
    _, with_it = _loss(case)(_preds(case), case["targets"])
    _, without = _loss(case, small_object_px=None)(_preds(case), case["targets"])
    assert _rel(with_it, without) > 1e-4


@pytest.mark.parametrize("name", V8_CASES + E2E_CASES)
def test_assignment_equals_ultralytics(cases, name):
    case = cases[name]
    loss = _loss(case)
    preds = _preds(case)
    key, assigner = ("levels", loss.assigner) if case["reg_max"] > 1 else ("one2one", loss.o2o_assigner)
    levels = preds if case["reg_max"] > 1 else preds[key]
    gt = loss._ground_truth(levels, case["targets"])
    assigned = loss.assign(levels, gt, assigner).assigned
    assert torch.equal(assigned.fg_mask, case["fg_mask"])
    assert assigned.fg_mask.any()
    torch.testing.assert_close(assigned.target_scores, case["target_scores"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["v8_random", "yolo26_random"])
def test_gradients_equal_ultralytics(cases, name):
    case = cases[name]
    preds = _preds(case, grad=True)
    loss, _ = _loss(case)(preds, case["targets"])
    loss.backward()
    if case["reg_max"] > 1:
        pairs = zip(preds, case["grads"])
    else:
        pairs = [*zip(preds["one2many"], case["o2m_grads"]), *zip(preds["one2one"], case["o2o_grads"])]
    for p, expected in pairs:
        assert expected.abs().max() > 0
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def _split(case: dict, bounds: tuple[int, ...]) -> list[tuple[object, torch.Tensor]]:
    """The whole batch, then its parts images bounds[i]:bounds[i + 1]: (preds, targets) each, images renumbered."""
    preds = _preds(case, grad=True)
    t = case["targets"]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):

        def cut(levels):
            return [p[lo:hi].detach().clone().requires_grad_(True) for p in levels]

        part = cut(preds) if isinstance(preds, list) else {k: cut(v) for k, v in preds.items()}
        rows = t[(t[:, 0] >= lo) & (t[:, 0] < hi)].clone()
        rows[:, 0] -= lo
        parts.append((part, rows))
    return [(preds, t), *parts]


def _leaves(preds) -> list[torch.Tensor]:
    return preds if isinstance(preds, list) else [*preds["one2many"], *preds["one2one"]]


# v8_many has 30, 0 and 25 targets in its 3 images: as 3 ranks, one has none. yolo26_random: 20, 7, 0.
@pytest.mark.parametrize("name, bounds", [("v8_many", (0, 1, 2, 3)), ("yolo26_random", (0, 1, 3))])
def test_ranks_add_up_to_one_process(cases, name, bounds):
    """Each rank divides its sums by the global target-score sum (``reduce``): the ranks add up to one process."""
    case = cases[name]
    (whole, targets), *ranks = _split(case, bounds)
    loss_fn = _loss(case)
    whole_loss, whole_items = loss_fn(whole, targets)
    whole_loss.backward()

    local: list[torch.Tensor] = []  # pass 1: each rank's own target-score sums
    for preds, rows in ranks:
        loss_fn(preds, rows, reduce=lambda t: local.append(t.clone()) or t)
    assert len(local) == len(ranks)  # one reduce per call, also on a rank without targets
    global_sum = sum(local)

    norm = LossNorm(positives=torch.zeros(0), images=bounds[-1])
    loss_sum, items_sum = 0.0, 0.0
    for preds, rows in ranks:
        loss, items = loss_fn(preds, rows, norm=norm, reduce=lambda t: global_sum.clone())
        loss.backward()
        loss_sum, items_sum = loss_sum + loss.detach(), items_sum + items
    assert abs(float(loss_sum) - float(whole_loss.detach())) <= 2e-5 * abs(float(whole_loss.detach()))
    torch.testing.assert_close(items_sum, whole_items, rtol=2e-5, atol=0)
    for i, w in enumerate(_leaves(whole)):
        g = torch.cat([_leaves(preds)[i].grad for preds, _ in ranks])
        torch.testing.assert_close(g, w.grad, rtol=2e-5, atol=2e-5 * float(w.grad.abs().max()))


def test_label_smoothing_is_bce_on_smoothed_soft_targets(cases):
    case = cases["v8_random"]
    eps = 0.1
    loss = _loss(case, label_smoothing=eps)
    levels = _preds(case)
    head = loss.assign(levels, loss._ground_truth(levels, case["targets"]), loss.assigner)
    tss = head.score_sum.clamp(min=1)
    cls = loss.terms(head, (64, 64), tss)[1]
    logits = head.cls_logits.transpose(1, 2)  # (B, A, nc) as the targets
    targets = head.assigned.target_scores * (1 - eps) + eps / 2
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="sum") / tss * GAINS[1]
    assert _rel(cls, expected) < 1e-5
    assert _rel(cls, _loss(case).terms(head, (64, 64), tss)[1]) > 1e-3  # and differs from no smoothing


def test_end2end_weights_follow_the_epochs(cases):
    loss = _loss(cases["yolo26_forward"])
    epochs = 10
    weights = []
    for epoch in range(epochs):
        loss.set_epoch(epoch, epochs)
        weights.append(loss.o2m_weight)
        assert loss.o2o_weight == pytest.approx(1 - loss.o2m_weight)
    assert weights[0] == pytest.approx(0.8) and weights[-1] == pytest.approx(0.1)
    steps = [a - b for a, b in zip(weights, weights[1:])]
    assert steps == pytest.approx([0.7 / 9] * 9)  # linear
    loss.set_epoch(3, 10)
    assert loss.o2m_weight == pytest.approx(cases["yolo26_forward"]["o2m_weight"])  # Ultralytics' in that epoch
    loss.set_epoch(0, 1)  # a single epoch is the first one
    assert loss.o2m_weight == pytest.approx(0.8)


def test_end2end_total_is_the_weighted_heads(cases):
    case = cases["yolo26_random"]
    loss, items = _loss(case)(_preds(case), case["targets"])
    images = case["one2many"][0].shape[0]
    w = case["o2m_weight"]
    expected = (case["o2m_items"].sum() * w + case["o2o_items"].sum() * (1 - w)) * images
    assert _rel(loss.detach(), expected) < 1e-5
    assert _rel(items, case["o2o_items"]) < 1e-5  # items are the one-to-one head's


def test_one_to_one_head_gets_one_positive_per_object(cases):
    case = cases["yolo26_forward"]
    # Well separated objects: each gets exactly one positive from the one-to-one assigner, several from the other.
    targets = torch.tensor(
        [
            [0, 0, 0.25, 0.25, 0.3, 0.3],
            [0, 1, 0.75, 0.7, 0.35, 0.4],
            [1, 2, 0.5, 0.5, 0.5, 0.6],
            [1, 0, 0.1, 0.9, 0.1, 0.1],
        ]
    )
    g = torch.Generator().manual_seed(0)
    levels = [
        torch.cat((torch.rand(2, 4, s, s, generator=g) * 3, torch.randn(2, 3, s, s, generator=g)), 1) for s in (8, 4, 2)
    ]
    loss = _loss(case)
    gt = loss._ground_truth(levels, targets)
    for assigner, expect_one in ((loss.o2o_assigner, True), (loss.assigner, False)):
        a = loss.assign(levels, gt, assigner).assigned
        per_gt = torch.zeros(gt.mask.shape, dtype=torch.long)
        per_gt.view(-1).scatter_add_(
            0,
            (a.target_gt + torch.arange(2)[:, None] * gt.mask.shape[1])[a.fg_mask],
            torch.ones(int(a.fg_mask.sum()), dtype=torch.long),
        )
        if expect_one:
            assert per_gt[gt.mask].tolist() == [1, 1, 1, 1]
        else:
            assert per_gt[gt.mask].max() > 1
    # In the crowded reference batch: never more than one, Ultralytics' own assignment included.
    fg = cases["yolo26_random"]["fg_mask"]
    assert int(fg.sum()) <= int(cases["yolo26_random"]["targets"].shape[0])


def test_batch_assignment_equals_per_image(cases):
    """Padding gts to the batch's largest count changes nothing: each image assigned alone gets the same targets."""
    case = cases["v8_many"]
    loss = _loss(case)
    levels = _preds(case)
    t = case["targets"]
    whole = loss.assign(levels, loss._ground_truth(levels, t), loss.assigner).assigned
    for i in range(levels[0].shape[0]):
        one = [p[i : i + 1] for p in levels]
        rows = t[t[:, 0] == i].clone()
        rows[:, 0] = 0
        alone = loss.assign(one, loss._ground_truth(one, rows), loss.assigner).assigned
        assert torch.equal(alone.fg_mask[0], whole.fg_mask[i])
        torch.testing.assert_close(alone.target_scores[0], whole.target_scores[i], rtol=0, atol=0)


def test_no_targets_gives_class_loss_only_and_gradients(cases):
    case = cases["v8_random"]
    preds = _preds(case, grad=True)
    loss, items = _loss(case)(preds, torch.zeros((0, 6)))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in preds)


def test_pad_targets_keeps_each_images_rows_in_order():
    targets = torch.tensor([[1, 2, 0.5, 0.5, 0.2, 0.2], [0, 1, 0.25, 0.5, 0.5, 0.25], [1, 0, 0.5, 0.25, 0.5, 0.5]])
    gt = pad_targets(targets, batch=3, image_hw=(64, 128))
    assert gt.labels.tolist() == [[1, 0], [2, 0], [0, 0]]
    assert gt.mask.tolist() == [[True, False], [True, True], [False, False]]
    torch.testing.assert_close(gt.boxes[0, 0], torch.tensor([0.0, 24.0, 64.0, 40.0]))  # x by 128, y by 64
    torch.testing.assert_close(gt.boxes[1, 1], torch.tensor([32.0, 0.0, 96.0, 32.0]))


def test_protocol_and_bad_inputs(cases):
    v8, e2e = _loss(cases["v8_random"]), _loss(cases["yolo26_forward"])
    assert v8.item_names == ("box", "cls", "dfl") and e2e.item_names == ("box", "cls", "l1")
    assert v8.prepare(cases["v8_random"]["targets"], (64, 64)) is None
    assert v8.counts(None).shape == (0,)
    with pytest.raises(ValueError, match="channels"):
        v8([p.float()[:, :-1] for p in cases["v8_random"]["levels"]], cases["v8_random"]["targets"])
    with pytest.raises(TypeError, match="one2many"):
        e2e([p.float() for p in cases["yolo26_forward"]["one2many"]], cases["yolo26_forward"]["targets"])


@pytest.mark.parametrize("cfg", ["yolov8.yaml", "yolo26.yaml"])
def test_trains_a_real_model_of_the_family(cases, cfg):
    """The head's training output is what the loss takes; one step's gradient reaches every trainable parameter."""
    from models.yolo import Model, load_model_config

    config = load_model_config(cfg)
    config["scales"], config["scale"] = {"t": [0.33, 0.125, 256]}, "t"  # narrow: quick
    torch.manual_seed(0)
    model = Model(config, nc=3).train()
    end2end = cfg.startswith("yolo26")
    loss_fn = (End2EndLoss if end2end else AnchorFreeLoss)(model, gains=GAINS)
    loss, items = loss_fn(model(torch.rand(2, 3, 64, 64)), cases["v8_forward"]["targets"])
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    assert items.shape == (3,) and (items > 0).all()
    loss.backward()
    # Every trainable parameter is in the graph (DDP needs that), the box branch of a level without positives too.
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert model.model[0].conv.weight.grad.abs().sum() > 0
