"""The deploy seam on narrow trained checkpoints of every output layout (tests/deploy_fixtures.py): NMS inside the
ONNX graph against the PyTorch path, the accuracy gate and its table, files set aside, other people's ONNX clients,
the format registry, metadata in export folders and INT8 calibration data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import export
import val
from tests.deploy_fixtures import FIXTURES, assert_same_rows, end2end
from utils.errors import UserError
from utils.formats import format_named, format_of, open_runner, registered
from utils.formats.metadata import ModelMeta

ROOT = Path(__file__).resolve().parents[1]


def _copy(weights: Path, folder: Path) -> Path:
    """A checkpoint in a folder of the test's own, so that what is exported beside it is the test's alone."""
    out = folder / weights.name
    out.write_bytes(weights.read_bytes())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["yolov5", "anchor_free"])
def test_onnx_nms_finds_what_detect_finds_with_the_pt(layout, trained, deploy_data, tmp_path) -> None:
    """export --nms at detect.py's defaults: per image the same detections as detect.py with the .pt (boxes within
    1e-3 px, scores within 1e-5, after sorting); the file is end-to-end and says its thresholds."""
    weights = _copy(trained[layout], tmp_path)
    (path,) = export.run(weights=str(weights), include=["onnx"], nms=True, dynamic=True)
    runner = open_runner(path)
    family_iou = 0.45 if layout == "yolov5" else 0.7
    assert runner.meta.layout == "end2end" and runner.meta.nms == {"conf": 0.25, "iou": family_iou, "max_det": 1000}
    source = deploy_data.parent / "images" / "val"
    runs = {
        w.suffix: detect.run(
            weights=str(w), source=str(source), batch_size=4, nosave=True, project=str(tmp_path), name=w.suffix[1:]
        )
        for w in (weights, path)
    }
    found = runs[".pt"].detections
    assert sum(len(d) for d in found.values()) >= 8, "too few detections to compare"  # a trained model finds boxes
    for key, det in found.items():
        other = runs[".onnx"].detections[key]
        assert other.shape == det.shape, key
        assert_same_rows(other, det, atol=[1e-3] * 4 + [1e-5, 0], err_msg=key)
    # docs/deploy.md's own-code example, as printed there, on a committed image wider than high (so padded): the
    # same detections as detect.py with the same file.
    image = FIXTURES / "two_frames.jpg"
    (expected,) = detect.run(
        weights=str(path), source=str(image), nosave=True, project=str(tmp_path)
    ).detections.values()
    assert len(expected) >= 1, "no detection to compare"
    example = deploy_example().replace('"best.onnx"', repr(str(path))).replace('"image.jpg"', repr(str(image)))
    names: dict = {}
    exec(compile(example, "docs/deploy.md", "exec"), names)
    got = np.array([[*box, score, names["record"]["names"].index(name)] for name, score, box in names["detections"]])
    assert_same_rows(got, expected, atol=[1e-3] * 4 + [1e-5, 0], err_msg="docs/deploy.md example")


def deploy_example() -> str:
    """The Python block of docs/deploy.md that runs an exported file with onnxruntime, OpenCV and NumPy alone."""
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if "onnxruntime as ort" in b and "copyMakeBorder" in b]
    return block


@pytest.mark.slow
def test_the_gate_validates_every_file_and_prints_one_table(trained, deploy_data, tmp_path, capsys) -> None:
    weights = _copy(trained["anchor_free"], tmp_path)
    kept = export.run(weights=str(weights), include=["onnx", "torchscript"], data=str(deploy_data), simplify=False)
    assert sorted(p.name for p in kept) == ["narrow_yolo11.onnx", "narrow_yolo11.torchscript"]
    table = capsys.readouterr().out.split("Accuracy gate on the val split")[1].splitlines()
    assert "median of 50 runs on" in table[0]
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert set(rows) == {"pytorch", "onnx", "torchscript"}
    reference = float(rows["pytorch"][3])
    assert reference > 0.2  # a model that detects: a drop would show
    for name in ("onnx", "torchscript"):  # fp32: the same mAP50-95, a latency per image
        assert rows[name][1] == "fp32" and abs(float(rows[name][3]) - reference) <= 0.001
        assert float(rows[name][5]) > 0 and "REJECTED" not in " ".join(rows[name])


@pytest.mark.slow
def test_export_py_sets_aside_a_file_past_the_gate_and_exits_1_naming_it(trained, deploy_data, tmp_path) -> None:
    """A gate no file can pass (--max-drop -1): the file is renamed .rejected with both mAPs in one line, the others
    would be kept, and the command fails naming it."""
    weights = _copy(trained["yolov5"], tmp_path).rename(tmp_path / "w.pt")
    done = subprocess.run(
        [
            sys.executable,
            "export.py",
            "--weights",
            str(weights),
            "--include",
            "onnx",
            "--data",
            str(deploy_data),
            "--max-drop",
            "-1",
            "--no-simplify",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert errors[-1] == f"ERROR 1 file(s) set aside: {weights.with_name('w.onnx.rejected')}"
    set_aside = [line for line in done.stdout.splitlines() if "set aside as w.onnx.rejected" in line]
    assert len(set_aside) == 1 and " against " in set_aside[0] and "for the PyTorch model (drop" in set_aside[0]
    assert "Accuracy gate on the val split" in done.stdout and "REJECTED: mAP50-95 " in done.stdout
    assert "Traceback" not in done.stderr
    assert (tmp_path / "w.onnx.rejected").is_file() and not (tmp_path / "w.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["yolov5", "anchor_free", "end2end"])
def test_fp32_onnx_runs_in_opencv_dnn_with_onnxruntimes_outputs(layout, exported_onnx) -> None:
    import cv2

    runner = open_runner(exported_onnx[layout])
    x = torch.rand(1, 3, *runner.meta.imgsz, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = runner(x).numpy()
    net = cv2.dnn.readNetFromONNX(str(exported_onnx[layout]))
    net.setInput(x.numpy())
    got = net.forward()
    assert got.shape == expected.shape
    if layout == "end2end":  # top-k may order rows of equal score either way
        assert_same_rows(got, expected, atol=1e-3, rtol=1e-4)
    else:
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["yolov5", "anchor_free", "end2end"])
def test_val_py_scores_the_onnx_as_the_pt(layout, trained, exported_onnx, deploy_data, tmp_path) -> None:
    """val.py on each layout's fp32 ONNX gives the .pt's figures at the same shape (square letterboxes)."""
    options = {
        "data": str(deploy_data),
        "imgsz": 64,
        "batch_size": 4,
        "workers": 0,
        "noplots": True,
        "project": str(tmp_path),
        "end2end": end2end(layout),
    }
    onnx = val.run(weights=str(exported_onnx[layout]), **options)
    assert onnx.n_images == 16 and onnx.map > 0.05
    runner = open_runner(trained[layout], end2end=end2end(layout))
    from models.families import family_of
    from utils.data.config import load_data_config
    from utils.evaluation.gate import split_map

    cfg = load_data_config(str(deploy_data))
    reference = split_map(runner, family_of(runner.meta.family), cfg, cfg["val"], 64, 0, batch_size=4)
    assert abs(onnx.map - reference) <= 1e-3


def test_a_file_that_fails_the_numeric_check_is_set_aside(trained, tmp_path, monkeypatch) -> None:
    """A runtime that computes otherwise than PyTorch (scores off by 0.05): the file is renamed .rejected, not kept."""
    from utils.formats.onnx import OnnxRunner

    real = OnnxRunner.run
    monkeypatch.setattr(OnnxRunner, "run", lambda self, images: real(self, images) + 0.05)
    weights = _copy(trained["yolov5"], tmp_path)
    with pytest.raises(UserError, match=r"^1 file\(s\) set aside: .*narrow_yolov5\.onnx\.rejected$"):
        export.run(weights=str(weights), include=["onnx"], simplify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow_yolov5.onnx.rejected", "narrow_yolov5.pt"]


def test_one_line_for_what_cannot_be_exported(trained, tmp_path) -> None:
    weights = str(_copy(trained["yolov5"], tmp_path))
    cases = [
        ({"int8": True}, r"--int8 needs --data: INT8 is calibrated on images of the data YAML's train split"),
        ({"int8": True, "half": True, "data": "x.yaml"}, r"--half and --int8: one precision per call"),
        ({"include": ["ncnn"], "int8": True, "data": "x.yaml"}, r"--include ncnn: no int8 files"),
        ({"include": ["tensorrt"]}, r"--include tensorrt: unknown format; choose from onnx, torchscript"),
        ({"include": ["torchscript"], "nms": True}, r"--nms: NMS inside the graph is written for ONNX only"),
        ({"include": ["onnx"], "nms": True, "end2end": True}, r"--nms and --end2end: the end-to-end output is already"),
        ({"include": ["torchscript"], "int8": True, "data": "x.yaml"}, r"--include torchscript: no int8 files"),
    ]
    for options, message in cases:
        with pytest.raises(UserError, match=message):
            export.run(weights=weights, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow_yolov5.pt"]  # nothing written


def test_a_missing_onnxslim_is_one_line_not_a_silent_skip(trained, tmp_path, monkeypatch, capsys) -> None:
    import importlib.util
    import logging

    from utils.log import LOGGER

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxslim" else real(name, *a))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOGGER.addHandler(handler)
    (path,) = export.run(weights=str(_copy(trained["yolov5"], tmp_path)), include=["onnx"])
    assert [line for line in lines if "onnxslim" in line] == [
        "WARNING --include onnx: onnxslim is not installed, the graph is written as traced, not simplified (pip "
        "install onnxslim; --no-simplify to ask for that)"
    ]
    assert "not simplified (onnxslim not installed)" in capsys.readouterr().out and path.is_file()


def test_the_registry_recognises_paths_by_their_shape(tmp_path, monkeypatch) -> None:
    from utils.formats.base import Format

    assert {"pytorch", "onnx", "torchscript"} <= set(registered())
    assert format_of(tmp_path / "a.onnx").name == "onnx" and format_of(tmp_path / "b.torchscript").name == "torchscript"
    assert format_named("onnx").output_path(Path("w/best.pt"), "fp16") == Path("w/best_fp16.onnx")

    class FolderFormat(Format):  # what a folder format declares: its folder suffix
        name, suffix, precisions = "demo", "_demo_model", ("fp32", "int8")

    demo = FolderFormat()
    assert demo.is_folder and demo.output_path(Path("w/best.pt"), "int8") == Path("w/best_int8_demo_model")
    folder = tmp_path / "best_demo_model"
    folder.mkdir()
    monkeypatch.setattr("utils.formats.registered", lambda: {**registered.__wrapped__(), "demo": demo})
    assert format_of(folder) is demo
    with pytest.raises(UserError, match=r"unknown weights format"):
        format_of(tmp_path / "model.xyz")


def test_metadata_in_an_export_folder_reads_back_and_as_ultralytics_writes_it(tmp_path) -> None:
    import yaml

    meta = ModelMeta(
        names=["red", "blue"],
        stride=32,
        kind="demo",
        imgsz=(64, 64),
        batch=1,
        family="yolo11",
        layout="end2end",
        precision="int8",
        nms={"conf": 0.25, "iou": 0.7, "max_det": 300},
    )
    meta.write_yaml(tmp_path, export_batch=1)
    raw = yaml.safe_load((tmp_path / "metadata.yaml").read_text())
    assert raw["names"] == {0: "red", 1: "blue"} and raw["imgsz"] == [64, 64] and raw["end2end"] is True
    assert raw["args"] == {
        "batch": 1,
        "half": False,
        "int8": True,
        "dynamic": False,
        "nms": True,
        "conf": 0.25,
        "iou": 0.7,
        "max_det": 300,
    }
    back = ModelMeta.from_yaml(tmp_path, "demo")
    assert (back.names, back.imgsz, back.layout, back.precision, back.nms) == (
        meta.names,
        meta.imgsz,
        meta.layout,
        meta.precision,
        meta.nms,
    )
    del raw["yolo_train"]  # an Ultralytics folder: its own keys only
    (tmp_path / "metadata.yaml").write_text(yaml.safe_dump(raw))
    theirs = ModelMeta.from_yaml(tmp_path, "demo")
    assert (theirs.names, theirs.layout, theirs.precision, theirs.nms["max_det"]) == (
        ["red", "blue"],
        "end2end",
        "int8",
        300,
    )


def test_calibration_images_come_from_train_outside_the_held_out_slice(deploy_data) -> None:
    from utils.data.config import load_data_config
    from utils.data.labels import load_labels
    from utils.evaluation.calibration import calibration_images, train_parts

    cfg = load_data_config(str(deploy_data))
    first = list(calibration_images(cfg, 5, 64, 32))
    assert len(first) == 5 and all(a.shape == (1, 3, 64, 64) and a.dtype == np.float32 for a in first)
    assert all(a.min() >= 0 and a.max() <= 1 for a in first)
    again = list(calibration_images(cfg, 5, 64, 32))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))  # the same images on every run
    part, held_out = train_parts(cfg)
    calibration = {str(p) for p in load_labels(part, verbose=False).im_files}
    held = {str(p) for p in load_labels(held_out, verbose=False).im_files}
    train = {str(p) for p in load_labels(cfg["train"], verbose=False).im_files}
    assert held and not held & calibration and held | calibration == train
    assert not train & {str(p) for p in load_labels(cfg["val"], verbose=False).im_files}
