"""Tests of AutoAnchor: BPR on hand-made boxes, refitting, keeping good anchors, k-means determinism, order."""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn as nn

from models.autoanchor import (
    anchor_fitness,
    anchor_metrics,
    anchor_order_matches_stride,
    check_anchors,
    dataset_box_sizes,
    kmean_anchors,
    set_anchors,
)
from models.families import YOLOV5
from models.loss import ComputeLoss
from models.yolo import Model
from utils.log import LOGGER

IMGSZ = 640


@dataclass
class FakeDataset:
    labels: list[np.ndarray]  # per image (n, 5) [cls, x, y, w, h] normalised
    shapes: np.ndarray  # (N, 2) original (w, h)


def dataset_of_pixel_boxes(wh: np.ndarray, per_image: int = 10) -> FakeDataset:
    """Square 640x640 images holding the given pixel box sizes (before AutoAnchor's 0.9-1.1 jitter)."""
    labels = []
    for start in range(0, len(wh), per_image):
        chunk = wh[start : start + per_image] / IMGSZ
        labels.append(np.column_stack((np.zeros(len(chunk)), np.full((len(chunk), 2), 0.5), chunk)).astype(np.float32))
    return FakeDataset(labels, np.full((len(labels), 2), IMGSZ, dtype=np.float64))


@pytest.fixture(scope="module")
def base_model() -> Model:
    return Model("models/yolov5n.yaml", nc=1)


@pytest.fixture
def model(base_model: Model) -> Model:
    return deepcopy(base_model)


@pytest.fixture
def log_records(caplog: pytest.LogCaptureFixture):
    # Capture on the project logger itself: whether it propagates to the root depends on setup_logging calls.
    old_level, old_propagate = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(caplog.handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    yield caplog
    LOGGER.setLevel(old_level)
    LOGGER.propagate = old_propagate
    LOGGER.removeHandler(caplog.handler)


def pixel_anchors(model: Model) -> np.ndarray:
    detect = model.model[-1]
    return (detect.anchors * detect.stride.view(-1, 1, 1)).view(-1, 2).double().numpy()


def test_bpr_and_anchors_per_target_on_hand_made_boxes() -> None:
    wh = np.array([[10, 10], [39, 39], [41, 10], [3, 3], [2, 10]], dtype=np.float64)
    # Against one 10x10 anchor with thr=4: 10x10 fits, 39x39 (3.9x) fits, 41x10 (4.1x) does not,
    # 3x3 (3.3x smaller) fits, 2x10 (5x narrower) does not.
    bpr, aat = anchor_metrics(wh, np.array([[10.0, 10.0]]), thr=4.0)
    assert bpr == pytest.approx(3 / 5) and aat == pytest.approx(3 / 5)
    # A 100x100 anchor also fits the 39x39 box (2.56x) and nothing else.
    bpr, aat = anchor_metrics(wh, np.array([[10.0, 10.0], [100.0, 100.0]]), thr=4.0)
    assert bpr == pytest.approx(3 / 5) and aat == pytest.approx(4 / 5)
    bpr, _ = anchor_metrics(wh, np.array([[10.0, 10.0]]), thr=6.0)
    assert bpr == 1.0


def test_box_sizes_follow_the_long_side_and_jitter() -> None:
    labels = [np.array([[0, 0.5, 0.5, 0.5, 0.25]], dtype=np.float32), np.zeros((0, 5), dtype=np.float32)]
    dataset = FakeDataset(labels, np.array([[1280.0, 640.0], [100.0, 100.0]]))
    wh = dataset_box_sizes(dataset, 640, np.random.default_rng(0))
    assert wh.shape == (1, 2)
    # 1280x640 becomes 640x320: the box is 320x80 pixels, times one jitter factor in [0.9, 1.1].
    factor = wh[0, 0] / 320
    assert 0.9 <= factor <= 1.1 and wh[0, 1] == pytest.approx(80 * factor)


def test_anchors_far_off_the_data_are_replaced(model: Model, log_records) -> None:
    rng = np.random.default_rng(0)
    # Wide flat boxes (aspect ~20): none of the default anchors is within 4x on both sides.
    wh = np.column_stack((rng.uniform(300, 600, 300), rng.uniform(15, 30, 300)))
    dataset = dataset_of_pixel_boxes(wh)
    detect = model.model[-1]
    buffer = detect.anchors
    before, _ = anchor_metrics(dataset_box_sizes(dataset, IMGSZ, np.random.default_rng(0)), pixel_anchors(model), 4.0)
    assert before < 0.5

    loss = ComputeLoss(model, YOLOV5.hyp_type(box=0.05, obj=1.0, cls=0.5, anchor_t=4.0))
    assert check_anchors(dataset, model, thr=4.0, imgsz=IMGSZ) is True

    assert detect.anchors is buffer  # updated in place
    after, _ = anchor_metrics(dataset_box_sizes(dataset, IMGSZ, np.random.default_rng(0)), pixel_anchors(model), 4.0)
    assert after > 0.98
    assert anchor_order_matches_stride(detect)
    areas = pixel_anchors(model).prod(1)
    assert (np.diff(areas) >= 0).all()  # small to large from the finest level on
    assert any("best possible recall" in r.getMessage() for r in log_records.records)
    # A loss built before AutoAnchor assigns targets with the new anchors.
    targets = torch.tensor([[0, 0, 0.5, 0.5, 450 / IMGSZ, 22 / IMGSZ]])
    preds = [torch.zeros(1, 3, IMGSZ // s, IMGSZ // s, 6) for s in (8, 16, 32)]
    assert any(lt.valid.any() for lt in loss.build_targets([p.shape[2:4] for p in preds], targets))


def test_anchors_that_already_fit_are_kept(model: Model, log_records) -> None:
    rng = np.random.default_rng(0)
    anchors = pixel_anchors(model)
    wh = anchors[rng.integers(0, len(anchors), 200)] * rng.uniform(0.7, 1.4, (200, 2))
    before = model.model[-1].anchors.clone()
    assert check_anchors(dataset_of_pixel_boxes(wh), model, thr=4.0, imgsz=IMGSZ) is False
    assert torch.equal(model.model[-1].anchors, before)
    assert sum("best possible recall" in r.getMessage() for r in log_records.records) == 1


def test_dataset_without_boxes_keeps_anchors(model: Model) -> None:
    dataset = FakeDataset([np.zeros((0, 5), dtype=np.float32)] * 3, np.full((3, 2), 640.0))
    before = model.model[-1].anchors.clone()
    assert check_anchors(dataset, model) is False
    assert torch.equal(model.model[-1].anchors, before)


def test_kmean_anchors_is_deterministic_sorted_and_ignores_tiny_boxes() -> None:
    rng = np.random.default_rng(3)
    wh = np.exp(rng.normal(np.log(50), 0.8, size=(2000, 2)))
    wh = wh[(wh >= 2).all(1)]
    first = kmean_anchors(wh, n=9, gen=300, rng=np.random.default_rng(7))
    second = kmean_anchors(wh, n=9, gen=300, rng=np.random.default_rng(7))
    assert first.shape == (9, 2)
    assert np.array_equal(first, second)
    assert (np.diff(first.prod(1)) >= 0).all()
    assert (first >= 2).all()
    with_tiny = np.concatenate((wh, np.full((500, 2), 1.0), np.column_stack((np.full(50, 1.5), np.full(50, 40.0)))))
    assert np.array_equal(kmean_anchors(with_tiny, n=9, gen=300, rng=np.random.default_rng(7)), first)


def test_kmean_anchors_evolution_improves_on_plain_kmeans() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[12, 16], [40, 30], [30, 80], [90, 60], [150, 200], [400, 300]], dtype=np.float64)
    wh = np.concatenate([c * rng.uniform(0.85, 1.15, (300, 2)) for c in centres])
    plain = kmean_anchors(wh, n=6, gen=0, rng=np.random.default_rng(1))
    evolved = kmean_anchors(wh, n=6, gen=300, rng=np.random.default_rng(1))
    assert anchor_fitness(wh, evolved, 4.0) > anchor_fitness(wh, plain, 4.0)
    assert anchor_metrics(wh, evolved, 4.0)[0] == 1.0


def test_kmean_anchors_needs_enough_boxes() -> None:
    with pytest.raises(ValueError):
        kmean_anchors(np.array([[10.0, 10.0], [20.0, 20.0]]), n=9)


class ReversedStrideDetect(nn.Module):
    """A Detect-like head whose levels are listed coarse to fine."""

    def __init__(self) -> None:
        super().__init__()
        self.nl, self.na = 3, 3
        self.register_buffer("stride", torch.tensor([32.0, 16.0, 8.0]))
        self.register_buffer("anchors", torch.ones(3, 3, 2))


def test_set_anchors_assigns_small_anchors_to_fine_strides_in_stride_units() -> None:
    detect = ReversedStrideDetect()
    anchors = np.array([[float(s), float(s)] for s in (90, 10, 50, 20, 80, 30, 70, 40, 60)])
    set_anchors(detect, anchors)
    pixels = detect.anchors * detect.stride.view(-1, 1, 1)
    # Level 2 has stride 8 and gets the three smallest; level 0 (stride 32) the three largest.
    assert torch.allclose(pixels[2, :, 0], torch.tensor([10.0, 20.0, 30.0]))
    assert torch.allclose(pixels[0, :, 0], torch.tensor([70.0, 80.0, 90.0]))
    assert torch.allclose(detect.anchors[2, 0], torch.tensor([10 / 8, 10 / 8]))
    assert anchor_order_matches_stride(detect)
    detect.anchors.copy_(pixels.flip(0) / detect.stride.view(-1, 1, 1))  # largest pixel anchors at stride 8
    assert not anchor_order_matches_stride(detect)
