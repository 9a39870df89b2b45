"""Non-maximum suppression, and mapping its boxes back through the letterbox."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from utils.boxes import scale_boxes, xyxy2xywh
from utils.data.augmentations import letterbox
from utils.nms import non_max_suppression


def raw_prediction(boxes_xyxy, obj, cls_scores) -> torch.Tensor:
    """One image's raw prediction (1, n, 5 + nc) from xyxy boxes, objectness and class scores."""
    boxes = xyxy2xywh(torch.tensor(np.asarray(boxes_xyxy), dtype=torch.float32))
    obj = torch.tensor(obj, dtype=torch.float32)[:, None]
    cls_scores = torch.tensor(cls_scores, dtype=torch.float32)
    return torch.cat((boxes, obj, cls_scores), 1)[None]


def test_keeps_best_box_of_a_cluster():
    pred = raw_prediction(
        [[10, 10, 50, 50], [12, 11, 51, 52], [9, 10, 49, 50], [200, 200, 240, 260]],
        [0.6, 0.95, 0.8, 0.7],
        [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]],
    )
    (det,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45)
    assert det.shape == (2, 6)
    assert det[0, 4].item() == pytest.approx(0.95)
    assert det[0, :4].tolist() == pytest.approx([12, 11, 51, 52])
    assert det[1, :4].tolist() == pytest.approx([200, 200, 240, 260])
    assert torch.all(det[:-1, 4] >= det[1:, 4])  # highest confidence first


def test_overlapping_boxes_of_different_classes_are_kept_unless_agnostic():
    pred = raw_prediction([[10, 10, 50, 50], [11, 10, 50, 51]], [0.9, 0.8], [[0.9, 0.1], [0.1, 0.9]])
    (det,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45)
    assert sorted(det[:, 5].tolist()) == [0.0, 1.0]
    (det,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45, agnostic=True)
    assert det.shape[0] == 1 and det[0, 5].item() == 0.0


def test_confidence_is_objectness_times_class_score():
    pred = raw_prediction([[0, 0, 10, 10], [20, 20, 30, 30]], [0.5, 0.9], [[0.4, 0.1], [0.2, 0.3]])
    (det,) = non_max_suppression(pred, conf_thres=0.21, iou_thres=0.45)
    assert det.shape[0] == 1  # 0.5 * 0.4 = 0.20 fails, 0.9 * 0.3 = 0.27 passes
    assert det[0, 4].item() == pytest.approx(0.27)
    assert det[0, 5].item() == 1.0


def test_multi_label_gives_one_row_per_passing_class():
    pred = raw_prediction([[0, 0, 10, 10]], [0.9], [[0.8, 0.5, 0.01]])
    (det,) = non_max_suppression(pred, conf_thres=0.1, iou_thres=0.45, multi_label=True)
    assert det[:, 5].tolist() == [0.0, 1.0]
    assert det[:, 4].tolist() == pytest.approx([0.72, 0.45])
    (det,) = non_max_suppression(pred, conf_thres=0.1, iou_thres=0.45, multi_label=False)
    assert det[:, 5].tolist() == [0.0]


def test_max_det_and_class_filter():
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 600, (500, 2))
    boxes = np.concatenate([xy, xy + 5], 1)  # tiny boxes rarely overlap
    cls = np.eye(3)[rng.integers(0, 3, 500)]
    pred = raw_prediction(boxes, rng.uniform(0.5, 1, 500), cls)
    (det,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45, max_det=37)
    assert det.shape == (37, 6)
    (det,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.45, classes=[2])
    assert det.shape[0] > 0 and set(det[:, 5].tolist()) == {2.0}


def test_candidate_cap_keeps_the_most_confident():
    pred = raw_prediction([[0, 0, 10, 10], [100, 100, 110, 110], [200, 200, 210, 210]], [0.5, 0.9, 0.7], [[1.0]] * 3)
    (det,) = non_max_suppression(pred, conf_thres=0.1, max_nms=2)
    assert det[:, 4].tolist() == pytest.approx([0.9, 0.7])


def test_batch_with_empty_image_and_batch_shape():
    pred = torch.zeros((3, 100, 7))
    pred[1, :, :4] = torch.tensor([50.0, 50.0, 20.0, 20.0])
    pred[1, 0, 4:6] = 0.9
    out = non_max_suppression(pred, conf_thres=0.25)
    assert [o.shape for o in out] == [(0, 6), (1, 6), (0, 6)]
    assert out[1][0, :4].tolist() == pytest.approx([40, 40, 60, 60])


def test_rejects_bad_thresholds():
    with pytest.raises(ValueError):
        non_max_suppression(torch.zeros((1, 1, 6)), conf_thres=1.5)


@pytest.mark.parametrize("original_hw", [(480, 640), (333, 517), (640, 200)])
def test_boxes_map_back_to_original_coordinates_through_letterbox(original_hw):
    h0, w0 = original_hw
    image = np.zeros((h0, w0, 3), dtype=np.uint8)
    boxed, (ratio_w, ratio_h), (pad_w, pad_h) = letterbox(image, (416, 416), auto=False)
    original_box = np.array([w0 * 0.2, h0 * 0.3, w0 * 0.7, h0 * 0.9])
    boxed_box = original_box * [ratio_w, ratio_h, ratio_w, ratio_h] + [pad_w, pad_h, pad_w, pad_h]
    pred = raw_prediction([boxed_box], [0.9], [[1.0]])
    (det,) = non_max_suppression(pred, conf_thres=0.25)
    shape_entry = ((h0, w0), ((ratio_h, ratio_w), (pad_w, pad_h)))  # the dataloader's shapes entry
    mapped = scale_boxes(boxed.shape[:2], det[:, :4].clone(), shape_entry[0], shape_entry[1])
    assert mapped[0].tolist() == pytest.approx(original_box.tolist(), abs=1e-3)


@pytest.mark.parametrize("spread", [600.0, 4.0])  # boxes scattered (few suppressed) or piled up (most suppressed)
def test_nms_over_the_best_prefix_keeps_what_full_nms_keeps(monkeypatch, spread):
    import utils.nms as nms

    rng = np.random.default_rng(0)
    n, nc = 6000, 5
    xy = rng.uniform(0, spread, (n, 2))
    wh = rng.uniform(30, 60, (n, 2))
    pred = torch.tensor(
        np.concatenate((xy, wh, rng.uniform(0.01, 1, (n, 1)), rng.uniform(0, 1, (n, nc))), 1), dtype=torch.float32
    )[None]
    calls = []
    real_nms = nms.batched_nms
    monkeypatch.setattr(nms, "batched_nms", lambda b, *a: calls.append(len(b)) or real_nms(b, *a))
    (fast,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, multi_label=True, max_det=100)
    assert calls[0] == 1000 and (len(calls) == 1 if spread > 100 else len(calls) > 1)  # prefix, then longer ones
    monkeypatch.setattr(nms, "NMS_PREFIX_PER_DETECTION", 10**9)  # one NMS over every candidate
    (full,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, multi_label=True, max_det=100)
    assert len(fast) == min(100, len(full)) and len(full) > 20 and torch.equal(fast, full)


def test_the_nms_kernel_is_torchvisions_compiled_op_loaded_without_the_package() -> None:
    """val.py and detect.py start without torchvision's package import (and the torch._dynamo that it imports): the
    kernel is the compiled op itself, not the fallback through ``import torchvision``."""
    from utils.nms import nms_kernel

    kernel = nms_kernel()
    assert kernel is torch.ops.torchvision.nms
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]])
    assert kernel(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist() == [0, 2]
