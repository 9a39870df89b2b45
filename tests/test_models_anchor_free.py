"""YOLOv8 / YOLO11 / YOLO26 / YOLO12 models: sizes, key names and outputs equal to Ultralytics' own models.

The reference numbers and fixtures were made with Ultralytics 8.4 (tests/fixtures/ultralytics/README.md).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from models.anchor_free import DFL, AnchorFreeDetect, bbox2dist, dist2bbox, make_anchors
from models.blocks import C3k, C3k2, PSABlock
from models.common import SPPF
from models.families import family_name, family_of
from models.yolo import Detect, Model, load_model_config, parse_model
from utils.errors import UserError
from utils.log import LOGGER

FIXTURES = Path(__file__).parent / "fixtures" / "ultralytics"

# Parameters at nc=80 as Ultralytics 8.4 builds each YAML (unfused; both YOLO26 heads; DFL's 16 frozen weights).
ULTRALYTICS_PARAMS = {
    "yolov8n": 3_157_200,
    "yolov8s": 11_166_560,
    "yolov8m": 25_902_640,
    "yolov8l": 43_691_520,
    "yolov8x": 68_229_648,
    "yolo11n": 2_624_080,
    "yolo11s": 9_458_752,
    "yolo11m": 20_114_688,
    "yolo11l": 25_372_160,
    "yolo11x": 56_966_176,
    "yolo26n": 2_572_280,
    "yolo26s": 10_009_784,
    "yolo26m": 21_896_248,
    "yolo26l": 26_299_704,
    "yolo26x": 58_993_368,
    "yolo12n": 2_602_288,
    "yolo12s": 9_284_096,
    "yolo12m": 20_199_168,
    "yolo12l": 26_450_784,
    "yolo12x": 59_210_784,
}


def layers_on_meta(name: str) -> nn.Module:
    """The layers of a model config, on the meta device (shapes only: fast even for the x scale)."""
    with torch.device("meta"):
        wrapper = nn.Module()
        wrapper.model, _ = parse_model(load_model_config(name), 3)
    return wrapper


@pytest.mark.parametrize("name", sorted(ULTRALYTICS_PARAMS))
def test_parameter_counts_equal_ultralytics(name: str) -> None:
    layers = layers_on_meta(f"{name}.yaml")
    assert sum(p.numel() for p in layers.parameters()) == ULTRALYTICS_PARAMS[name]


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n", "yolo26n", "yolo12n"])
def test_state_dict_names_and_shapes_equal_ultralytics(name: str) -> None:
    reference = json.loads((FIXTURES / "state_dict_keys.json").read_text())[name]
    ours = [[k, list(v.shape)] for k, v in layers_on_meta(f"{name}.yaml").state_dict().items()]
    assert ours == reference


def unpack_state_dict(packed: dict) -> dict[str, torch.Tensor]:
    """The fixture's state_dict: float tensors are int8 values times a power of two each (exact in fp32)."""
    state, f_at, i_at, floats_seen = {}, 0, 0, 0
    for name, shape, is_float in zip(packed["names"], packed["shapes"], packed["is_float"]):
        n = math.prod(shape)
        if is_float:
            exponent = packed["exponents"][floats_seen]
            state[name] = (packed["int8_values"][f_at : f_at + n].float() * 2.0**exponent).view(shape)
            f_at, floats_seen = f_at + n, floats_seen + 1
        else:
            state[name] = packed["int_values"][i_at : i_at + n].view(shape).clone()
            i_at += n
    assert f_at == packed["int8_values"].numel() and i_at == packed["int_values"].numel()
    return state


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(FIXTURES / "narrow_models.pt", weights_only=True)


def reference_model(reference: dict, family: str) -> tuple[Model, torch.Tensor]:
    entry = reference[family]
    model = Model(entry["config"])
    model.load_state_dict(unpack_state_dict(entry["state_dict"]), strict=True)
    return model, reference["input_times_128"].float() / 128


def per_anchor(levels: list[torch.Tensor], head: AnchorFreeDetect) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-level (B, 4 * reg_max + nc, ny, nx) -> boxes (B, 4 * reg_max, A), class logits (B, nc, A)."""
    flat = torch.cat([level.flatten(2) for level in levels], 2)
    return flat.split((4 * head.reg_max, head.nc), 1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["yolov8", "yolo11", "yolo26"])
def test_outputs_equal_ultralytics(reference: dict, family: str) -> None:
    model, x = reference_model(reference, family)
    head = model.model[-1]
    assert family_of(model).name == family and isinstance(head, AnchorFreeDetect)
    assert head.legacy == (family == "yolov8") and head.end2end == (family == "yolo26")

    model.eval()
    with torch.no_grad():
        pred, raw = model(x)
    expected = reference[family]["pred"]
    assert_close(pred, expected)
    # The class scores spread, so the comparison is not one of near-zero sigmoids.
    assert expected[:, 4:].min() < 0.3 and expected[:, 4:].max() > 0.6
    if family == "yolo26":
        head.end2end_output = True
        with torch.no_grad():
            end2end, _ = model(x)
        assert end2end.shape == (2, 126, 6)  # min(max_det, anchors) rows
        assert_close(end2end, reference[family]["end2end"])

    model.train()  # BatchNorm on batch statistics
    with torch.no_grad():
        raw = model(x)
    heads = raw if family == "yolo26" else {"one2many": raw}
    assert set(heads) == set(reference[family]["train"])
    for name, levels in heads.items():
        assert [tuple(level.shape[2:]) for level in levels] == [(8, 12), (4, 6), (2, 3)]
        boxes, scores = per_anchor(levels, head)
        assert_close(boxes, reference[family]["train"][name]["boxes"])
        assert_close(scores, reference[family]["train"][name]["scores"])


def test_yolo26_one_to_one_head_trains_on_detached_features(reference: dict) -> None:
    model, x = reference_model(reference, "yolo26")
    head = model.model[-1]
    out = model.train()(x)
    assert set(out) == {"one2many", "one2one"}
    assert all(level.shape[1] == 4 + head.nc for level in out["one2one"])  # reg_max 1: four raw distances
    sum(level.sum() for level in out["one2one"]).backward()
    assert model.model[0].conv.weight.grad is None and head.cv2[0][0].conv.weight.grad is None
    assert head.one2one_cv2[0][0].conv.weight.grad is not None
    model.zero_grad()
    sum(level.sum() for level in out["one2many"]).backward()
    assert model.model[0].conv.weight.grad is not None


def assert_same_detections(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal end-to-end outputs up to the order of near-equal scores (folding BN changes the last bits, and
    top-k may then swap two detections whose scores differ by 1e-7)."""
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual[..., 4], expected[..., 4], atol=1e-4, rtol=1e-5)
    distance = (actual.unsqueeze(2) - expected.unsqueeze(1)).abs().amax(-1)  # (B, k, k) row against row
    assert distance.amin(2).max() < 1e-3 and distance.amin(1).max() < 1e-3


@pytest.mark.parametrize("family", ["yolov8", "yolo26"])
def test_fuse_keeps_outputs_and_both_heads(reference: dict, family: str) -> None:
    model, x = reference_model(reference, family)
    model.eval()
    with torch.no_grad():
        before = model(x)[0]
        model.fuse()
        after = model(x)[0]
    assert_close(after, before)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    head = model.model[-1]
    assert hasattr(head, "dfl") == (family == "yolov8")
    if family == "yolo26":
        assert len(head.one2one_cv2) == len(head.cv2) == 3
        head.end2end_output = True
        with torch.no_grad():
            assert_same_detections(model(x)[0], reference[family]["end2end"])


def test_fresh_head_bias_and_dfl_as_ultralytics_builds_them() -> None:
    model = Model("yolov8n.yaml")
    head = model.model[-1]
    assert head.stride.tolist() == [8.0, 16.0, 32.0]
    assert "model.22.stride" not in model.state_dict()  # not in Ultralytics' state_dicts: recomputed at build
    # Values read from a yolov8n freshly built by Ultralytics 8.4.
    assert [round(float(branch[-1].bias[0].detach()), 4) for branch in head.cv3] == [-11.5366, -10.1503, -8.7641]
    assert all(torch.all(branch[-1].bias == 2.0) for branch in head.cv2)
    assert isinstance(head.dfl, DFL) and not head.dfl.conv.weight.requires_grad
    assert head.dfl.conv.weight.flatten().tolist() == list(range(16))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == ULTRALYTICS_PARAMS["yolov8n"] - 16
    # The stride probe ran in eval mode: BatchNorm statistics are untouched.
    bn = model.model[0].bn
    assert torch.all(bn.running_mean == 0) and torch.all(bn.running_var == 1)


def test_eval_output_layout_and_nc_override() -> None:
    model = Model("yolo11n.yaml", nc=3).eval()
    head = model.model[-1]
    assert head.nc == 3 and head.no == 3 + 64 and model.yaml["nc"] == 3 and model.yaml["scale"] == "n"
    with torch.no_grad():
        pred, raw = model(torch.zeros(1, 3, 64, 96))
    assert pred.shape == (1, 7, 8 * 12 + 4 * 6 + 2 * 3)
    assert [tuple(r.shape) for r in raw] == [(1, 67, 8, 12), (1, 67, 4, 6), (1, 67, 2, 3)]
    # A zero image gives zero features through every block of a fresh model (no conv biases, BN at mean 0), so
    # the head outputs its initial biases: uniform DFL bins (7.5 strides to each side: boxes 15 strides wide,
    # centred on their anchor points) and sigmoid(log(5 / nc / (640 / stride)^2)) for every class.
    strides = torch.tensor([8.0] * 96 + [16.0] * 24 + [32.0] * 6)
    assert pred[0, :2, 0].tolist() == [4.0, 4.0]  # top-left P3 cell
    assert pred[0, :2, 95].tolist() == [92.0, 60.0]  # bottom-right P3 cell
    assert pred[0, :2, -1].tolist() == [80.0, 48.0]  # bottom-right P5 cell
    torch.testing.assert_close(pred[0, 2:4], (15 * strides).expand(2, -1))
    expected_scores = torch.sigmoid(torch.log(5 / 3 / (640 / strides) ** 2))
    torch.testing.assert_close(pred[0, 4:], expected_scores.expand(3, -1))


def test_anchor_geometry_round_trip() -> None:
    points, strides = make_anchors([(2, 3), (1, 2)], torch.tensor([8.0, 16.0]))
    assert points.tolist() == [
        [0.5, 0.5],
        [1.5, 0.5],
        [2.5, 0.5],
        [0.5, 1.5],
        [1.5, 1.5],
        [2.5, 1.5],
        [0.5, 0.5],
        [1.5, 0.5],
    ]
    assert strides.flatten().tolist() == [8.0] * 6 + [16.0] * 2
    boxes = torch.tensor([[0.0, 0.0, 2.0, 1.0], [1.0, 0.0, 3.0, 2.0]])
    anchor = torch.tensor([[1.5, 0.5], [1.5, 0.5]])
    dist = bbox2dist(anchor, boxes)
    assert dist.tolist() == [[1.5, 0.5, 0.5, 0.5], [0.5, 0.5, 1.5, 1.5]]
    assert torch.equal(dist2bbox(dist, anchor, xywh=False), boxes)
    assert dist2bbox(dist, anchor, xywh=True).tolist() == [[1.0, 0.5, 2.0, 1.0], [2.0, 1.0, 2.0, 2.0]]
    clamped = bbox2dist(anchor[:1], torch.tensor([[-30.0, 0.0, 40.0, 1.0]]), reg_max=16)
    assert clamped.flatten().tolist() == pytest.approx([15.99, 0.5, 15.99, 0.5])


def test_dfl_is_the_expected_bin() -> None:
    logits = torch.full((1, 64, 1), -1e4)
    for side, hot in enumerate((0, 3, 7, 15)):
        logits[0, side * 16 + hot] = 10.0  # side-major: 16 bins of left, then top, right, bottom
    assert DFL(16)(logits).flatten().tolist() == pytest.approx([0, 3, 7, 15], abs=1e-4)


def test_scale_from_file_name_and_block_variants(caplog) -> None:
    cfg = load_model_config("yolo26x.yaml")
    assert cfg["scale"] == "x" and cfg["yaml_file"] == "yolo26x.yaml"
    assert load_model_config("models/yolov8s.yaml")["scale"] == "s"
    assert "scale" not in load_model_config("yolov5n.yaml")  # YOLOv5 files are found as they are
    with pytest.raises(UserError, match="yolo11q.yaml: model config not found"):
        load_model_config("yolo11q.yaml")
    # A checkpoint's own config dict carries its scale.
    assert family_name(cfg) == "yolo26" and family_name(load_model_config("yolov5n.yaml")) == "yolov5"
    unscaled = load_model_config("yolo11.yaml")
    # Captured on the project logger itself: whether it propagates depends on earlier setup_logging calls.
    LOGGER.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER.name):
            layers = layers_on_meta_from(unscaled)
    finally:
        LOGGER.removeHandler(caplog.handler)
    assert (
        "no model scale" in caplog.text and sum(p.numel() for p in layers.parameters()) == ULTRALYTICS_PARAMS["yolo11n"]
    )
    bad = dict(unscaled, scale="q")
    with pytest.raises(UserError, match="scale 'q'"):
        layers_on_meta_from(bad)

    # YOLO11 forces C3k inner blocks at m/l/x; YOLO26's last neck block has attention; SPPF in both forms.
    yolo11n, yolo11m = layers_on_meta("yolo11n.yaml").model, layers_on_meta("yolo11m.yaml").model
    assert isinstance(yolo11n[2], C3k2) and not isinstance(yolo11n[2].m[0], C3k)
    assert isinstance(yolo11m[2].m[0], C3k) and isinstance(yolo11n[6].m[0], C3k)
    yolo26n = layers_on_meta("yolo26n.yaml").model
    assert isinstance(yolo26n[13].m[0], C3k) and isinstance(yolo26n[22].m[0][1], PSABlock)
    sppf11, sppf26 = yolo11n[9], yolo26n[9]
    assert isinstance(sppf11, SPPF) and isinstance(sppf11.cv1.act, nn.SiLU) and not sppf11.add
    assert isinstance(sppf26.cv1.act, nn.Identity) and sppf26.add and sppf26.n == 3
    assert yolo26n[10].m[0].attn.num_heads == 2  # C2PSA at n: 128 channels, heads of 64


def layers_on_meta_from(cfg: dict) -> nn.Module:
    with torch.device("meta"):
        wrapper = nn.Module()
        wrapper.model, _ = parse_model(cfg, 3)
    return wrapper


def test_yolov5_configs_keep_the_anchor_head() -> None:
    cfg = load_model_config("yolov5n.yaml")
    assert isinstance(layers_on_meta_from(cfg).model[-1], Detect)
    # The anchors override of YOLOv5's hyper-parameters does not turn an anchor-free config into an anchor one.
    model = Model("yolo26n.yaml", nc=2, anchors=3.0)
    assert "anchors" not in model.yaml and isinstance(model.model[-1], AnchorFreeDetect)
