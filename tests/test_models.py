from __future__ import annotations

import pytest
import torch

from models.yolo import MODULES, Model, load_model_config, parse_model
from utils.errors import UserError

EXPECTED_PARAMS = {"n": 1_872_157, "s": 7_235_389, "m": 21_190_557}


@pytest.mark.parametrize("size", ["n", "s", "m"])
def test_parameter_counts_match_published_architecture(size: str) -> None:
    with torch.device("meta"):  # shapes only
        layers, _ = parse_model(load_model_config(f"models/yolov5{size}.yaml"), 3)
    assert sum(p.numel() for p in layers.parameters()) == EXPECTED_PARAMS[size]


def test_output_shapes_train_and_eval() -> None:
    model = Model("models/yolov5n.yaml")
    assert model.stride.tolist() == [8.0, 16.0, 32.0]
    model.eval()
    with torch.no_grad():
        pred, raw = model(torch.zeros(1, 3, 320, 320))
    assert pred.shape == (1, 6300, 85)  # 3 anchors on 40x40, 20x20 and 10x10 cells
    model.train()
    outputs = model(torch.zeros(2, 3, 320, 320))
    assert [tuple(o.shape) for o in outputs] == [(2, 3, 40, 40, 85), (2, 3, 20, 20, 85), (2, 3, 10, 10, 85)]


def test_fused_model_parameters_flops_and_outputs() -> None:
    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml").eval()
    # Non-trivial BN statistics so that folding them has something to preserve.
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    x = torch.rand(1, 3, 320, 320)
    with torch.no_grad():
        before = model(x)[0]
        model.fuse()
        after = model(x)[0]
    assert sum(p.numel() for p in model.parameters()) == 1_867_405
    assert (before - after).abs().max() < 1e-4
    assert "4.5 GFLOPs" in model.info(640)


def test_nc_override_changes_head() -> None:
    model = Model("models/yolov5n.yaml", nc=3)
    assert model.nc == 3 and model.model[-1].no == 8
    model.eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 64, 64))[0].shape[-1] == 8


def test_anchors_are_in_stride_units_and_grow_with_stride() -> None:
    detect = Model("models/yolov5n.yaml").model[-1]
    pixels = detect.anchors * detect.stride.view(-1, 1, 1)
    assert torch.allclose(pixels[0, 0], torch.tensor([10.0, 13.0]))
    assert torch.allclose(pixels[2, 2], torch.tensor([373.0, 326.0]))


def test_unknown_module_is_a_clear_error_listing_known_ones() -> None:
    cfg = {"nc": 2, "anchors": [[10, 13, 16, 30, 33, 23]], "backbone": [[-1, 1, "os.system", ["echo hi"]]], "head": []}
    with pytest.raises(UserError) as e:
        Model(cfg)
    message = str(e.value)
    assert "os.system" in message and all(name in message for name in MODULES)


def test_yaml_strings_are_never_evaluated(tmp_path) -> None:
    cfg_text = tmp_path / "m.yaml"
    base = open("models/yolov5n.yaml").read()
    cfg_text.write_text(base.replace("[64, 6, 2, 2]", "[__import__('os').getpid(), 6, 2, 2]"))
    with pytest.raises(UserError, match="layer 0 .*channel count"):
        Model(cfg_text)


def test_folding_batchnorm_keeps_the_weights_channels_last() -> None:
    from models.common import fuse_conv_and_bn

    conv = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False).to(memory_format=torch.channels_last)
    bn = torch.nn.BatchNorm2d(16).eval()
    bn.running_mean.uniform_(-1, 1)
    fused = fuse_conv_and_bn(conv, bn)
    assert fused.weight.is_contiguous(memory_format=torch.channels_last) and not fused.weight.is_contiguous()
    x = torch.rand(2, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), bn(conv(x)), rtol=1e-5, atol=1e-5)
    assert not fused.weight.requires_grad
