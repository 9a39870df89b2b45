"""The family contract (models/families/): which family a config is, each family's loss, hyper-parameters,
optimizer groups, NMS, and the hooks export builds on (layout, export module, NMS candidates, INT8 scope)."""

from __future__ import annotations

import pytest
import torch
import torchvision
import yaml

from models.common import Conv
from models.families import (
    FAMILIES,
    YOLO11,
    YOLO26,
    YOLOV5,
    YOLOV8,
    family_name,
    family_of,
    import_checkpoint,
    importer_of_source,
    known_layouts,
    missing_weights_message,
    ultralytics_export_family,
)
from models.loss import ComputeLoss
from models.yolo import Model, load_model_config
from utils.errors import UserError
from utils.nms import end_to_end_detections, non_max_suppression, non_max_suppression_anchor_free
from utils.optimizer import build_optimizer

# What a checkpoint written with the one record of every family's keys (before each family had its own) holds
# besides an anchor-free family's keys: YOLOv5's loss terms at YOLOv5's defaults.
EVERY_KEY_RECORD_EXTRAS = {"cls_pw": 1.0, "obj": 1.0, "obj_pw": 1.0, "anchor_t": 4.0, "fl_gamma": 0.0}
NARROW = {"n": [0.33, 0.125, 1024]}  # narrow scale (YOLOv5: width 1/8): the models of these tests build fast


def _layers(*modules: str) -> list:
    return [[-1, 1, m, [16]] for m in modules]


def narrow(name: str, nc: int = 3) -> Model:
    cfg = load_model_config(f"{name}.yaml")
    if "scales" in cfg:
        cfg = {**cfg, "scales": NARROW, "scale": "n"}
    else:
        cfg = {**cfg, "width_multiple": 0.125}
    return Model(cfg, nc=nc)


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    torch.manual_seed(0)
    return {name: narrow(name) for name in ("yolov5n", "yolo11", "yolo26")}


def test_family_name_follows_the_family_key_or_else_the_contents() -> None:
    assert family_name({"anchors": 3, "backbone": _layers("C3"), "head": []}) == "yolov5"
    assert family_name({"backbone": _layers("Conv", "C2f"), "head": _layers("Detect")}) == "yolov8"
    assert family_name({"backbone": _layers("Conv", "C3k2", "C2PSA"), "head": []}) == "yolo11"
    assert family_name({"end2end": True, "backbone": _layers("C3k2"), "head": []}) == "yolo26"
    assert family_name({"reg_max": 1, "backbone": _layers("C3k2"), "head": []}) == "yolo26"
    assert family_name({"backbone": _layers("C3k2", "A2C2f"), "head": _layers("A2C2f", "C3k2")}) == "yolo12"
    # The key wins over the contents; an unknown key is one line naming the file.
    assert family_name({"family": "yolov8", "backbone": _layers("C3k2"), "head": []}) == "yolov8"
    with pytest.raises(UserError, match=r"^mine\.yaml: model family 'yolov4' is not supported here \(known: "):
        family_name({"family": "yolov4", "yaml_file": "mine.yaml", "backbone": [], "head": []})
    # Every YAML of ours says its family, and the contents rule agrees with it (for configs saved without the key).
    for file in ("yolov5n.yaml", "yolov5s6.yaml", "yolov8n.yaml", "yolo11n.yaml", "yolo26n.yaml", "yolo12n.yaml"):
        cfg = load_model_config(file)
        assert cfg["family"] == family_name({k: v for k, v in cfg.items() if k != "family"}), file


def test_family_of_a_model_and_unknown_names(models) -> None:
    model = models["yolov5n"]
    assert family_of(model) is YOLOV5 and family_of(model.yaml) is YOLOV5 and family_of("yolov5") is YOLOV5
    assert family_of(models["yolo26"]) is YOLO26 and family_of(YOLO11) is YOLO11
    with pytest.raises(UserError, match="'yolov4' is not supported"):
        family_of("yolov4")
    with pytest.raises(ValueError, match="no model config"):
        family_of(torch.nn.Conv2d(3, 3, 1))


def test_yolov5_loss_is_computeloss_with_gains_scaled_for_levels_classes_and_size(models) -> None:
    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    loss = YOLOV5.make_loss(models["yolov5n"], hyp, imgsz=320, label_smoothing=0.1)
    assert isinstance(loss, ComputeLoss) and loss.item_names == YOLOV5.loss_names == ("box", "obj", "cls")
    assert loss.hyp.box == pytest.approx(hyp.box) and loss.hyp.cls == pytest.approx(hyp.cls * 3 / 80)
    assert loss.hyp.obj == pytest.approx(hyp.obj * (320 / 640) ** 2)
    assert loss.cls_positive == pytest.approx(0.95)
    for name in ("yolo11", "yolo26"):
        family = family_of(name)
        assert (
            family.make_loss(models[name], family.read_hyp(family.default_hyp_path), imgsz=64).item_names
            == family.loss_names
        )


def test_each_family_reads_its_own_hyperparameters_and_refuses_another_familys(caplog) -> None:
    v5, anchor_free = YOLOV5.read_hyp(YOLOV5.default_hyp_path), YOLO11.read_hyp(YOLO11.default_hyp_path)
    assert type(v5) is YOLOV5.hyp_type and type(anchor_free) is YOLO11.hyp_type
    assert (anchor_free.box, anchor_free.cls, anchor_free.dfl, anchor_free.lr0) == (7.5, 0.5, 1.5, 0.01)
    assert not hasattr(anchor_free, "obj") and not hasattr(v5, "dfl")
    # A family's record writes the file it read, less the keys every record ignores (YOLOv5's iou_t, copy_paste).
    for family, record in ((YOLOV5, v5), (YOLO11, anchor_free)):
        on_file = yaml.safe_load(family.default_hyp_path.read_text())
        assert record.to_dict() == {k: float(v) for k, v in on_file.items() if k not in record.IGNORED_KEYS}
    with pytest.raises(UserError, match=r"hyp.anchor-free.yaml: 'dfl' is not a hyper-parameter of yolov5"):
        YOLOV5.read_hyp(YOLO11.default_hyp_path)
    with pytest.raises(UserError, match=r"hyp.scratch-low.yaml: no 'dfl' gain: not hyper-parameters of yolo26"):
        YOLO26.read_hyp(YOLOV5.default_hyp_path)
    # The check that takes a record already read (an evolution's generation).
    YOLOV5.check_hyp(v5, "v5")
    YOLO11.check_hyp(anchor_free, "af")
    with pytest.raises(UserError, match="'dfl' is not a hyper-parameter of yolov5"):
        YOLOV5.check_hyp(anchor_free, "af")
    # An anchor-free run's checkpoint written with the record of every key resumes: YOLOv5's terms are dropped.
    old = {**anchor_free.to_dict(), **EVERY_KEY_RECORD_EXTRAS}
    assert YOLO26.read_hyp(old, "last.pt (hyp)") == anchor_free
    with pytest.raises(UserError, match="unknown hyper-parameter"):
        YOLO26.hyp_type.from_dict({"dfl": 1.5, "l1": 2.0}, "x.yaml")


def test_every_family_evolves_only_what_it_uses() -> None:
    from utils.hyp import Hyp

    for family in FAMILIES.values():
        base = family.read_hyp(family.default_hyp_path)
        keys = family.evolve_keys(base)
        assert set(family.evolve_limits) <= set(type(base).field_names())
        assert all(family.evolve_limits[k].low <= base.to_dict()[k] <= family.evolve_limits[k].high for k in keys)
        if "giou" in keys:  # a DETR's recipe: its own gains and augmentations, no YOLO loss term
            assert {"lr0", "backbone_lr", "vfl", "bbox", "giou", "iou_crop"} <= set(keys)
            assert not {"box", "cls", "obj", "dfl"} & set(keys)
            assert ("fgl" in keys) == (family.name == "dfine")
            continue
        assert "lr0" in keys and "box" in keys and "cls" in keys and "mosaic" in keys
        assert ("obj" in keys) == (family is YOLOV5) and ("dfl" in keys) == (family is not YOLOV5)
        # From the record of every key too, which evolution (utils/engine/evolve.py) reads the base file into.
        assert family.evolve_keys(Hyp.from_yaml(family.default_hyp_path)) == keys


def test_evolving_a_detr_searches_the_classification_gain_its_hyp_file_uses() -> None:
    # DEIM's file sets mal and leaves vfl at 0; vfl's limits start above 0, so mutating it would ask for both
    # losses, which a run refuses.
    import numpy as np

    from models.families.detr import class_loss_of
    from utils.search.genetic import mutate

    dfine = FAMILIES["dfine"]
    for path, searched, left in (
        (dfine.default_hyp_path, "vfl", "mal"),
        (dfine.default_hyp_path.parent / "hyp.deim-dfine.yaml", "mal", "vfl"),
    ):
        base = dfine.read_hyp(path)
        keys = dfine.evolve_keys(base)
        assert searched in keys and left not in keys, path
        rng = np.random.default_rng(0)
        row = np.array([base.to_dict()[k] for k in keys])
        for _ in range(20):
            trial = base.replace(**mutate(row, keys, rng, dfine.evolve_limits))
            assert class_loss_of(trial) == searched and trial.to_dict()[left] == 0


def test_the_default_parameter_groups_build_the_same_optimizer_as_before(models) -> None:
    """The family's groups (biases first: their learning rate warms up from warmup_bias_lr) give the optimizer
    the three groups it had, with the same settings and tensors."""
    for name in ("SGD", "AdamW"):
        for model in models.values():
            groups = family_of(model).parameter_groups(model, 0.0005)
            ours = build_optimizer(model, name, 0.01, 0.9, 0.0005, groups=groups)
            default = build_optimizer(model, name, 0.01, 0.9, 0.0005)
            assert ours.state_dict() == default.state_dict()
            biases = {id(p) for m in model.modules() for n, p in m.named_parameters(recurse=False) if n == "bias"}
            assert {id(p) for p in groups[0]["params"]} == biases
            assert [g["weight_decay"] for g in ours.param_groups] == [0, 0.0005, 0.0]


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
            got = non_max_suppression_anchor_free(
                anchor_free, 0.05, 0.5, classes=classes, multi_label=multi_label, max_det=50
            )
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
            assert any(len(d) for d in got)


def test_end_to_end_output_is_only_filtered() -> None:
    det = torch.tensor([[[0, 0, 10, 10, 0.9, 1], [0, 0, 10, 10, 0.8, 2], [5, 5, 9, 9, 0.3, 1], [1, 1, 2, 2, 0.1, 0]]])
    kept = end_to_end_detections(det, conf_thres=0.25)[0]
    assert torch.equal(kept, det[0, :3])  # overlapping boxes of two classes both stay: there is no NMS
    assert torch.equal(end_to_end_detections(det, 0.25, classes=[2])[0], det[0, 1:2])
    assert torch.equal(end_to_end_detections(det, 0.0, max_det=2)[0], det[0, :2])
    assert YOLO26.detections(det, 0.25, 0.7)[0].equal(kept) and YOLO26.candidates(det) is None


def _nms_of_candidates(
    boxes: torch.Tensor, scores: torch.Tensor, conf: float, iou: float, max_det: int
) -> list[torch.Tensor]:
    """What NMS inside an exported graph computes from ``candidates``: the best class per box above ``conf``,
    torchvision's batched NMS per class, the ``max_det`` best."""
    out = []
    for image_boxes, image_scores in zip(boxes, scores):
        best, cls = image_scores.max(1)
        keep = best > conf
        image_boxes, best, cls = image_boxes[keep], best[keep], cls[keep]
        kept = torchvision.ops.batched_nms(image_boxes, best, cls, iou)[:max_det]
        out.append(torch.cat((image_boxes[kept], best[kept, None], cls[kept, None].float()), 1))
    return out


def test_candidates_with_batched_nms_reproduce_the_familys_detections() -> None:
    """The traceable candidates (boxes xyxy, per-class scores; YOLOv5's objectness times class) under torchvision's
    batched NMS give the detections the family's own decoding gives, row for row."""
    boxes, scores = _random_predictions(2, 600, 5, seed=1)
    objectness = torch.rand(2, 600, 1, generator=torch.Generator().manual_seed(2))
    outputs = {YOLOV5: torch.cat((boxes, objectness, scores), -1), YOLO11: torch.cat((boxes, scores), -1).mT}
    for family, output0 in outputs.items():
        cand_boxes, cand_scores = family.candidates(output0)
        assert cand_boxes.shape == (2, 600, 4) and cand_scores.shape == (2, 600, 5)
        expected = family.detections(output0, 0.1, family.val_iou, max_det=40)
        got = _nms_of_candidates(cand_boxes, cand_scores, 0.1, family.val_iou, 40)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), family
        assert all(len(d) == 40 for d in got)


def test_layout_export_module_and_the_end_to_end_switch(models) -> None:
    assert known_layouts() == ("yolov5", "anchor_free", "end2end")
    x = torch.rand(1, 3, 64, 64)
    for _name, model in models.items():
        family = family_of(model)
        model.eval()
        exported = family.export_module(model)
        with torch.no_grad():
            assert torch.equal(exported(x), model(x)[0])
        assert family.layout(model) == family.layouts[0] and isinstance(model.model[-1], family.head)
        with torch.no_grad():  # the default training forward is the model's own: the targets are not needed
            trained, plain = family.forward_train(model.train(), x, torch.zeros(0, 6)), model(x)
        assert type(trained) is type(plain) and len(trained) == len(plain)
        model.eval()
    with pytest.raises(UserError, match=r"--end2end: m\.pt has no one-to-one head \(YOLO26, D-FINE, RT-DETRv2 only\)"):
        YOLO11.use_end_to_end(models["yolo11"], "m.pt")
    end2end = YOLO26.export_module(models["yolo26"], end2end=True)
    assert YOLO26.layout(models["yolo26"]) == "anchor_free"  # the model itself is left as it was
    assert YOLO26.layout(end2end.model) == "end2end"
    with torch.no_grad():
        out = end2end(x)
    assert out.shape == (1, 84, 6) and torch.equal(YOLO26.detections(out, 0.0, 0.7)[0], out[0])


def test_int8_scope_names_the_decoding_and_the_dfl_of_the_model(models) -> None:
    for _name, model in models.items():
        scope = family_of(model).int8_float_scope(model)
        modules = dict(model.named_modules())
        assert scope.decoding == (f"model.{len(model.model) - 1}",) and modules[scope.decoding[0]] is model.model[-1]
        assert all(m in modules for m in scope.modules) and "Sigmoid" in scope.op_types
        # The head's conv-norm-activation blocks may be quantized: only their decoding is kept in float. Its
        # prediction convolutions (the logits) are named apart, for the formats that keep them float.
        assert not any(isinstance(modules[m], (torch.nn.Conv2d, Conv)) for m in scope.modules)
        assert scope.logits and all(
            isinstance(modules[m], torch.nn.Conv2d) and m.startswith(scope.decoding[0] + ".") for m in scope.logits
        )
    assert YOLO11.int8_float_scope(models["yolo11"]).modules == ("model.23.dfl",)
    assert YOLO11.int8_float_scope(models["yolo11"]).logits == tuple(
        f"model.23.{branch}.{level}.2" for branch in ("cv2", "cv3") for level in range(3)
    )
    assert YOLO26.int8_float_scope(models["yolo26"]).modules == ()  # no DFL (reg_max 1)
    assert YOLOV5.int8_float_scope(models["yolov5n"]).logits == ("model.24.m.0", "model.24.m.1", "model.24.m.2")


def test_importers_release_names_and_exports_of_other_tools(tmp_path) -> None:
    assert importer_of_source("yolov5").title == "YOLOv5" and importer_of_source("ultralytics").title == "Ultralytics"
    assert importer_of_source(None) is None
    for name in ("yolo26n.pt", "yolov8x-seg.pt", "YOLO11s.pt", "yolo12m.pt", "yolov5su.pt"):
        assert "one of Ultralytics' released weights" in missing_weights_message(name), name
    assert missing_weights_message(tmp_path / "yolov5s.pt") == f"{tmp_path / 'yolov5s.pt'}: checkpoint not found"
    assert ultralytics_export_family("Ultralytics YOLO11n model trained on coco.yaml") is YOLO11
    assert ultralytics_export_family("Ultralytics YOLO26s model") is YOLO26
    assert ultralytics_export_family("Ultralytics YOLO12x model") is family_of("yolo12")
    assert ultralytics_export_family("Ultralytics YOLOv5nu model") is YOLOV8  # the anchor-free families decode alike
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"junk\.pt: refused"):  # the catch-all importer names what it read
        import_checkpoint(junk)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty, not a mapping of hyper-parameter names to numbers"),
        ("- 1\n- 2\n", "holds a list, not a mapping of hyper-parameter names to numbers"),
        ("scale: -1\n", "'scale' -1 is outside [0, 0.99]"),
        ("scale: 1.5\n", "'scale' 1.5 is outside [0, 0.99]"),
        ("mosaic: 2\n", "'mosaic' 2 is outside [0, 1]"),
        ("lr0: -0.01\n", "'lr0' -0.01 is outside [0, 10]"),
        ("anchor_t: .nan\n", "'anchor_t' must be a finite number, got nan"),
    ],
)
def test_a_hyp_file_out_of_range_or_empty_is_one_line(tmp_path, text, message) -> None:
    hyp_file = tmp_path / "hyp.yaml"
    hyp_file.write_text(text)
    with pytest.raises(UserError) as e:
        family_of("yolov5").read_hyp(hyp_file)
    assert str(e.value) == f"{hyp_file}: {message}"
