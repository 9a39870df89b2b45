"""The DETR recipes' parts that do not need the DETR losses: the step schedule, the parameter groups, the
augmentations (torchvision v2's zoom-out, IoU crop and photometric distortion) and the no-augmentation stage, where
augmentation stops and the EMA starts again, resumed bit-exactly across it.

The stage runs through the engine with the contract's toy family (tests/test_train_family_contract.py) given the
recipe's record groups, so no DETR has to train here.
"""

from __future__ import annotations

import math
import re
import shutil
import warnings
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import yaml
from conftest import keep_checkpoints_inside_epoch
from test_train import results_rows
from test_train_family_contract import PRESET, ToyFamily, ToyGains

import models.families as families
from models.families import DFINE, family_of
from models.families.detr import DetrFamily, class_loss_of
from utils.checkpoint import load_checkpoint, save_checkpoint
from utils.data.augmentations import ZoomCrop, iou_crop_window, photometric_distort, zoom_out_crop
from utils.data.dataset import YoloDataset
from utils.data.shapes import generate_shapes
from utils.engine.lr_schedule import FlatCosine
from utils.errors import UserError
from utils.hyp import OptimisationHyp, StepScheduleHyp, ZoomCropHyp
from utils.optimizer import build_optimizer

ROOT = Path(__file__).resolve().parents[1]

# ---- the step schedule -------------------------------------------------------------------------------------------


def test_flat_cosine_warms_up_holds_decays_to_the_stage_and_stays_there() -> None:
    """10 epochs of 10 steps, the stage from epoch 8: warmup over 10 steps, flat to halfway through the 80 steps
    before the stage (step 45), a cosine to lrf at step 80, lrf after; a function of the step alone."""
    hyp = StepScheduleHyp(warmup_steps=10, flat_share=0.5)
    schedule = FlatCosine(hyp, 0.5, epochs=10, batches_per_epoch=10, stage=8)
    assert schedule(0) == pytest.approx(0.1) and schedule(4) == pytest.approx(0.5) and schedule(9) == 1.0
    assert schedule(10) == schedule(44) == 1.0
    assert schedule(62.5) == pytest.approx(0.75)  # the cosine's middle
    assert 0.5 < schedule(79) < schedule(46) < 1.0
    assert schedule(80) == schedule(99) == 0.5
    assert FlatCosine(hyp.replace(warmup_power=2.0), 0.5, 10, 10, 8)(4) == pytest.approx(0.25)  # DEIM's warmup
    dfine = DFINE.read_hyp(DFINE.default_hyp_path)  # warmup, then lr0 to the end
    constant = FlatCosine(dfine, dfine.lrf, epochs=160, batches_per_epoch=100, stage=148)
    assert constant(249) == pytest.approx(0.5) and constant(500) == constant(14_800) == constant(15_999) == 1.0
    refitted = FlatCosine(hyp, 0.5, epochs=20, batches_per_epoch=10, stage=18)
    schedule.refit(20, 18)  # a time budget's new length
    assert [schedule(s) for s in range(200)] == [refitted(s) for s in range(200)]


def test_the_stage_epoch_follows_the_share_and_keeps_the_last_epoch_of_any_run() -> None:
    hyp = DFINE.read_hyp(DFINE.default_hyp_path)  # no_aug_share 0.075: 12 of 160
    assert DFINE.stage_epoch(160, 10, hyp) == 148
    assert DFINE.stage_epoch(24, 10, hyp) == 22
    assert DFINE.stage_epoch(2, 10, hyp) == 1 and DFINE.stage_epoch(3, 10, hyp) == 2
    assert DFINE.stage_epoch(1, 10, hyp) is None and DFINE.stage_epoch(24, 10, hyp.replace(no_aug_share=0)) is None
    rtdetrv2 = family_of("rtdetrv2")
    assert rtdetrv2.stage_epoch(120, 10, rtdetrv2.read_hyp(rtdetrv2.default_hyp_path)) == 117
    assert family_of("yolo11").stage_epoch(50, 10, None) == 40  # YOLO's --close-mosaic


# ---- the parameter groups ----------------------------------------------------------------------------------------


def test_detr_parameter_groups_list_each_tensor_once_with_the_backbone_rate_and_no_decay_on_norms_or_biases() -> None:
    pytest.importorskip("transformers", reason="the DETR families need transformers (requirements-test.txt)")
    from test_detr import TINY

    model = _tiny_dfine(TINY)
    hyp = DFINE.read_hyp(DFINE.default_hyp_path)
    groups = DFINE.parameter_groups(model, 1e-4, hyp=hyp)
    listed = [p for g in groups for p in g["params"]]
    assert len({id(p) for p in listed}) == len(listed) == len(list(model.parameters()))  # tied heads once
    named = {id(p): name for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a parameter listed twice
        optimizer = build_optimizer(model, "AdamW", hyp.lr0, hyp.momentum, 1e-4, groups=groups)
    norm_types = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
    norms = {id(p) for m in model.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)}
    for group in optimizer.param_groups:
        names = [named[id(p)] for p in group["params"]]
        in_backbone = {".backbone." in f".{n}" for n in names}
        assert len(in_backbone) == 1, "a group is all backbone or none of it"
        assert group["lr"] == pytest.approx(hyp.lr0 * (hyp.backbone_lr if in_backbone.pop() else 1.0))
        undecayed = [n for n, p in zip(names, group["params"]) if n.endswith(".bias") or id(p) in norms]
        assert (group["weight_decay"] == 0) == bool(undecayed) and len(undecayed) in (0, len(names))
    assert sorted(len(g["params"]) > 0 for g in optimizer.param_groups) == [True] * 4


def test_a_recipes_clip_norm_is_per_image_of_an_optimizer_step() -> None:
    """The losses are sums over the step's images (the contract's scale), the references' a mean over them: the
    recipe's clip norm (0.1) scales with the images of an optimizer step."""
    pytest.importorskip("transformers", reason="the DETR families need transformers (requirements-test.txt)")
    from test_detr import TINY

    from utils.engine.config import TrainConfig
    from utils.engine.optimization import build_optimization
    from utils.optimizer import OptimizerChoice

    model = _tiny_dfine(TINY)
    hyp = DFINE.read_hyp(DFINE.default_hyp_path)
    choice = OptimizerChoice("AdamW", hyp.lr0, hyp.momentum, accumulate=2, reason="test", scale_decay=False)
    optim = build_optimization(model, DFINE, TrainConfig(batch_size=8), choice, hyp, needs_scaler=False)
    assert optim.clip_norm == pytest.approx(hyp.clip_norm * 8 * 2)


def _tiny_dfine(table: dict) -> nn.Module:
    """The narrowed D-FINE of tests/test_detr.py, built from its scale table."""
    scales = DFINE.scales
    DFINE.scales = lambda: table  # type: ignore[method-assign]
    try:
        return DFINE.build_model(f"dfine-{next(iter(table['scales']))}.yaml", nc=3)
    finally:
        DFINE.scales = scales  # type: ignore[method-assign]


# ---- the augmentations -------------------------------------------------------------------------------------------

RED = (0, 0, 255)


def _scene() -> tuple[np.ndarray, np.ndarray]:
    """A grey 80 x 60 image with a red and a green box; labels [cls, x1, y1, x2, y2] in pixels."""
    img = np.full((60, 80, 3), 100, np.uint8)
    img[10:30, 20:50] = RED
    img[40:56, 60:76] = (0, 255, 0)
    return img, np.array([[0, 20, 10, 50, 30], [1, 60, 40, 76, 56]], np.float32)


def test_zoom_out_and_iou_crop_keep_each_box_on_its_object_and_are_a_function_of_the_generator() -> None:
    img, labels = _scene()
    zoomed = cropped = 0
    for i in range(100):
        out, kept = zoom_out_crop(img, labels, np.random.default_rng([7, 0, i]), ZoomCrop(), max_side=80)
        again = zoom_out_crop(img, labels, np.random.default_rng([7, 0, i]), ZoomCrop(), max_side=80)
        assert np.array_equal(out, again[0]) and np.array_equal(kept, again[1])
        assert max(out.shape[:2]) <= 80 and out.dtype == np.uint8
        zoomed += int((out == 0).all(-1).any())  # the zoom-out canvas's black shows
        cropped += int(out.shape[1] * 60 != out.shape[0] * 80)  # a crop of another aspect ratio
        for cls, x1, y1, x2, y2 in kept:
            assert x2 - x1 >= 1 and y2 - y1 >= 1 and x1 >= 0 and y1 >= 0 and x2 <= out.shape[1] and y2 <= out.shape[0]
            inner = out[int(np.ceil(y1)) + 1 : int(y2) - 1, int(np.ceil(x1)) + 1 : int(x2) - 1].reshape(-1, 3)
            colour = RED if cls == 0 else (0, 255, 0)
            assert (np.abs(inner.astype(int) - colour).max(1) < 40).all(), f"sample {i}: box {cls} off its object"
    assert zoomed > 20 and cropped > 20


def test_the_iou_crop_drops_boxes_whose_centre_it_leaves_out_and_keeps_images_without_boxes() -> None:
    img, labels = _scene()
    seen_drop = False
    rates = ZoomCrop(zoom_out=0.0, iou_crop=1.0)
    for i in range(50):
        out, kept = zoom_out_crop(img, labels, np.random.default_rng([3, 0, i]), rates, max_side=80)
        seen_drop |= len(kept) < 2
    assert seen_drop
    assert iou_crop_window(np.zeros((0, 4)), (80, 60), np.random.default_rng(0)) is None
    out, kept = zoom_out_crop(img, labels[:0], np.random.default_rng(1), ZoomCrop(zoom_out=0.0), max_side=80)
    assert np.array_equal(out, img) and kept.shape == (0, 5)


def test_photometric_distortion_is_seeded_and_off_at_probability_0() -> None:
    img, _ = _scene()
    a = photometric_distort(img, np.random.default_rng(5), 0.5)
    assert np.array_equal(a, photometric_distort(img, np.random.default_rng(5), 0.5))
    assert a.shape == img.shape and a.dtype == np.uint8
    assert photometric_distort(img, np.random.default_rng(5), 0.0) is img
    changed = [not np.array_equal(photometric_distort(img, np.random.default_rng(i), 1.0), img) for i in range(5)]
    assert all(changed)


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=6, n_val=2, imgsz=64, seed=0)


def test_a_recipe_dataset_augments_by_seed_epoch_index_and_not_from_the_stage_epoch(shapes_root) -> None:
    hyp = ZoomCropHyp(**{**ZoomCropHyp().to_dict(), "mosaic": 0.0, "hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0})
    options = {"augment": True, "hyp": hyp, "close_mosaic_epoch": 2, "workers": 0, "verbose": False}
    dataset = YoloDataset(str(shapes_root / "images/train"), 64, 4, **options)
    again = YoloDataset(str(shapes_root / "images/train"), 64, 4, **options)
    for index in range(6):
        sample, same = dataset[(0, index)], again[(0, index)]
        assert torch.equal(sample[0], same[0]) and torch.equal(sample[1], same[1])
        assert sample[0].shape == (3, 64, 64)
    before = [dataset[(e, i)] for e in (0, 1) for i in range(6)]
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(before[:6], before[6:]))  # epochs differ
    plain = YoloDataset(str(shapes_root / "images/train"), 64, 4, **{**options, "augment": False})
    for i in range(6):  # in the stage: every epoch the plain letterboxed image, no flip, no crop
        for epoch in (2, 3):
            staged = dataset[(epoch, i)]
            assert torch.equal(staged[0], plain[(epoch, i)][0])
            torch.testing.assert_close(staged[1], plain[(epoch, i)][1], atol=1e-5, rtol=0)


def test_deims_mosaic_and_mixup_window_follows_the_run_and_holds_them_to_its_epochs(
    shapes_root, monkeypatch, tmp_path
) -> None:
    """DEIM's recipe: mosaic and mixup in epochs 4 to 78 of 160, the shares rounded as the stage's for another run
    length; in the dataset every sample of the window a mosaic mixed with another (probabilities 1 here), none
    before or after it, the stage plain; each sample a function of (seed, epoch, index)."""
    import utils.data.dataset as dataset_module

    deim = DFINE.read_hyp(ROOT / "data/hyps/hyp.deim-dfine.yaml")
    assert DFINE.mosaic_epochs(160, deim) == (4, 78) and DFINE.stage_epoch(160, 10, deim) == 148
    assert DFINE.mosaic_epochs(20, deim) == (0, 10) and DFINE.mosaic_epochs(2, deim) == (0, 1)
    assert DFINE.mosaic_epochs(160, DFINE.read_hyp(DFINE.default_hyp_path)) == (0, 160)  # D-FINE's: no window
    assert family_of("yolo11").mosaic_epochs(160, None) is None
    # its classification loss: MAL at the gain `mal`, in the varifocal loss's place; both gains set is refused
    assert class_loss_of(deim) == "mal" and class_loss_of(DFINE.read_hyp(DFINE.default_hyp_path)) == "vfl"
    with pytest.raises(UserError, match="'vfl' 1 and 'mal' 1"):
        class_loss_of(deim.replace(vfl=1.0))
    both = tmp_path / "hyp.both.yaml"  # a hyp file asking for both: refused where it is read, naming it
    deim_text = (ROOT / "data/hyps/hyp.deim-dfine.yaml").read_text(encoding="utf-8")
    both.write_text(re.sub(r"(?m)^vfl: 0\.0", "vfl: 1.0", deim_text))
    with pytest.raises(UserError, match=f"^{re.escape(str(both))}: 'vfl' 1 and 'mal' 1: set the gain of one"):
        DFINE.read_hyp(both)
    mosaics: list[int] = []
    mixed: list[int] = []
    original_mosaic, original_mixup = YoloDataset._mosaic, dataset_module.mixup

    def counting_mosaic(self, index, rng, epoch=0):
        mosaics.append(epoch)
        return original_mosaic(self, index, rng, epoch)

    def counting_mixup(*args):
        mixed.append(1)
        return original_mixup(*args)

    monkeypatch.setattr(YoloDataset, "_mosaic", counting_mosaic)
    monkeypatch.setattr(dataset_module, "mixup", counting_mixup)
    hyp = deim.replace(mosaic=1.0, mixup=1.0)
    options = {"augment": True, "hyp": hyp, "close_mosaic_epoch": 4, "mosaic_epochs": (1, 3), "workers": 0}
    dataset = YoloDataset(str(shapes_root / "images/train"), 64, 4, **options, verbose=False)
    again = YoloDataset(str(shapes_root / "images/train"), 64, 4, **options, verbose=False)
    for epoch in range(5):
        mosaics.clear(), mixed.clear()
        samples = [dataset[(epoch, i)] for i in range(6)]
        inside = 1 <= epoch < 3
        assert mosaics == ([epoch] * 12 if inside else []), epoch  # a mosaic and its mixup partner's
        assert len(mixed) == (6 if inside else 0), epoch
        for i, sample in enumerate(samples):
            same = again[(epoch, i)]
            assert torch.equal(sample[0], same[0]) and torch.equal(sample[1], same[1])
    plain = YoloDataset(str(shapes_root / "images/train"), 64, 4, **{**options, "augment": False}, verbose=False)
    assert all(torch.equal(dataset[(4, i)][0], plain[(4, i)][0]) for i in range(6))  # the stage: plain images


# ---- the stage through the engine -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecipeToyHyp(ZoomCropHyp, ToyGains, StepScheduleHyp, OptimisationHyp):
    """The toy family's gains in the DETR recipes' record groups."""


class RecipeToyFamily(ToyFamily):
    hyp_type = RecipeToyHyp
    recipe_optimizer = "AdamW"
    stage_epoch = DetrFamily.stage_epoch


@pytest.mark.slow
def test_the_stage_stops_augmentation_restarts_the_ema_and_resumes_bit_exactly(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    """2 epochs of 2 steps: the stage is the last epoch. A run killed after the first epoch (resumed across the
    stage's start) and one killed inside the stage (its mid-epoch checkpoint, --save-steps 1) end with the
    uninterrupted run's weights and EMA, bit for bit."""
    hyp_file = tmp_path / "hyp.recipe-toy.yaml"
    values = {**RecipeToyHyp().to_dict(), **PRESET, "warmup_steps": 2.0, "flat_share": 0.5, "fliplr": 0.5}
    hyp_file.write_text(yaml.safe_dump(values))
    monkeypatch.setitem(families.FAMILIES, "toy", RecipeToyFamily(hyp_file))
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump({"family": "toy", "nc": 2, "backbone": [], "head": []}))
    args = ["--data", rectangles_yaml, "--cfg", cfg, "--epochs", "2", "--save-period", "1", "--noval"]
    inside = keep_checkpoints_inside_epoch(monkeypatch, 1)  # the checkpoint written after the stage's first step
    status, log = train_here(*args, "--save-steps", "1", "--project", tmp_path / "runs", "--name", "straight")
    assert status == 0, log
    straight = tmp_path / "runs/straight"
    assert log.count("the no-augmentation stage begins") == 1 and "epoch 1: the no-augmentation stage" in log
    assert "AdamW at the hyp file's lr0" in log
    last = load_checkpoint(straight / "weights/last.pt")
    assert last["updates"] == 2  # 16 images, batch 8: the EMA counts the stage's 2 steps only
    # Each epoch's last step's rate: warmup over 2 steps (step 1: lr0), lrf from the stage's first step (2) on.
    assert [float(r["x/lr0"]) for r in results_rows(straight)] == pytest.approx([0.003, 0.003 * 0.5])
    assert len(inside) == 1 and inside[0]["mid_epoch"]["batch"] == 1 and inside[0]["updates"] == 1
    for name, source in (("after-stage-1", straight / "weights/epoch0.pt"), ("inside-stage-2", inside[0])):
        resumed = resumed_copy(train_here, straight, tmp_path / name, source)
        assert resumed["updates"] == last["updates"]
        for key in ("model", "ema"):
            assert all(torch.equal(resumed[key][k], last[key][k]) for k in last[key]), (name, key)


def resumed_copy(train_here, run: Path, copy: Path, checkpoint: Path | dict, best: Path | None = None) -> dict:
    """A copy of the run folder ``run`` resumed from ``checkpoint`` (a file, or a checkpoint kept in memory) as its
    last.pt, with ``best`` as its best.pt where given; the resumed run's last checkpoint."""
    shutil.copytree(run, copy)
    if best is not None:
        shutil.copyfile(best, copy / "weights/best.pt")
    if isinstance(checkpoint, dict):
        save_checkpoint(checkpoint, copy / "weights/last.pt")
    else:
        shutil.copyfile(checkpoint, copy / "weights/last.pt")
    status, log = train_here("--resume", copy / "weights/last.pt")
    assert status == 0, log
    return load_checkpoint(copy / "weights/last.pt")


@pytest.mark.slow
@pytest.mark.parametrize("ema_restart", [1.0, 0.0])
def test_the_stage_goes_on_from_stage_1s_best_epoch_and_resumes_bit_exactly(
    train_here, rectangles_yaml, tmp_path, monkeypatch, ema_restart
) -> None:
    """3 epochs of 2 steps, each validated, the stage the last; the fitness is scripted so that epoch 0 is stage 1's
    best, not its last. The stage's first batch starts from epoch 0's weights and optimizer state
    (weights/best.pt), and the EMA starts again from those weights (stage_ema_restart 1) or goes on from epoch 0's
    with its update count (0). With the restart, runs resumed at the stage's start (epoch1.pt) and inside it
    (--save-steps 1) end with the uninterrupted run's weights and EMA, bit for bit."""
    import utils.engine.run_record as run_record
    import utils.engine.trainer as trainer_module

    hyp_file = tmp_path / "hyp.recipe-toy.yaml"
    values = {
        **RecipeToyHyp().to_dict(),
        **PRESET,
        "warmup_steps": 2.0,
        "no_aug_share": 0.1,
        "stage_ema_restart": ema_restart,
    }
    hyp_file.write_text(yaml.safe_dump(values))
    monkeypatch.setitem(families.FAMILIES, "toy", RecipeToyFamily(hyp_file))
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump({"family": "toy", "nc": 2, "backbone": [], "head": []}))
    scripted: list[float] = []
    monkeypatch.setattr(run_record, "fitness", lambda results: scripted.pop(0))
    reloaded: list[tuple[int, dict, dict]] = []
    original_reload = trainer_module.reload

    def watching(optim, model, ckpt) -> None:
        original_reload(optim, model, ckpt)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        reloaded.append((ckpt["epoch"], state, deepcopy(optim.optimizer.state_dict()["state"])))

    monkeypatch.setattr(trainer_module, "reload", watching)
    inside = keep_checkpoints_inside_epoch(monkeypatch, 2)
    scripted[:] = [0.5, 0.1, 0.05]
    args = ["--data", rectangles_yaml, "--cfg", cfg, "--epochs", "3", "--save-period", "1", "--save-steps", "1"]
    status, log = train_here(*args, "--project", tmp_path / "runs", "--name", "straight")
    assert status == 0, log
    straight = tmp_path / "runs/straight"
    assert "epoch 2: the no-augmentation stage begins from stage 1's best epoch, 0 (weights/best.pt)" in log
    assert ("the EMA started again from its weights" in log) == bool(ema_restart), log
    best, epoch1, last = (load_checkpoint(straight / f"weights/{n}.pt") for n in ("epoch0", "epoch1", "last"))
    assert len(reloaded) == 1 and reloaded[0][0] == 0
    _, weights, moments = reloaded[0]
    assert all(torch.equal(weights[k], best["model"][k]) for k in best["model"])
    assert any(not torch.equal(weights[k], epoch1["model"][k]) for k in epoch1["model"])  # not the last epoch's
    assert all(torch.equal(moments[i]["exp_avg"], s["exp_avg"]) for i, s in best["optimizer"]["state"].items())
    stage_steps = inside[0]["updates"] - (0 if ema_restart else best["updates"])
    assert stage_steps == 1 and last["updates"] == inside[0]["updates"] + 1 and inside[0]["mid_epoch"]["batch"] == 1
    if not ema_restart:  # the EMA went on from epoch 0's: the official trainers' code
        assert last["updates"] == best["updates"] + 2 == 4
        return
    # The restart: the EMA counts the stage's 2 steps only; after the stage's first step it is epoch 0's weights
    # (not its EMA) moved toward the model's by the ramp's first weight.
    assert last["updates"] == 2
    decay = values["ema_decay"] * (1 - math.exp(-1 / values["ema_tau"]))
    for k, v in inside[0]["ema"].items():
        if v.dtype.is_floating_point:
            expected = torch.lerp(best["model"][k].float(), inside[0]["model"][k].float(), 1 - decay)
            torch.testing.assert_close(v.float(), expected, rtol=1e-5, atol=1e-7, msg=k)
    for name, source in (("at-the-stage", straight / "weights/epoch1.pt"), ("inside-the-stage", inside[0])):
        scripted[:] = [0.05]  # the stage's one validated epoch
        # best.pt as it was at the stage (the run's end strips its optimizer): epoch 0's, written with it
        resumed = resumed_copy(train_here, straight, tmp_path / name, source, best=straight / "weights/epoch0.pt")
        assert resumed["updates"] == last["updates"]
        for key in ("model", "ema"):
            assert all(torch.equal(resumed[key][k], last[key][k]) for k in last[key]), (name, key)
