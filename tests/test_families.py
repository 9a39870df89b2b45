"""The family registry: which family a config is, each family's loss and hyper-parameters, its NMS."""
from __future__ import annotations

import pytest
import torch

from models.families import FAMILIES, YOLOV5, family_name, family_of
from models.yolo import Model
from utils.errors import UserError
from utils.hyp import Hyp
from utils.loss import ComputeLoss
from utils.nms import end_to_end_detections, non_max_suppression, non_max_suppression_anchor_free


def _layers(*modules: str) -> list:
    return [[-1, 1, m, [16]] for m in modules]


def test_family_name_follows_the_config() -> None:
    assert family_name({"anchors": 3, "backbone": _layers("C3"), "head": []}) == "yolov5"
    assert family_name({"backbone": _layers("Conv", "C2f"), "head": _layers("Detect")}) == "yolov8"
    assert family_name({"backbone": _layers("Conv", "C3k2", "C2PSA"), "head": []}) == "yolo11"
    assert family_name({"end2end": True, "backbone": _layers("C3k2"), "head": []}) == "yolo26"
    assert family_name({"reg_max": 1, "backbone": _layers("C3k2"), "head": []}) == "yolo26"


def test_family_of_a_model_and_unknown_names() -> None:
    model = Model("yolov5n.yaml", nc=2)
    assert family_of(model) is YOLOV5 and family_of(model.yaml) is YOLOV5 and family_of("yolov5") is YOLOV5
    with pytest.raises(UserError, match="'yolov4' is not supported"):
        family_of("yolov4")
    with pytest.raises(ValueError, match="no model config"):
        family_of(torch.nn.Conv2d(3, 3, 1))


def test_yolov5_loss_is_computeloss_with_gains_scaled_for_levels_classes_and_size() -> None:
    model = Model("yolov5n.yaml", nc=8)
    hyp = Hyp.from_yaml(YOLOV5.default_hyp_path)
    loss = YOLOV5.make_loss(model, hyp, imgsz=320, label_smoothing=0.1)
    assert isinstance(loss, ComputeLoss) and loss.item_names == YOLOV5.loss_names == ("box", "obj", "cls")
    assert loss.hyp.box == pytest.approx(hyp.box) and loss.hyp.cls == pytest.approx(hyp.cls * 8 / 80)
    assert loss.hyp.obj == pytest.approx(hyp.obj * (320 / 640) ** 2)
    assert loss.cls_positive == pytest.approx(0.95)


def test_a_family_refuses_another_familys_hyperparameters() -> None:
    anchor_free = Hyp.from_yaml("data/hyps/hyp.anchor-free.yaml")
    assert (anchor_free.box, anchor_free.cls, anchor_free.dfl, anchor_free.lr0) == (7.5, 0.5, 1.5, 0.01)
    with pytest.raises(UserError, match="hyp.anchor-free.yaml: 'dfl' is a loss gain of the anchor-free"):
        YOLOV5.check_hyp(anchor_free, "hyp.anchor-free.yaml")
    YOLOV5.check_hyp(Hyp.from_yaml(YOLOV5.default_hyp_path), "v5")
    assert "dfl" not in Hyp.from_yaml(YOLOV5.default_hyp_path).to_dict()  # YOLOv5's hyp.yaml files stay as they were
    with pytest.raises(UserError, match="unknown hyper-parameter"):
        Hyp.from_dict({"dfl": 1.5, "l1": 2.0}, "x.yaml")


def test_every_family_evolves_only_what_it_uses() -> None:
    for family in FAMILIES.values():
        base = Hyp.from_yaml(family.default_hyp_path)
        keys = family.evolve_keys(base)
        assert "lr0" in keys and "box" in keys and "cls" in keys
        assert ("obj" in keys) == family.anchor_based and ("dfl" in keys) == (not family.anchor_based)
        assert all(family.evolve_limits[k].low <= base.to_dict()[k] <= family.evolve_limits[k].high for k in keys)


def _random_predictions(n_images: int, n_boxes: int, nc: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n_images, n_boxes, 2, generator=g) * 200
    wh = torch.rand(n_images, n_boxes, 2, generator=g) * 60 + 4
    scores = torch.rand(n_images, n_boxes, nc, generator=g) ** 3
    return torch.cat((xy, wh), -1), scores


def test_anchor_free_nms_equals_yolov5_nms_with_objectness_one() -> None:
    boxes, scores = _random_predictions(3, 500, 4)
    v5 = torch.cat((boxes, torch.ones(3, 500, 1), scores), -1)  # (b, n, 5 + nc)
    anchor_free = torch.cat((boxes, scores), -1).transpose(1, 2)  # (b, 4 + nc, n)
    for multi_label in (False, True):
        for classes in (None, [1, 3]):
            expected = non_max_suppression(v5, 0.05, 0.5, classes=classes, multi_label=multi_label, max_det=50)
            got = non_max_suppression_anchor_free(anchor_free, 0.05, 0.5, classes=classes, multi_label=multi_label,
                                                  max_det=50)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
            assert any(len(d) for d in got)


def test_end_to_end_output_is_only_filtered() -> None:
    det = torch.tensor([[[0, 0, 10, 10, 0.9, 1], [0, 0, 10, 10, 0.8, 2], [5, 5, 9, 9, 0.3, 1], [1, 1, 2, 2, 0.1, 0]]])
    kept = end_to_end_detections(det, conf_thres=0.25)[0]
    assert torch.equal(kept, det[0, :3])  # overlapping boxes of two classes both stay: there is no NMS
    assert torch.equal(end_to_end_detections(det, 0.25, classes=[2])[0], det[0, 1:2])
    assert torch.equal(end_to_end_detections(det, 0.0, max_det=2)[0], det[0, :2])
