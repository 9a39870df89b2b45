"""--image-weights (weighted per-epoch draw, the same on every rank and after a resume) and --quad collate."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import main_on_ranks, write_rectangles_dataset
from test_train import train_args

import train
import utils.engine.step as step_module
from utils.checkpoint import load_checkpoint
from utils.data.image_weights import (
    class_weights_from_maps,
    labels_to_class_weights,
    labels_to_image_weights,
    weighted_draw,
)
from utils.data.quad import quad_collate
from utils.data.samplers import WeightedShardedSampler


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory) -> Path:
    return write_rectangles_dataset(tmp_path_factory.mktemp("small"), n_train=8, n_val=4)


def _rare_class_labels(n: int = 200, rare_every: int = 10) -> list[np.ndarray]:
    """Images with one class-0 box each; every ``rare_every``-th has a class-1 box instead."""
    return [np.array([[1 if i % rare_every == 0 else 0, 0.5, 0.5, 0.2, 0.2]]) for i in range(n)]


def test_two_ranks_draw_the_same_list_and_take_disjoint_shards() -> None:
    labels = _rare_class_labels(50)
    weights = labels_to_image_weights(labels, labels_to_class_weights(labels, 2))
    ranks = [WeightedShardedSampler(50, world_size=2, rank=r, seed=3) for r in range(2)]
    for s in ranks:
        s.set_weights(weights)
    for epoch in (0, 1, 5):
        draws = [s.global_draw(epoch) for s in ranks]
        assert draws[0] == draws[1]
        shards = [s.shard(epoch) for s in ranks]
        assert len(shards[0]) == len(shards[1]) == 25
        assert sorted(shards[0] + shards[1]) == sorted(draws[0])  # disjoint parts of one draw
        assert shards[0] == draws[0][0::2] and shards[1] == draws[0][1::2]
    assert ranks[0].global_draw(0) != ranks[0].global_draw(1)  # a new draw each epoch
    # A new sampler (a resumed run) with the same (seed, epoch, weights) draws the same list.
    again = WeightedShardedSampler(50, world_size=2, rank=0, seed=3)
    again.set_weights(weights)
    assert again.global_draw(5) == ranks[0].global_draw(5)


def test_rare_class_is_drawn_more_often_than_its_share() -> None:
    labels = _rare_class_labels(200, rare_every=10)  # 10 % of the images hold the rare class
    weights = labels_to_image_weights(labels, labels_to_class_weights(labels, 2))
    drawn = np.concatenate([weighted_draw(weights, 0, e) for e in range(20)])
    rare_share = np.mean([labels[i][0, 0] == 1 for i in drawn])
    # Inverse frequency makes both classes equally likely: about half of the draws, five times its share.
    assert 0.4 < rare_share < 0.6, rare_share
    # A class that validates well loses weight: (1 - mAP)**2.
    learnt = labels_to_image_weights(
        labels, class_weights_from_maps(labels_to_class_weights(labels, 2), np.array([0.0, 0.9]))
    )
    drawn = np.concatenate([weighted_draw(learnt, 0, e) for e in range(20)])
    assert np.mean([labels[i][0, 0] == 1 for i in drawn]) < 0.05


class _FixedDraw:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def _sample(colour: int, box_xywhn: tuple[float, float, float, float], size: int = 32) -> tuple:
    img = torch.zeros(3, size, size, dtype=torch.uint8)
    x, y, w, h = box_xywhn
    x1, y1, x2, y2 = (int(round(v * size)) for v in (x - w / 2, y - h / 2, x + w / 2, y + h / 2))
    img[:, y1:y2, x1:x2] = colour
    return img, torch.tensor([[0.0, colour % 3, x, y, w, h]]), f"im{colour}.jpg", None


def test_quad_collate_tiles_four_images_and_their_boxes() -> None:
    batch = [_sample(c, (0.25 + 0.1 * k, 0.5, 0.25, 0.5)) for k, c in enumerate((50, 100, 150, 200))]
    batch += [_sample(c, (0.5, 0.3, 0.5, 0.25)) for c in (60, 70, 80, 90)]
    imgs, targets, paths, shapes = quad_collate(batch, _FixedDraw(0.9))  # 0.9 >= 0.5: tile
    assert imgs.shape == (2, 3, 64, 64) and imgs.dtype == torch.uint8
    assert paths == ("im50.jpg", "im60.jpg") and len(shapes) == 2
    assert targets[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # Every box lands on its own image's pixels in the merged image (tiles: 0 top-left, 1 bottom-left,
    # 2 top-right, 3 bottom-right).
    for row, (_, _, _, _) in zip(targets, batch):
        i, _, x, y, w, h = row.tolist()
        x1, y1, x2, y2 = (int(round(v * 64)) for v in (x - w / 2, y - h / 2, x + w / 2, y + h / 2))
        patch = imgs[int(i), 0, y1:y2, x1:x2]
        assert patch.numel() and (patch == patch[0, 0]).all() and patch[0, 0] > 0
    colours = [int(imgs[0, 0, int(round(r[3].item() * 64)), int(round(r[2].item() * 64))]) for r in targets[:4]]
    assert colours == [50, 100, 150, 200]
    assert torch.allclose(targets[:4, 4:], torch.tensor([[0.125, 0.25]]).expand(4, 2))


def test_quad_collate_upsamples_the_first_image_otherwise() -> None:
    batch = [_sample(c, (0.5, 0.5, 0.5, 0.5)) for c in (50, 100, 150, 200)]
    imgs, targets, _, _ = quad_collate(batch, _FixedDraw(0.1))
    assert imgs.shape == (1, 3, 64, 64)
    assert torch.equal(targets, batch[0][1])  # normalised boxes do not move
    assert int(imgs[0, 0, 32, 32]) == 50 and int(imgs[0, 0, 2, 2]) == 0
    short, _, _, _ = quad_collate(batch[:3], _FixedDraw(0.9))  # an epoch's short last batch still makes one image
    assert short.shape == (1, 3, 64, 64)


def test_quad_and_image_weights_refuse_rect(train_here, rectangles_yaml, tmp_path) -> None:  # noqa: F811
    for flag in ("--quad", "--image-weights"):
        status, log = train_here("--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--rect", flag)
        assert status == 1 and log.splitlines()[-1] == f"ERROR {flag} needs shuffled square batches: drop --rect"


@pytest.mark.slow
def test_image_weights_resume_continues_the_draw_and_quad_trains(
    train_here,
    small_yaml,
    tmp_path,  # noqa: F811
    monkeypatch,
) -> None:
    draws: dict[int, list[int]] = {}
    original = WeightedShardedSampler.global_draw

    def record(self, epoch):
        draws[epoch] = original(self, epoch)
        return draws[epoch]

    monkeypatch.setattr(WeightedShardedSampler, "global_draw", record)
    shapes = []
    original_step = step_module.prepare_images
    monkeypatch.setattr(
        step_module, "prepare_images", lambda imgs, *a: shapes.append(tuple(imgs.shape)) or original_step(imgs, *a)
    )
    status, log = train_here(
        "--data", small_yaml, "--project", tmp_path, "--epochs", "2", "--save-period", "1", "--image-weights", "--quad"
    )
    assert status == 0, log
    assert set(shapes) == {(2, 3, 128, 128)}  # batches of 8 at 64 px became 2 images at 128 px
    first = dict(draws)
    run_dir = tmp_path / "exp"
    epoch0 = load_checkpoint(run_dir / "weights/epoch0.pt")
    labels = [np.loadtxt(f, ndmin=2) for f in sorted(Path(small_yaml).parent.glob("labels/train/*.txt"))]
    expected = weighted_draw(labels_to_image_weights(labels, np.array(epoch0["class_weights"])), 0, 1)
    assert first[1] == expected.tolist()  # epoch 1 is drawn with the class weights of epoch 0's validation
    assert epoch0["class_weights"] != load_checkpoint(run_dir / "weights/last.pt")["class_weights"]

    # Resume from the epoch-0 checkpoint (as if the run had stopped there): epoch 1 is drawn again, identically.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.copy(run_dir / "weights/epoch0.pt", resumed / "weights/last.pt")
    draws.clear()
    status, log = train_here("--resume", resumed / "weights/last.pt")
    assert status == 0, log
    assert list(draws) == [1] and draws[1] == first[1]


@pytest.mark.slow
def test_image_weights_and_quad_under_two_rank_ddp(small_yaml, tmp_path) -> None:
    codes, outputs = main_on_ranks(
        train.main,
        train_args(small_yaml, tmp_path, "--epochs", "2", "--noplots", "--image-weights", "--quad"),
        2,
        tmp_path,
    )
    out = "".join(outputs)
    assert codes == [0, 0], out[-3000:]
    for epoch in (0, 1):  # every rank's draw was compared (an all-reduce of its checksum) before the epoch
        assert f"image weights: epoch {epoch} draw" in out and "is the same on all 2 ranks" in out
    assert len(load_checkpoint(tmp_path / "exp/weights/last.pt")["class_weights"]) == 2
    assert len(list((tmp_path / "exp").glob("events.out.tfevents.*"))) == 1  # TensorBoard: global rank 0 only
