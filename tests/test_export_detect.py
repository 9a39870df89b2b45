"""export.py (ONNX, TorchScript) and detect.py (folders with a broken image, videos, exported files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
import export
from models.yolo import Model
from tests.conftest import write_video
from utils.checkpoint import model_state, save_checkpoint
from utils.evaluation.predictor import load_predictor
from utils.formats import open_runner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """An untrained yolov5n made to detect: BN statistics spread and the head scaled up, so scores pass 0.5."""
    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml", nc=2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.5)
        for conv in model.model[-1].m:
            conv.weight *= 30
            conv.bias.view(3, -1)[:, 4:] = 0
    model.names = ["red", "blue"]
    path = tmp_path_factory.mktemp("weights") / "tiny.pt"
    save_checkpoint(model_state(model), path)
    return path


@pytest.fixture(scope="module")
def exported(weights) -> dict[str, Path]:
    files = export.run(weights=str(weights), imgsz=[64], include=["onnx", "torchscript"], dynamic=True)
    return {p.suffix: p for p in files}


def _images(folder: Path, n: int = 3, size: int = 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
        cv2.rectangle(img, (8, 8), (40, 50), (40, 40, 220), -1)
        cv2.imwrite(str(folder / f"{i:03d}.jpg"), img)
    return folder


@pytest.mark.slow
def test_exported_files_agree_with_pytorch_and_carry_metadata(weights, exported) -> None:
    assert set(exported) == {".onnx", ".torchscript"}
    assert all(p.parent == weights.parent and p.stem == weights.stem for p in exported.values())
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = open_runner(weights)(x)
    for suffix, path in exported.items():
        runner = open_runner(path)
        meta = runner.meta
        assert meta.names == ["red", "blue"] and meta.stride == 32 and meta.imgsz == (64, 64)
        with torch.no_grad():
            out = runner(x)  # batch 2: dynamic for ONNX, split into the traced batch of 1 for TorchScript
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-3), (suffix, (out - ref).abs().max())


@pytest.mark.slow
def test_detect_skips_a_broken_image_and_agrees_across_formats(tmp_path, weights, exported, capsys) -> None:
    source = _images(tmp_path / "images")
    (source / "broken.jpg").write_bytes(b"not a jpeg")
    results = {}
    for path in (weights, exported[".onnx"], exported[".torchscript"]):
        results[path.suffix] = detect.run(
            weights=str(path),
            source=str(source),
            imgsz=64,
            conf_thres=0.5,
            save_txt=True,
            save_conf=True,
            save_crop=True,
            batch_size=2,
            project=str(tmp_path / "runs"),
            name=path.suffix[1:],
        )
    out = capsys.readouterr().out
    assert "1 input(s) skipped" in out and "broken.jpg" in out and "Speed:" in out
    ref = results[".pt"]
    assert ref.skipped == [str(source / "broken.jpg")] and len(ref.detections) == 3
    assert sum(len(d) for d in ref.detections.values()) > 0
    for suffix in (".onnx", ".torchscript"):
        for key, det in ref.detections.items():
            other = results[suffix].detections[key]
            assert other.shape == det.shape, (suffix, key)
            # Rows are matched regardless of order: near-equal scores may sort differently.
            gaps = np.abs(det[:, None, :] - other[None, :, :]).max(-1)
            assert (gaps.min(1) < 1e-2).all() and (gaps.min(0) < 1e-2).all(), (suffix, key)
    save_dir = ref.save_dir
    assert sorted(p.name for p in save_dir.glob("*.jpg")) == ["000.jpg", "001.jpg", "002.jpg"]
    label_file = next((save_dir / "labels").glob("*.txt"))
    rows = np.loadtxt(label_file, ndmin=2)
    assert rows.shape[1] == 6 and (rows[:, 1:5] >= 0).all() and (rows[:, 1:5] <= 1).all()
    assert any((save_dir / "crops").rglob("*.jpg"))


@pytest.mark.slow
def test_load_predictor_finds_what_detect_finds(tmp_path, weights, exported) -> None:
    """docs/deploy.md's "in your own code": load_predictor and detect() on images that are not the input size
    (letterboxed, then boxes back in their pixels) find what detect.py finds, on the page's example, an ONNX file."""
    source = _images(tmp_path / "images", n=2, size=96)
    for i in range(2):  # not square either: padding on one axis
        path = source / f"{i:03d}.jpg"
        cv2.imwrite(str(path), cv2.imread(str(path))[: 72 - 8 * i])
    path = exported[".onnx"]
    runs = {"project": str(tmp_path / "runs"), "name": path.suffix[1:], "nosave": True}
    ref = detect.run(weights=str(path), source=str(source), imgsz=64, conf_thres=0.5, **runs)
    assert sum(len(d) for d in ref.detections.values()) > 0
    predictor = load_predictor(path, conf_thres=0.5)
    assert predictor.meta.names == ["red", "blue"]
    keys = sorted(ref.detections)
    for key, boxes in zip(keys, predictor.detect([cv2.imread(key) for key in keys], 64)):
        det = ref.detections[key]
        assert boxes.shape == det.shape and boxes.dtype == det.dtype, (path.suffix, key)
        gaps = np.abs(det[:, None, :] - boxes[None, :, :]).max(-1)
        assert (gaps.min(1) < 1e-3).all() and (gaps.min(0) < 1e-3).all(), (path.suffix, key)


def test_detect_on_a_video(tmp_path, weights) -> None:
    video = write_video(tmp_path / "clip.mp4", frames=4)
    result = detect.run(
        weights=str(weights), source=str(video), imgsz=64, conf_thres=0.5, save_txt=True, project=str(tmp_path / "runs")
    )
    assert sorted(result.detections) == [f"{video}:{i}" for i in range(4)]
    out = cv2.VideoCapture(str(result.save_dir / "clip.mp4"))
    assert out.isOpened() and int(out.get(cv2.CAP_PROP_FRAME_COUNT)) == 4
    out.release()


@pytest.mark.slow
def test_detect_reports_a_missing_source_in_one_line(tmp_path, weights) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "detect.py",
            "--weights",
            str(weights),
            "--source",
            str(tmp_path / "nothing"),
            "--project",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 1
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "nothing: source not found" in errors[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("family", ["yolov5", "yolo11"])
def test_half_exports_fp16_onnx_on_the_cpu(tmp_path, weights, family) -> None:
    """export.py --half on the CPU's fp16 kernels: an fp16 graph (the anchor grids' Range must not be fp16, which the
    ONNX exporter cannot type) named best_fp16.onnx beside an fp32 best.onnx, which it does not overwrite."""
    import onnx

    from tests.ultralytics_reference import FIXTURES
    from utils.evaluation.gate import Rejected, check_numerics

    source = tmp_path / f"{family}.pt"
    source.write_bytes((weights if family == "yolov5" else FIXTURES / "yolo11-final.pt").read_bytes())
    (fp32,) = export.run(weights=str(source), imgsz=[64], include=["onnx"], simplify=False)
    (fp16,) = export.run(weights=str(source), imgsz=[64], include=["onnx"], half=True, simplify=False)
    assert (fp32.name, fp16.name) == (f"{family}.onnx", f"{family}_fp16.onnx") and fp32.exists()
    graph = onnx.load(str(fp16)).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    runner = open_runner(fp16)
    assert runner.meta.precision == "fp16" and runner.input_dtype == torch.float16
    # export.py's own check of the file: onnxruntime's fp16 against PyTorch's, at the fp16 tolerance ...
    model = open_runner(source).model
    im = torch.rand(1, 3, 64, 64).half()
    with torch.no_grad():
        ref = model.half()(im)[0]
        out = runner(im)
    check_numerics(out, ref, runner.meta.layout, "fp16")
    # ... and still refuses a file whose scores are off by 0.05 (a real fault, not rounding).
    scores = (slice(None), slice(4, None)) if runner.meta.layout == "anchor_free" else (Ellipsis, slice(4, None))
    wrong = out.clone()
    wrong[scores] += 0.05
    with pytest.raises(Rejected, match="output differs"):
        check_numerics(wrong, ref, runner.meta.layout, "fp16")
