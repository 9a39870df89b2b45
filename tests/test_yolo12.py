"""YOLO12 through the family seam: Ultralytics' own outputs from a checkpoint its trainer wrote (the narrowest YOLO12
that builds: attention heads need 32 channels), area attention, a step on 2 ranks equal to one process, ONNX export.
Parameter counts and key names are checked with the other families' in tests/test_models_anchor_free.py."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import main_on_ranks, run_forked, write_rectangles_dataset

import export
import train
from models.blocks import A2C2f, AreaAttention
from models.families import YOLO12, family_of
from models.yolo import build_model, load_model_config
from tests.ultralytics_reference import FIXTURES, assert_close_to_ultralytics, reference
from utils.checkpoint import load_checkpoint, model_weights
from utils.formats import open_runner

CHECKPOINT = FIXTURES / "yolo12-final.pt"


def test_yolo12_checkpoint_imports_and_computes_ultralytics_outputs_and_class_logits() -> None:
    ckpt = load_checkpoint(CHECKPOINT)  # through the Ultralytics importer's allow-list
    assert ckpt["source"] == "ultralytics" and len(ckpt["names"]) == 4 and ckpt["ema"] is None
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
    cfg = ckpt["model_cfg"]  # its own description: the narrowest YOLO12 (heads of 32 channels) at scale letter l
    assert cfg["family"] == "yolo12" and cfg["scale"] == "l" and cfg["scales"]["l"] == [0.25, 0.25, 256]
    model = build_model(cfg, weights=model_weights(ckpt), names=ckpt["names"]).eval()
    assert family_of(model) is YOLO12
    blocks = [m for m in model.modules() if isinstance(m, A2C2f)]
    areas = sorted({m.area for m in model.modules() if isinstance(m, AreaAttention)})
    assert areas == [1, 4] and all(b.gamma is not None for b in blocks if isinstance(b.m[0], torch.nn.Sequential))
    x, ref = reference("yolo12")
    assert sum(p.numel() for p in model.parameters()) == int(ref["n_params"])
    with torch.no_grad():
        pred, raw = model(x)
    assert_close_to_ultralytics(pred, ref["pred"], "yolo12 predictions")  # (B, 4 + nc, A)
    class_logits = torch.cat([level.flatten(2) for level in raw], 2)[:, -model.nc :]
    assert_close_to_ultralytics(class_logits, ref["class_logits"], "yolo12 class logits")
    detections = YOLO12.detections(pred, 0.0, YOLO12.val_iou, max_det=10)
    assert [d.shape for d in detections] == [(10, 6), (10, 6)]


def test_area_attention_needs_a_map_that_splits_into_its_areas() -> None:
    attention = AreaAttention(64, 2, area=4).eval()
    assert attention(torch.rand(1, 64, 2, 6)).shape == (1, 64, 2, 6)
    with pytest.raises(ValueError, match="a 3x3 feature map does not split into 4 equal areas"):
        attention(torch.rand(1, 64, 3, 3))


@pytest.mark.slow
def test_yolo12_trains_and_a_step_on_two_ranks_equals_one_process(tmp_path) -> None:
    """One optimizer step of the whole batch (8 images; 4 on each rank with --sync-bn), then the final epoch's
    bookkeeping, as the yolo26 step is checked in tests/test_train_anchor_free.py."""
    rectangles_yaml = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4, size=64)
    cfg = {**load_model_config("yolo12.yaml"), "scales": {"n": [0.25, 0.25, 256]}}  # the checkpoint's width
    cfg.pop("yaml_file")
    (tmp_path / "yolo12n.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    common = [
        "--data",
        str(rectangles_yaml),
        "--cfg",
        str(tmp_path / "yolo12n.yaml"),
        "--epochs",
        "1",
        "--noval",
        "--deterministic",
        "--no-amp",
        "--optimizer",
        "SGD",
        "--seed",
        "3",
        "--sync-bn",
        "--name",
        "exp",
        "--imgsz",
        "32",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--noplots",
    ]
    assert run_forked([(train.main, ([*common, "--project", str(tmp_path / "single")],), {})]) == [0]
    codes, outputs = main_on_ranks(train.main, [*common, "--project", str(tmp_path / "ranks")], 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    single = load_checkpoint(tmp_path / "single/exp/weights/last.pt")
    ranks = load_checkpoint(tmp_path / "ranks/exp/weights/last.pt")
    assert single["model_cfg"]["family"] == "yolo12" and ranks["model_cfg"]["family"] == "yolo12"
    names = [k for k in single["model"] if k.endswith((".weight", ".bias"))]
    diff = torch.cat([(ranks["model"][k].double() - single["model"][k].double()).flatten() for k in names])
    norm = torch.cat([single["model"][k].double().flatten() for k in names]).norm()
    assert float(diff.norm() / norm) <= 2e-5
    losses = [_row(tmp_path / f"{run}/exp/results.csv") for run in ("single", "ranks")]
    assert losses[0] == losses[1] and all(float(v) > 0 for v in losses[0]), losses


def _row(results_csv) -> list[str]:
    """The last row's training losses (box, cls, dfl), to 4 digits."""
    header, *rows = [[cell.strip() for cell in line.split(",")] for line in results_csv.read_text().splitlines()]
    last = dict(zip(header, rows[-1]))
    return [f"{float(last[f'train/{name}_loss']):.4g}" for name in YOLO12.loss_names]


@pytest.mark.slow
def test_yolo12_exports_to_onnx_with_ultralytics_outputs(tmp_path) -> None:
    weights = tmp_path / CHECKPOINT.name
    weights.write_bytes(CHECKPOINT.read_bytes())
    x, ref = reference("yolo12")
    (onnx_file,) = export.run(
        weights=str(weights), imgsz=list(x.shape[2:]), batch_size=x.shape[0], include=["onnx"], simplify=False
    )  # the graph as traced: onnxslim is not YOLO12's to test
    runner = open_runner(onnx_file)
    meta = runner.meta
    assert meta.family == "yolo12" and meta.layout == "anchor_free"
    with torch.no_grad():
        assert_close_to_ultralytics(runner(x), ref["pred"], str(onnx_file))
