"""Training the DETR families (D-FINE, RT-DETRv2): the matcher and every loss term against transformers' own
(``RTDetrHungarianMatcher``, ``DFineLoss``, ``RTDetrLoss``: the oracle), ties, a batch without boxes, and train.py
training both families.

Narrowed models keep them cheap: D-FINE's tests/fixtures/detr/dfine_tiny.yaml and a small RT-DETRv2, each with 30
queries (a 64 px image's encoder holds 84 tokens) and 10 denoising queries.
"""

from __future__ import annotations

import copy
import csv
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the DETR families need transformers (requirements-test.txt)")

from models.detr_loss import DetrLoss, split_outputs  # noqa: E402
from models.detr_matcher import MatchCosts, hungarian, union_of_matches  # noqa: E402
from models.families import DFINE, RTDETRV2  # noqa: E402
from tests.conftest import (  # noqa: E402
    keep_checkpoints_inside_epoch,
    tar_members,
    write_rectangles_dataset,
    write_tar,
)
from utils.checkpoint import load_checkpoint  # noqa: E402
from utils.engine.timing import PHASES, step_phases, time_columns  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "detr"
SMALL = {"num_queries": 30, "num_denoising": 10}
DFINE_TINY = yaml.safe_load((FIXTURES / "dfine_tiny.yaml").read_text())
DFINE_TINY["config"].update(SMALL)
RTDETRV2_TINY = {
    "family": "rtdetrv2",
    "nc": 3,
    "config": {
        **copy.deepcopy(DFINE_TINY["config"]),
        "decoder_n_points": 4,
        "encoder_in_channels": [16, 32, 64],
    },
    "backbones": {"T": {"layer_type": "basic", "depths": [1, 1, 1, 1], "hidden_sizes": [8, 16, 32, 64]}},
    "scales": {"tiny": {"params": 0, "backbone": {"name": "T", "embedding_size": 8}, "config": {}}},
}
for _key in ("max_num_bins", "reg_scale"):
    RTDETRV2_TINY["config"].pop(_key)
FAMILIES = {"dfine": (DFINE, DFINE_TINY), "rtdetrv2": (RTDETRV2, RTDETRV2_TINY)}
DETR_PHASES = step_phases(("matcher",))  # the step time's split of a DETR run: the matcher after the forward pass
# image, class, cx, cy, w, h: image 1 holds no box, image 3 the most (the denoising groups' size)
TARGETS = torch.tensor(
    [
        [0, 1, 0.50, 0.50, 0.30, 0.30],
        [0, 2, 0.30, 0.30, 0.20, 0.20],
        [2, 0, 0.60, 0.60, 0.40, 0.20],
        [3, 1, 0.25, 0.70, 0.30, 0.20],
        [3, 0, 0.70, 0.30, 0.25, 0.35],
        [3, 2, 0.50, 0.50, 0.10, 0.10],
    ]
)


@pytest.fixture
def tiny(monkeypatch):
    """Both families' scales with their narrowed one alone (``dfine-tiny.yaml``, ``rtdetrv2-tiny.yaml``)."""
    for family, table in FAMILIES.values():
        monkeypatch.setattr(family, "scales", lambda table=table: table)


def trained_model(name: str, seed: int = 0):
    """A narrowed model in training mode, its weights moved off their initialisation (D-FINE's edge heads start at
    zero, where ddf vanishes)."""
    family = FAMILIES[name][0]
    torch.manual_seed(seed)
    model = family.build_model(f"{name}-tiny.yaml")
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.add_(torch.randn_like(p) * 0.05)
    return family, model.train()


def their_sets(raw: dict, clamp: bool) -> tuple[list[dict], list[dict]]:
    """Our split of the outputs as transformers' loss methods take them (``logits``, ``pred_boxes``, ...), the
    teacher of a D-FINE layer being the last layer (itself for the last)."""
    out = split_outputs(raw, clamp)

    def theirs(s) -> dict:
        d = {"logits": s.logits, "pred_boxes": s.boxes}
        if s.corners is not None:
            last = s.teacher_corners is None
            d.update(
                pred_corners=s.corners,
                ref_points=s.refs,
                teacher_corners=s.corners if last else s.teacher_corners,
                teacher_logits=s.logits if last else s.teacher_logits,
            )
        return d

    return [theirs(s) for s in out.matched], [theirs(s) for s in out.denoising]


def per_image(matches_image, matches_query, matches_box, counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    starts = np.concatenate(([0], np.cumsum(counts)))
    found = []
    for b in range(len(counts)):
        keep = matches_image == b
        found.append((matches_query[keep], matches_box[keep] - int(starts[b])))
    return found


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_matching_and_every_loss_term_equal_transformers(tiny, name) -> None:
    """On a seeded batch (an image without boxes among them), in training mode with denoising queries: our matches
    of every set equal transformers' matcher's, and with them every term of every set (each decoder layer, D-FINE's
    pre-head, the encoder's top-k, each denoising layer) equals transformers' loss method's, times its weight,
    within 1e-5; D-FINE's box terms (L1, GIoU, fgl, ddf) given the union of the sets' matches, as the official
    criterion gives them (transformers' own criterion uses each set's matches). DEIM's class term (mal) in place of
    vfl equals transformers' DEIMv2 one."""
    from transformers.loss.loss_d_fine import DFineLoss
    from transformers.loss.loss_rt_detr import RTDetrHungarianMatcher, RTDetrLoss

    family, model = trained_model(name)
    config = model.detr.config
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    raw = family.forward_train(model, images, TARGETS)
    ours = DetrLoss(model, distributions=family.distributions)
    terms = ours.set_terms(raw, TARGETS)
    criterion = (DFineLoss if family.distributions else RTDetrLoss)(config)
    labels = [
        {"class_labels": TARGETS[TARGETS[:, 0] == b, 1].long(), "boxes": TARGETS[TARGETS[:, 0] == b, 2:6]}
        for b in range(4)
    ]
    counts = [len(t["boxes"]) for t in labels]
    matched, denoising = their_sets(raw, family.distributions)
    costs = MatchCosts(config.matcher_class_cost, config.matcher_bbox_cost, config.matcher_giou_cost)
    logits = torch.stack([s["logits"] for s in matched])
    boxes = torch.stack([s["pred_boxes"] for s in matched])
    matches, _, _ = hungarian(logits, boxes, TARGETS, costs)
    dn_groups = raw["dn_groups"]
    assert dn_groups == 10 // 3 and raw["dn_queries"] == 2 * 3 * dn_groups
    dn_indices = criterion.get_cdn_matched_indices(
        {"dn_positive_idx": [torch.cat([g * 6 + torch.arange(n) for g in range(dn_groups)]) for n in counts],
         "dn_num_group": dn_groups},
        labels,
    )  # fmt: skip
    names = list(terms)
    dn_names = [n for n in names if n.startswith("dn_")]
    assert names[: len(matched)] == [n for n in names if not n.startswith("dn_")] and len(dn_names) == len(denoising)
    own = [per_image(matches.image[k], matches.query[k], matches.box[k], counts) for k in range(len(matched))]
    if family.distributions:  # D-FINE's box terms take the union of the matches
        host = [tuple(t.numpy() for t in (matches.image[k], matches.query[k], matches.box[k])) for k in range(len(own))]
        union = per_image(*(torch.from_numpy(a) for a in union_of_matches(host)), counts)
    by_class = {}
    for k, (set_name, theirs) in enumerate(zip(names, matched + denoising)):
        if k < len(matched):
            for (q, g), (tq, tg) in zip(own[k], RTDetrHungarianMatcher(config)(theirs, labels)):
                assert q.tolist() == tq.tolist() and g.tolist() == tg.tolist(), set_name
            indices, num_boxes = own[k], float(len(TARGETS))
            boxed, box_count = (
                (union, float(sum(len(q) for q, _ in union))) if family.distributions else (indices, num_boxes)
            )
        else:
            indices, num_boxes = dn_indices, float(len(TARGETS) * dn_groups)
            boxed, box_count = indices, num_boxes
        by_class[set_name] = (theirs, indices, num_boxes)
        expected = {}
        for loss in ("vfl", "boxes", "local") if family.distributions else ("vfl", "boxes"):
            chosen = (indices, num_boxes) if loss == "vfl" else (boxed, box_count)
            for key, value in criterion.get_loss(loss, theirs, labels, *chosen).items():
                expected[key] = value * criterion.weight_dict[key]
        want = [expected["loss_vfl"], expected["loss_bbox"], expected["loss_giou"]]
        if family.distributions:
            want += [expected.get("loss_fgl", torch.tensor(0.0)), expected.get("loss_ddf", torch.tensor(0.0))]
        torch.testing.assert_close(terms[set_name], torch.stack(want).float(), atol=1e-5, rtol=1e-5, msg=set_name)
    if family.distributions:  # the terms the reference gives D-FINE's layers are there
        assert terms["layer0"][4] > 0 and terms["layer1"][3] > 0 and terms["layer1"][4] == 0
    # DEIM's matchability-aware class term in place of vfl: transformers' DEIMv2 loss method (gamma 1.5, no alpha)
    from transformers.loss.loss_deimv2 import Deimv2Loss

    criterion.gamma, criterion.mal_alpha = 1.5, None
    mal = DetrLoss(model, distributions=family.distributions, class_loss="mal")
    assert mal.item_names[0] == "mal"
    for set_name, mal_terms in mal.set_terms(raw, TARGETS).items():
        theirs, indices, num_boxes = by_class[set_name]
        expected_mal = Deimv2Loss.loss_labels_mal(criterion, theirs, labels, indices, num_boxes)["loss_mal"]
        torch.testing.assert_close(mal_terms[0], expected_mal.float() * config.weight_loss_vfl, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mal_terms[1:], terms[set_name][1:])


def test_the_union_of_matches_takes_each_querys_most_matched_box() -> None:
    """D-FINE's union of the sets' matches: every query matched anywhere, with the box it is matched to in the most
    sets, the lower row on a tie."""
    a = (np.array([0, 0, 1]), np.array([3, 5, 2]), np.array([0, 1, 4]))
    b = (np.array([0, 0, 1]), np.array([3, 5, 2]), np.array([1, 1, 3]))
    c = (np.array([0]), np.array([3]), np.array([1]))
    image, query, row = union_of_matches([a, b, c])
    assert list(zip(image, query, row)) == [(0, 3, 1), (0, 5, 1), (1, 2, 3)]


def test_matcher_is_deterministic_on_ties() -> None:
    """Queries with equal costs (the same logits and boxes) are matched the same way every time, and an image's
    matches do not depend on the other images of the batch."""
    logits = torch.zeros(1, 2, 6, 3)
    boxes = torch.tensor([0.5, 0.5, 0.2, 0.2]).expand(1, 2, 6, 4).clone()
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.2, 0.2], [0, 1, 0.5, 0.5, 0.2, 0.2], [1, 2, 0.4, 0.4, 0.2, 0.2]])
    runs = [hungarian(logits, boxes, targets, MatchCosts())[0] for _ in range(3)]
    for m in runs[1:]:
        assert all(torch.equal(a, b) for field, first in zip(m, runs[0]) for a, b in zip(field, first))
    alone = hungarian(logits[:, :1], boxes[:, :1], targets[:2], MatchCosts())[0]
    first = runs[0].image[0] == 0
    assert runs[0].query[0][first].tolist() == alone.query[0].tolist() == [0, 1]


class RecordingMarks:
    def __init__(self) -> None:
        self.phases: list[str] = []

    def mark(self, phase: str) -> None:
        self.phases.append(phase)


def test_the_detr_loss_marks_its_matching_as_a_phase_of_its_own_and_a_yolo_loss_marks_nothing(tiny) -> None:
    from models.families import YOLOV5
    from models.loss import UNMARKED

    family, model = trained_model("dfine")
    loss = family.make_loss(model, family.read_hyp(family.default_hyp_path), imgsz=64)
    assert loss.timed_phases == ("matcher",) and loss.marks is UNMARKED
    loss.marks = marks = RecordingMarks()
    raw = family.forward_train(model, torch.rand(4, 3, 64, 64), TARGETS)
    loss(raw, TARGETS)
    assert marks.phases == ["forward", "matcher"]  # the matching ends forward's time and is timed on its own
    assert step_phases(loss.timed_phases) == ("data", "forward", "matcher", "backward", "optimizer", "sync")

    yolo = YOLOV5.build_model("yolov5n.yaml", nc=3)
    yolo_loss = YOLOV5.make_loss(yolo, YOLOV5.read_hyp(YOLOV5.default_hyp_path), imgsz=64)
    assert yolo_loss.timed_phases == () and step_phases(yolo_loss.timed_phases) == PHASES
    yolo_loss.marks = yolo_marks = RecordingMarks()
    yolo.train()
    yolo_loss(yolo(torch.rand(4, 3, 64, 64)), TARGETS)
    assert yolo_marks.phases == []  # a YOLO step's marks (and its results.csv columns) are as before


def test_an_images_denoising_queries_depend_on_its_sample_and_the_groups_size_alone() -> None:
    """What makes the step the same at any world size: an image's denoising queries are the same whichever batch
    (rank) and place holds it, given the groups' size (the most boxes of one image over every rank); each group's
    positive query of a box moves its corners by less than half the box's size (the negative's by 1 to 2 halves),
    and the attention mask keeps the groups and the matching queries apart."""
    from types import SimpleNamespace

    from models.detr import DenoisingPlan, denoising_queries, sample_entropy

    config = SimpleNamespace(num_labels=3, num_queries=4, num_denoising=10, label_noise_ratio=0.5, box_noise_scale=1.0)
    embed = torch.nn.Embedding(4, 1)
    with torch.no_grad():
        embed.weight.copy_(torch.arange(4.0)[:, None])  # the embedding of a label is the label
    boxes = {"a": [[1, 0.5, 0.5, 0.2, 0.2], [2, 0.3, 0.6, 0.2, 0.1]], "b": [], "c": [[0, 0.5, 0.4, 0.1, 0.2]] * 3}

    def queries(names: list[str]) -> tuple:
        rows = [[i, *box] for i, name in enumerate(names) for box in boxes[name]]
        targets = torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)
        entropy = tuple(sample_entropy(7, 2, f"images/{name}.jpg") for name in names)
        plan = DenoisingPlan(tuple(len(boxes[n]) for n in names), 3, entropy)  # 3: the most over "every rank"
        return denoising_queries(plan, targets, config, embed)

    labels, unact, mask, meta = queries(["a", "b", "c"])
    other_labels, other_unact, _, other_meta = queries(["c", "a"])  # another rank's batch, another order
    groups, width = meta["dn_num_group"], meta["dn_num_split"][0]
    assert groups == other_meta["dn_num_group"] == 3 and width == 2 * 3 * groups
    for here, there in ((0, 1), (2, 0)):  # a, c
        assert torch.equal(labels[here], other_labels[there]) and torch.equal(unact[here], other_unact[there])
    assert not torch.equal(unact[0], unact[2])
    moved = unact[0].sigmoid().view(2 * groups, 3, 4)[:, :2]  # image a's two boxes in every half-group
    given = torch.tensor(boxes["a"])[:, 1:]
    shift = (moved[..., :2] - moved[..., 2:] / 2 - (given[:, :2] - given[:, 2:] / 2)).abs() / (given[:, 2:] / 2)
    assert (shift[0::2] < 1 + 1e-4).all() and not (shift[1::2] < 1 + 1e-4).all()  # positives near (a negative's
    # corners move by 1 to 2 half-sizes and may cross: its box is then clipped, its corners not recovered here)
    assert (labels[0].view(2 * groups, 3, 1)[:, 2] == 3).all()  # the padding slot keeps the padding label
    group = torch.arange(width) // 6
    assert torch.equal(mask[:width, :width] == 0, group[:, None] == group[None, :])
    assert (mask[width:, :width] == float("-inf")).all() and (mask[:, width:] == 0).all()


def test_an_images_denoising_noise_does_not_depend_on_where_the_dataset_lives() -> None:
    """The same image under another root (a dataset moved, or mounted at another path on another node) draws the
    same noise; two images of the same file name in different folders (folders per class) do not."""
    from models.detr import sample_entropy

    here = sample_entropy(0, 3, "/data/shapes/images/train/0001.jpg")
    assert (
        here
        == sample_entropy(0, 3, "/mnt/node7/shapes/images/train/0001.jpg")
        == sample_entropy(0, 3, "train/0001.jpg")
    )
    assert here != sample_entropy(0, 3, "/data/shapes/images/val/0001.jpg")
    assert here != sample_entropy(0, 4, "/data/shapes/images/train/0001.jpg")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_batch_without_boxes_has_a_loss_and_a_gradient_for_every_parameter(tiny, name) -> None:
    """No boxes on this rank: the loss is finite (every query a negative), and every trainable parameter, the
    denoising embedding included, gets a gradient (zero where unused), so DDP's all-reduce of them never waits."""
    family, model = trained_model(name)
    loss = family.make_loss(model, None, imgsz=64)
    raw = family.forward_train(model, torch.rand(2, 3, 64, 64), TARGETS[:0])
    value, items = loss(raw, TARGETS[:0])
    assert torch.isfinite(value) and items[0] > 0 and items[1] == items[2] == 0  # vfl on the negatives, no box
    value.backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_train_py_trains_a_detr_and_resumes_bit_exactly_inside_stage_2(
    tiny, name, train_here, tmp_path, monkeypatch
) -> None:
    """train.py trains a narrowed model for 2 epochs on the rectangles: its losses are finite, it is validated (mAP and
    the val/ loss columns) each epoch. RT-DETRv2, resumed from its checkpoint inside the no-augmentation stage (the
    second epoch, after its first step: --save-steps 1), ends with the same weights, EMA and results, bit for bit;
    both families' resumes inside the stage are also tested with their 2 ranks (test_a_detr_on_two_ranks_...)."""
    from utils.checkpoint import save_checkpoint

    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4, size=64)
    # The family's recipe without its 500 warmup steps (4 steps here): the rate is lr0 from the first step.
    recipe = yaml.safe_load((ROOT / FAMILIES[name][0].default_hyp).read_text())
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(yaml.safe_dump({**recipe, "warmup_steps": 0}))
    inside = keep_checkpoints_inside_epoch(monkeypatch, 1)  # the checkpoint written after the stage's first step
    status, log = train_here(
        "--cfg", f"{name}-tiny.yaml", "--data", data, "--epochs", "2", "--batch-size", "4",
        "--hyp", hyp, "--deterministic", "--seed", "1", "--project", tmp_path, "--name", "run", "--loggers",
        *(["--save-steps", "1"] if name == "rtdetrv2" else []),
    )  # fmt: skip
    assert status == 0, log
    run = tmp_path / "run"
    with open(run / "results.csv", newline="") as f:
        rows = [{k.strip(): float(v) for k, v in row.items() if k and v.strip()} for row in csv.DictReader(f)]
    names = FAMILIES[name][0].loss_names
    assert len(rows) == 2 and all(f"val/{n}_loss" in rows[0] for n in names)
    total = [sum(r[f"train/{n}_loss"] for n in names) for r in rows]
    # Finite and positive each epoch. Whether it falls is no test at 4 steps: the stage changes the images between
    # the two epochs, and in fp32 (a CPU without bf16) RT-DETRv2's rose (26.1, 28.1) where bf16's fell.
    assert all(math.isfinite(t) and t > 0 for t in total), total
    assert all(0 <= r["metrics/mAP_0.5:0.95"] <= 1 for r in rows)
    # The matcher's share of the step time: a column after time/forward, and in each epoch's split in the log.
    with open(run / "results.csv", newline="") as f:
        header = [c.strip() for c in f.readline().split(",")]
    assert header[-len(time_columns(DETR_PHASES)) :] == list(time_columns(DETR_PHASES))
    assert all(r["time/matcher"] > 0 and r["time/forward"] > 0 for r in rows), rows
    assert all(sum(r[f"time/{p}"] for p in DETR_PHASES) <= 1.0 + 1e-4 for r in rows)
    assert re.search(r"epoch 1: .*step time: data \d+%, forward\+loss \d+%, matcher \d+%, backward", log), log[-3000:]

    if name != "rtdetrv2":
        return
    # The stage goes on from stage 1's best epoch, epoch 0 (validated), the EMA started again: the stage's updates.
    assert "the no-augmentation stage begins from stage 1's best epoch, 0" in log
    assert len(inside) == 1 and inside[0]["mid_epoch"]["batch"] == 1 and inside[0]["updates"] == 1
    again = tmp_path / "again"
    shutil.copytree(run, again)
    save_checkpoint(inside[0], again / "weights" / "last.pt")
    status, log = train_here("--resume", again / "weights" / "last.pt", "--batch-size", "4")
    assert status == 0, log
    resumed, straight = (load_checkpoint(r / "weights" / "last.pt") for r in (again, run))
    assert resumed["epoch"] == straight["epoch"] == 1 and resumed["updates"] == straight["updates"] == 2
    for key in ("model", "ema"):
        assert all(torch.equal(resumed[key][k], straight[key][k]) for k in straight[key]), key
    assert last_losses(again / "results.csv", names) == last_losses(run / "results.csv", names)


@pytest.mark.slow
def test_train_py_trains_a_narrow_dfine_with_deims_recipe(tiny, train_here, tmp_path) -> None:
    """DEIM's hyp file through train.py: 2 epochs of a narrowed D-FINE, mosaics and mixups in the first (the window's
    shares of a 2-epoch run), the stage in the second; its MAL classification term named in results.csv."""
    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4, size=64)
    recipe = yaml.safe_load((ROOT / "data/hyps/hyp.deim-dfine.yaml").read_text())
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(yaml.safe_dump({**recipe, "warmup_steps": 0}))  # 4 steps: the rate is lr0 from the first
    status, log = train_here(
        "--cfg", "dfine-tiny.yaml", "--data", data, "--epochs", "2", "--batch-size", "4", "--hyp", hyp,
        "--seed", "1", "--project", tmp_path, "--name", "run", "--noval",
    )  # fmt: skip
    assert status == 0, log
    assert "mosaic and mixup only in epochs 0 to 0 of 0 to 1" in log and "the no-augmentation stage begins" in log
    with open(tmp_path / "run/results.csv", newline="") as f:
        rows = [{k.strip(): float(v) for k, v in row.items() if k and v.strip()} for row in csv.DictReader(f)]
    names = ("mal", "box", "giou", "fgl", "ddf")
    assert len(rows) == 2 and "train/vfl_loss" not in rows[0]
    assert all(math.isfinite(r[f"train/{n}_loss"]) for r in rows for n in names) and rows[0]["train/mal_loss"] > 0


@pytest.mark.slow
def test_a_detr_trains_on_bad_data_and_from_tar_shards_skipping_and_counting_what_is_broken(
    tiny, train_here, tmp_path
) -> None:
    """A D-FINE from loose files holding a corrupt image and a label file of 4 columns, then an RT-DETRv2 from tar
    shards (made from those files by shards.py) with a corrupt image and a label without its image written into a
    shard: each broken sample is named, skipped and counted, and each run trains its epoch on the rest."""
    from shards import main as make_shards

    data = write_rectangles_dataset(tmp_path / "loose", n_train=8, n_val=4, size=64)
    train_dir = tmp_path / "loose/images/train"
    (train_dir / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    shutil.copyfile(next(train_dir.glob("0*.jpg")), train_dir / "badlabel.jpg")
    (tmp_path / "loose/labels/train/badlabel.txt").write_text("0 0.5 0.5 0.2\n")  # 4 columns
    common = ("--epochs", "1", "--batch-size", "4", "--project", tmp_path, "--noplots", "--loggers")
    status, log = train_here("--cfg", "dfine-tiny.yaml", "--data", data, "--name", "from-files", *common)
    assert status == 0, log
    assert f"{train_dir / 'broken.jpg'}: corrupt image, skipped" in log
    assert f"{tmp_path / 'loose/labels/train/badlabel.txt'}: row 1: 4 columns" in log
    assert "8 labelled, 0 backgrounds without labels, 0 empty, 2 corrupt" in log

    assert make_shards(["--data", str(data), "--out", str(tmp_path / "sh"), "--max-count", "4", "--workers", "1"]) == 0
    shard = tmp_path / "sh/train-000001.tar"
    broken = {"bad.jpg": b"garbage", "bad.txt": b"0 0.5 0.5 0.2 0.2\n", "orphan.txt": b"1 0.5 0.5 0.1 0.1\n"}
    write_tar(shard, tar_members(shard) | broken)
    status, log = train_here(
        "--cfg", "rtdetrv2-tiny.yaml", "--data", tmp_path / "sh/data.yaml", "--name", "from-shards", *common
    )
    assert status == 0, log
    assert f"{shard}/bad.jpg: corrupt image, skipped" in log and f"{shard}/orphan: no image member" in log
    assert "10 samples in 2 shards: 8 labelled, 0 backgrounds without labels, 0 empty, 2 corrupt" in log
    for run in ("from-files", "from-shards"):
        rows = (tmp_path / run / "results.csv").read_text().strip().splitlines()
        assert len(rows) == 2 and (tmp_path / run / "weights/last.pt").is_file(), run


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over the floating-point tensors of two state dicts (BN variances left out)."""
    names = [k for k, v in b.items() if v.is_floating_point() and not k.endswith("running_var")]
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in names])
    return float(diff.norm() / torch.cat([b[k].double().flatten() for k in names]).norm())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_detr_on_two_ranks_equals_one_process_survives_an_empty_rank_and_resumes_inside_stage_2(
    tiny, tmp_path, monkeypatch, name
) -> None:
    """2 epochs of a narrow D-FINE or RT-DETRv2 with denoising queries and the recipe (its clipping, schedule and
    augmentations, the no-augmentation stage in the second epoch going on from stage 1's best epoch: epoch 0,
    validated on every rank, its best.pt read by rank 0 and sent to rank 1) but SGD, global batch 4, --sync-bn, once
    on 1 process and once on 2 ranks whose rank 1 holds no box in its first batch:

    - the 2 ranks end with the weights and EMA of the one process (1e-7 relative) and its losses (4 digits): the
      denoising groups are sized by the most boxes of one image over every rank and each image's noise comes from
      (seed, epoch, its sample); the empty rank finishes its step;
    - each run's checkpoint inside the stage (after its first step; --save-steps 1), resumed on 1 process, ends where
      the one process ended: from the one process's checkpoint bit for bit, from the 2 ranks' within 1e-7.

    SGD, as the YOLO families' test: with the recipe's AdamW the 2 ranks are within 2e-5 after the first epoch and
    not after the second, by rounding alone (docs/training.md, "The same step at any world size"; in float64 they
    agree within 1e-12, and 1 against 2 threads of one process part as far: bench/detr_world_size_drift.py)."""
    import train
    from tests.conftest import _main_writing_to, rank_jobs, run_forked
    from utils.checkpoint import host_snapshot, save_checkpoint
    from utils.data.samplers import ShardedSampler
    from utils.engine.trainer import Trainer

    seed = 3
    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=2, size=64)
    empty = ShardedSampler(8, world_size=2, rank=1, shuffle=True, seed=seed).shard(0)[:2]
    for i in empty:  # rank 1's first batch: no boxes
        (data.parent / "labels" / "train" / f"{i:04d}.txt").write_text("")
    family = FAMILIES[name][0]
    recipe = yaml.safe_load((ROOT / family.default_hyp).read_text())
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(yaml.safe_dump({**recipe, "warmup_steps": 0}))
    monkeypatch.setattr(family, "recipe_optimizer", "SGD")  # the recipe's step (one per batch) with SGD
    checkpoint = Trainer.checkpoint

    def keep_inside_the_stage(self, epoch: int, mid_epoch: dict | None) -> dict:
        ckpt = checkpoint(self, epoch, mid_epoch)
        if mid_epoch and mid_epoch["epoch"] == 1:
            save_checkpoint(host_snapshot(ckpt), self.run.save_dir / "inside.pt")
        return ckpt

    monkeypatch.setattr(Trainer, "checkpoint", keep_inside_the_stage)
    monkeypatch.setenv("YOLO_LOG_LEVEL", "DEBUG")  # each rank logs its batches' files
    common = [
        "--data", str(data), "--cfg", f"{name}-tiny.yaml", "--hyp", str(hyp), "--epochs", "2", "--batch-size", "4",
        "--save-steps", "1", "--deterministic", "--no-amp", "--seed", str(seed), "--sync-bn",
        "--name", "exp", "--imgsz", "64", "--workers", "0", "--device", "cpu", "--noplots", "--loggers",
    ]  # fmt: skip
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    argv = [*common, "--project", str(tmp_path / "ranks")]
    ranks = rank_jobs(lambda rank: _main_writing_to(train.main, argv, logs[rank]), 2)
    single = (train.main, ([*common, "--project", str(tmp_path / "single")],), {})
    assert run_forked([single, *ranks], timeout=300) == [0, 0, 0], Path(logs[0]).read_text()[-3000:]
    assert f"rank 1 epoch 0 batch 0: {' '.join(f'{i:04d}.jpg' for i in empty)}" in Path(logs[1]).read_text()
    straight = load_checkpoint(tmp_path / "single/exp/weights/last.pt")
    two = load_checkpoint(tmp_path / "ranks/exp/weights/last.pt")
    assert "the no-augmentation stage begins from stage 1's best epoch, 0" in Path(logs[0]).read_text()
    assert two["updates"] == straight["updates"] == 2  # the EMA started again at the stage: its 2 steps
    for key in ("model", "ema"):  # measured: docs/benchmarks.md; per-rank denoising groups and noise would exceed it
        assert relative_difference(two[key], straight[key]) <= 1e-7, key
    losses = [last_losses(tmp_path / run / "exp" / "results.csv", family.loss_names) for run in ("single", "ranks")]
    assert losses[0] == losses[1] and all(v > 0 for v in losses[0][:4]), losses

    for run in ("single", "ranks"):  # resumed inside the stage, on 1 process
        shutil.copytree(tmp_path / run / "exp", tmp_path / f"{run}-resumed")
        inside = tmp_path / run / "exp" / "inside.pt"
        assert load_checkpoint(inside)["mid_epoch"]["batch"] == 1
        shutil.copyfile(inside, tmp_path / f"{run}-resumed" / "weights" / "last.pt")
    resumes = [
        (train.main, (["--resume", str(tmp_path / f"{run}-resumed" / "weights" / "last.pt")],), {})
        for run in ("single", "ranks")
    ]
    assert run_forked(resumes, timeout=300) == [0, 0]
    from_single, from_ranks = (load_checkpoint(tmp_path / f"{r}-resumed/weights/last.pt") for r in ("single", "ranks"))
    for key in ("model", "ema"):
        assert all(torch.equal(from_single[key][k], straight[key][k]) for k in straight[key]), key
        assert relative_difference(from_ranks[key], straight[key]) <= 1e-7, key


def last_losses(results_csv: Path, names: tuple[str, ...]) -> list[float]:
    """The last row's training losses, to 4 digits."""
    with open(results_csv, newline="") as f:
        rows = [{k.strip(): v.strip() for k, v in row.items() if k} for row in csv.DictReader(f)]
    return [float(f"{float(rows[-1][f'train/{n}_loss']):.4g}") for n in names]
