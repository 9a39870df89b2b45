"""Test-time augmentation: every pass's boxes map back to the input's pixels; val.py reports it beside plain."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import detect
import val
from models.yolo import build_model
from utils.checkpoint import model_state, save_checkpoint
from utils.errors import UserError
from utils.log import LOGGER
from utils.tta import TTA_SCALES, scale_images, tta_predict

STRIDE = 32


class BrightBoxFinder(nn.Module):
    """A stand-in detector: 'detects' the bright region of its input, the same box on each of 3 output levels."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))
        self.inputs: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor):
        self.inputs.append(tuple(x.shape[2:]))
        preds = []
        for img in x:
            ys, xs = torch.nonzero(img[0] > 0.75, as_tuple=True)
            x1, x2, y1, y2 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
            box = torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1, 0.9, 0.9], dtype=torch.float32)
            preds.append(box.expand(3, 6))
        raw = [torch.zeros(x.shape[0], 1, 1, 1, 6) for _ in range(3)]
        return torch.stack(preds), raw


def test_every_pass_maps_its_boxes_back_to_the_input_pixels() -> None:
    imgs = torch.zeros(2, 3, 96, 160)
    imgs[0, :, 20:56, 10:50] = 1.0  # left of centre: an undone flip would move it right
    imgs[1, :, 40:90, 100:150] = 1.0
    model = BrightBoxFinder()
    merged = tta_predict(model, imgs, STRIDE)
    # 3 passes; the full-size one drops its coarsest level, the smallest its finest: 2 + 3 + 2 boxes.
    assert merged.shape == (2, 7, 6)
    assert model.inputs == [(96, 160), (96, 160), (96, 128)]  # 0.83 and 0.67 of it, padded up to stride multiples
    expected = torch.tensor([[30.0, 38.0, 40.0, 36.0], [125.0, 65.0, 50.0, 50.0]])
    for b in range(2):
        # Resizing blurs each edge by up to a pixel of the smaller image (1 / 0.67 px here), so a width may
        # shrink by two; centres stay within one.
        tol = 1 / min(TTA_SCALES) + 0.01
        assert torch.allclose(merged[b, :, :2], expected[b, :2].expand(7, 2), atol=tol), merged[b]
        assert torch.allclose(merged[b, :, 2:4], expected[b, 2:].expand(7, 2), atol=2 * tol), merged[b]
    flipped_pass = merged[0, 2:5, 0]
    assert (flipped_pass - 30.0).abs().max() < 2  # not 160 - 30


def test_scaled_images_keep_the_top_left_origin_and_stride_multiples() -> None:
    imgs = torch.rand(1, 3, 64, 96)
    out = scale_images(imgs, 0.67, STRIDE)
    assert out.shape[2] % STRIDE == 0 and out.shape[3] % STRIDE == 0
    assert torch.allclose(
        out[0, :, 0, 0],
        torch.nn.functional.interpolate(imgs, size=(42, 64), mode="bilinear", align_corners=False)[0, :, 0, 0],
    )
    assert torch.allclose(out[..., 42:, :], torch.tensor(0.447))  # padding below and to the right only


@pytest.fixture(scope="module")
def untrained_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "untrained.pt"
    torch.manual_seed(0)
    save_checkpoint(model_state(build_model("models/yolov5n.yaml", nc=2, names=["red", "blue"])), path)
    return path


def test_val_augment_reports_beside_the_plain_pass(rectangles_yaml, untrained_weights, tmp_path) -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOGGER.addHandler(handler)
    level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        results = val.run(
            data=str(rectangles_yaml),
            weights=str(untrained_weights),
            imgsz=64,
            batch_size=8,
            workers=0,
            augment=True,
            noplots=True,
            project=str(tmp_path),
            device="cpu",
        )
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
    assert results.plain is not None and results.plain.n_images == results.n_images == 8
    comparison = [line for line in lines if line.startswith("--augment: mAP50 ")]
    assert len(comparison) == 1 and "(plain " in comparison[0] and " ms per image (plain " in comparison[0]


def test_detect_augment_keeps_boxes_inside_the_image(rectangles_yaml, untrained_weights, tmp_path) -> None:
    source = rectangles_yaml.parent / "images/val/0000.jpg"
    out = detect.run(
        weights=str(untrained_weights),
        source=str(source),
        imgsz=64,
        conf_thres=0.001,
        augment=True,
        max_det=50,
        nosave=True,
        project=str(tmp_path),
        device="cpu",
    )
    assert len(out.detections) == 1
    for det in out.detections.values():
        assert len(det) and (det[:, :4] >= 0).all() and (det[:, [0, 2]] <= 96).all() and (det[:, [1, 3]] <= 96).all()


def test_augment_refuses_an_exported_model(rectangles_yaml, tmp_path) -> None:
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"")
    with pytest.raises(UserError):
        val.run(data=str(rectangles_yaml), weights=str(fake), augment=True, project=str(tmp_path))
