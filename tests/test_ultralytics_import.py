"""Importing Ultralytics checkpoints (models/families/ultralytics_import.py): the committed fixtures, made by
Ultralytics' own trainer (tests/fixtures/ultralytics, see its README), load without running pickled code and compute
Ultralytics' own outputs; payloads, other tasks, missing files and --resume get one line each."""

from __future__ import annotations

import builtins
import logging
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from models.families import family_of
from tests.ultralytics_reference import FIXTURES, assert_close_to_ultralytics, assert_same_end2end_detections, reference
from utils.checkpoint import load_checkpoint
from utils.errors import UserError

CHECKPOINTS = {  # file -> (family, number of classes, the slot its weights come from, scale letter, width)
    "yolov8-final.pt": ("yolov8", 3, "model", "n", 0.015625),
    "yolo11-final.pt": ("yolo11", 20, "model", "n", 0.015625),
    "yolo26-final.pt": ("yolo26", 5, "model", "n", 0.015625),
    "yolo26-last.pt": ("yolo26", 5, "ema", "n", 0.015625),
}  # yolo12-final.pt: tests/test_yolo12.py


# ---- fake Ultralytics module paths, to pickle objects that name them (the real package is never imported) ----


@pytest.fixture
def fake_ultralytics(monkeypatch) -> types.SimpleNamespace:
    classes = {}
    for module_name, names in (
        ("ultralytics.nn.tasks", ("DetectionModel", "SegmentationModel")),
        ("ultralytics.nn.modules.head", ("Detect",)),
    ):
        module = types.ModuleType(module_name)
        for name in names:
            cls = type(name, (nn.Module,), {"__module__": module_name})
            setattr(module, name, cls)
            classes[name] = cls
        monkeypatch.setitem(sys.modules, module_name, module)
    for parent in ("ultralytics", "ultralytics.nn", "ultralytics.nn.modules"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    return types.SimpleNamespace(**classes)


def _v8_yaml(levels: int = 3) -> dict:
    sources = [15, 18, 21, 22][:levels]
    return {
        "nc": 2,
        "scales": {"n": [0.33, 0.25, 1024]},
        "scale": "n",
        "backbone": [[-1, 1, "Conv", [64, 3, 2]]],
        "head": [[sources, 1, "Detect", ["nc"]]],
    }


class ExecPayload:
    """Unpickling calls builtins.exec, which would create ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


class SystemPayload(ExecPayload):
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _dressed_payload(fake_ultralytics, tmp_path: Path, payload: type[ExecPayload]) -> tuple[Path, Path]:
    """A checkpoint shaped like Ultralytics' (a DetectionModel with its yaml) carrying ``payload`` inside the model."""
    marker = tmp_path / "payload_ran"
    model = fake_ultralytics.DetectionModel()
    model.yaml = _v8_yaml()
    model.add_module("detect", fake_ultralytics.Detect())
    model.args = payload(marker)
    path = tmp_path / "yolo11n.pt"
    torch.save({"model": model, "ema": None, "epoch": -1, "version": "8.4.0"}, path)
    return path, marker


# ---- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, global_name", [(ExecPayload, "builtins.exec"), (SystemPayload, os.system.__module__)]
)
def test_a_payload_dressed_as_an_ultralytics_checkpoint_is_refused_and_nothing_runs(
    fake_ultralytics, tmp_path, payload, global_name
) -> None:
    path, marker = _dressed_payload(fake_ultralytics, tmp_path, payload)
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: refused") and global_name in message
    assert not marker.exists()


def test_a_payload_in_a_model_slot_alone_is_refused(tmp_path) -> None:
    marker = tmp_path / "payload_ran"
    path = tmp_path / "best.pt"
    torch.save({"model": ExecPayload(marker), "ema": None}, path)
    with pytest.raises(UserError, match=r"best\.pt: refused: the file names (__builtin__|builtins)\.exec"):
        load_checkpoint(path)
    assert not marker.exists()


def test_an_allowed_class_called_with_arguments_is_refused(fake_ultralytics, tmp_path) -> None:
    """The stand-ins take no constructor arguments: an allowed name used as a callable cannot smuggle a call."""

    class Smuggler:
        def __reduce__(self):
            return fake_ultralytics.DetectionModel, ("rm -rf /",)

    path = tmp_path / "smuggled.pt"
    torch.save({"model": Smuggler(), "ema": None}, path)
    with pytest.raises(UserError, match=r"smuggled\.pt: refused"):
        load_checkpoint(path)


def test_detect_refuses_a_payload_in_one_line_and_nothing_runs(fake_ultralytics, tmp_path) -> None:
    import detect
    from utils.log import LOGGER

    path, marker = _dressed_payload(fake_ultralytics, tmp_path, ExecPayload)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOGGER.addHandler(handler)
    try:
        status = detect.main(["--weights", str(path), "--source", str(tmp_path), "--project", str(tmp_path / "runs")])
    finally:
        LOGGER.removeHandler(handler)
    errors = [line for line in lines if "ERROR" in line]
    assert status == 1 and len(errors) == 1 and str(path) in errors[0] and "exec" in errors[0], lines
    assert "\n" not in errors[0] and not marker.exists()


def test_other_tasks_and_variants_are_refused_in_one_line(fake_ultralytics, tmp_path) -> None:
    segment = fake_ultralytics.SegmentationModel()
    segment.yaml = _v8_yaml()
    torch.save({"model": segment, "ema": None}, tmp_path / "seg.pt")
    with pytest.raises(UserError, match=r"seg\.pt: a segmentation \(segment\) model.*only Ultralytics detection"):
        load_checkpoint(tmp_path / "seg.pt")
    segment.args = ExecPayload(tmp_path / "payload_ran")  # a payload is named as such, whatever it is dressed as
    torch.save({"model": segment, "ema": None}, tmp_path / "seg.pt")
    with pytest.raises(UserError, match=r"seg\.pt: refused: the file names (__builtin__|builtins)\.exec"):
        load_checkpoint(tmp_path / "seg.pt")
    assert not (tmp_path / "payload_ran").exists()

    p2 = fake_ultralytics.DetectionModel()
    p2.yaml = _v8_yaml(levels=4)
    torch.save({"model": p2, "ema": None}, tmp_path / "p2.pt")
    with pytest.raises(UserError, match=r"p2\.pt: its Detect head has 4 levels \(a P2 or P6 variant\)"):
        load_checkpoint(tmp_path / "p2.pt")

    pose = fake_ultralytics.DetectionModel()
    pose.yaml = {**_v8_yaml(), "head": [[[15, 18, 21], 1, "Pose", ["nc", [17, 3]]]]}
    torch.save({"model": pose, "ema": None}, tmp_path / "pose.pt")
    with pytest.raises(UserError, match=r"pose\.pt: its head is Pose, not Detect"):
        load_checkpoint(tmp_path / "pose.pt")


def test_a_missing_release_checkpoint_says_where_such_files_come_from(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        load_checkpoint("yolo11n.pt")
    message = str(e.value)
    assert message.startswith("yolo11n.pt: checkpoint not found") and "nothing is downloaded" in message
    assert "github.com/ultralytics/assets/releases" in message and "\n" not in message
    assert not (tmp_path / "yolo11n.pt").exists()
    with pytest.raises(UserError, match=r"^mine\.pt: checkpoint not found$"):
        load_checkpoint("mine.pt")


# ---- the fixtures: safe import, equality with Ultralytics' own outputs ------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_ultralytics_checkpoints_import_and_compute_ultralytics_outputs(name) -> None:
    from models.loading import load_model

    family, nc, _, scale, width = CHECKPOINTS[name]
    ckpt = load_checkpoint(FIXTURES / name)
    assert ckpt["source"] == "ultralytics" and len(ckpt["names"]) == nc and ckpt["ema"] is None
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
    assert ckpt["model_cfg"]["scale"] == scale and ckpt["model_cfg"]["scales"][scale][1] == width  # its own description
    model, _ = load_model(FIXTURES / name)
    assert family_of(model).name == family and ckpt["model_cfg"]["family"] == family
    x, ref = reference(family)
    assert sum(p.numel() for p in model.parameters()) == int(ref["n_params"])
    assert torch.equal(model.stride.float(), ref["stride"])
    with torch.no_grad():
        assert_close_to_ultralytics(model(x)[0], ref["pred"], name)  # (B, 4 + nc, A)
    if "end2end" in ref:
        model.model[-1].end2end_output = True
        with torch.no_grad():
            e2e = model(x)[0]
        assert e2e.shape == (2, 300, 6)
        assert_same_end2end_detections(e2e, ref["end2end"], name)


def test_fine_tuning_to_fewer_classes_keeps_the_class_branch_hidden_layers() -> None:
    """yolo11 with 20 classes -> 2 classes: the class branch's width (max(8, min(nc, 100)) at this scale) would
    shrink from 20 to 8; built at the source's width instead, only its last layers start afresh."""
    from models.yolo import build_model

    ckpt = load_checkpoint(FIXTURES / "yolo11-final.pt")
    source = ckpt["model"]
    model = build_model(ckpt["model_cfg"], nc=2, weights=source, transfer=True)
    own = model.state_dict()
    fresh = sorted(k for k in own if not (k in source and own[k].shape == source[k].shape))
    assert fresh == [f"model.23.cv3.{i}.2.{p}" for i in range(3) for p in ("bias", "weight")]
    assert all(torch.equal(own[k], source[k]) for k in own if k not in fresh)
    assert own["model.23.cv3.0.2.weight"].shape == (2, 20, 1, 1) and model.yaml["head_class_width"] == 20
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 64, 64))[0].shape == (1, 4 + 2, 84)
    plain = build_model(ckpt["model_cfg"], nc=2)  # without the source, the width follows the class count
    assert plain.model[-1].cv3[0][2].weight.shape == (2, 8, 1, 1)


def test_train_resume_of_an_ultralytics_checkpoint_is_one_line(train_here, tmp_path) -> None:
    status, log = train_here("--resume", FIXTURES / "yolo26-last.pt", "--project", tmp_path)
    errors = [line for line in log.splitlines() if line.startswith("ERROR")]
    assert status == 1 and len(errors) == 1, log[-2000:]
    assert "cannot resume: an Ultralytics checkpoint" in errors[0] and "--weights" in errors[0]
