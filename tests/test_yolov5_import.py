"""YOLOv5 checkpoint import: files written here in YOLOv5's pickle layout, without YOLOv5's code."""

from __future__ import annotations

import copy
import os
import pickle
import types
from datetime import datetime
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch

from models.loading import load_model
from models.yolo import Detect, Model, build_model, load_model_config
from utils.checkpoint import load_checkpoint, model_weights
from utils.convert_yolov5 import main as convert_main
from utils.engine.config import TrainConfig
from utils.engine.resume import resumed_config
from utils.errors import UserError

# Our classes under the names YOLOv5 pickles them with (the other blocks already share YOLOv5's module paths).
_YOLOV5_NAMES = {Model: ("models.yolo", "DetectionModel"), Detect: ("models.yolo", "Detect")}


class _YoloV5Pickler(pickle._Pickler):
    """Python's pickler with class names rewritten the way YOLOv5's files spell them."""

    extra_globals: dict[object, tuple[str, str]] = {}

    def save_global(self, obj, name=None):
        target = _YOLOV5_NAMES.get(obj) or self.extra_globals.get(obj)
        if target is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{target[0]}\n{target[1]}\n".encode())
        self.memoize(obj)


def _pickle_module(extra: dict[object, tuple[str, str]] | None = None) -> types.SimpleNamespace:
    pickler = type("Pickler", (_YoloV5Pickler,), {"extra_globals": extra or {}})
    return types.SimpleNamespace(Pickler=pickler, __name__="yolov5_style_pickle", dump=pickle.dump)


def yolov5_style_model(model: Model, half: bool) -> Model:
    """A copy laid out as YOLOv5's DetectionModel: Detect.stride a plain attribute, names a dict."""
    m = copy.deepcopy(model).eval()
    detect = m.model[-1]
    stride = detect._buffers.pop("stride")
    detect.__dict__["stride"] = stride
    detect._grid_cache = {}
    m.yaml = {k: v for k, v in m.yaml.items() if k not in ("ch", "yaml_file", "family")}
    m.yaml_file = "yolov5n.yaml"
    m.names = dict(enumerate(model.names))
    m.__dict__["stride"] = stride  # YOLOv5 keeps it on the model too (a property here)
    return m.half() if half else m


def write_yolov5_checkpoint(
    path: Path,
    model: Model,
    *,
    half: bool = True,
    ema: Model | None = None,
    opt_payload: object = None,
    extra_globals: dict | None = None,
) -> Path:
    """A checkpoint dict as YOLOv5's train.py saves it, pickled under YOLOv5's class names."""
    opt = {
        "weights": "yolov5s.pt",
        "save_dir": PurePosixPath("runs/train/exp"),
        "seed": np.int64(0),
        "hyp": {"lr0": np.float64(0.01)},
        "payload": opt_payload,
    }
    ckpt = {
        "epoch": 2,
        "best_fitness": np.array([0.0123]),
        "model": yolov5_style_model(model, half),
        "ema": yolov5_style_model(ema, half) if ema is not None else None,
        "updates": 24,
        "optimizer": None,
        "opt": opt,
        "git": {"remote": None},
        "date": datetime.now().isoformat(),
    }
    torch.save(ckpt, path, pickle_module=_pickle_module(extra_globals), pickle_protocol=2)
    return path


def _random_model(nc: int = 3, seed: int = 0) -> Model:
    """yolov5n's layers at an eighth of its width (YOLOv5's files record their width; nothing here needs more)."""
    torch.manual_seed(seed)
    model = Model({**load_model_config("models/yolov5n.yaml"), "width_multiple": 0.125}, nc=nc)
    with torch.no_grad():  # BN statistics away from their defaults, so a wrong mapping shows in the outputs
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    model.names = [f"class{i}" for i in range(nc)]
    return model.eval()


@pytest.mark.parametrize("half", [False, True])
def test_yolov5_checkpoint_imports_with_the_same_outputs(tmp_path, half) -> None:
    model, ema = _random_model(seed=0), _random_model(seed=1)
    path = write_yolov5_checkpoint(tmp_path / "v5.pt", model, half=half, ema=ema)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # really a pickle of module objects, not our format
    ckpt = load_checkpoint(path)
    assert ckpt["source"] == "yolov5" and ckpt["names"] == ["class0", "class1", "class2"]
    assert ckpt["yolov5"]["opt"]["save_dir"] == "runs/train/exp" and ckpt["yolov5"]["best_fitness"] == 0.0123
    x = torch.rand(2, 3, 96, 128)
    for reference, weights in ((model, ckpt["model"]), (ema, model_weights(ckpt))):
        imported = build_model(ckpt["model_cfg"], weights=weights).eval()
        ref = copy.deepcopy(reference).half().float() if half else reference
        with torch.no_grad():
            (pred, raw), (ref_pred, ref_raw) = imported(x), ref(x)
        assert max((a - b).abs().max().item() for a, b in zip(raw, ref_raw)) < 1e-5
        assert torch.allclose(pred, ref_pred, rtol=1e-6, atol=1e-4)


def test_converted_file_loads_weights_only_and_cannot_be_resumed(tmp_path) -> None:
    src = write_yolov5_checkpoint(tmp_path / "v5.pt", _random_model())
    dst = tmp_path / "ours.pt"
    assert convert_main([str(src), str(dst)]) == 0
    raw = torch.load(dst, weights_only=True)
    assert raw["source"] == "yolov5"
    model, _ = load_model(dst)
    assert model.names == ["class0", "class1", "class2"]
    with pytest.raises(UserError, match="a YOLOv5 checkpoint"):
        resumed_config(TrainConfig(), frozenset(), dst, raw)
    assert convert_main([str(dst), str(tmp_path / "again.pt")]) == 1  # already ours


class _RunsCommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_payload_in_a_yolov5_checkpoint_is_refused_and_not_run(tmp_path) -> None:
    marker = tmp_path / "pwned"
    path = write_yolov5_checkpoint(tmp_path / "evil.pt", _random_model(), opt_payload=_RunsCommand(str(marker)))
    with pytest.raises(UserError, match=r"evil.pt: refused: the file names (posix|os|nt)\.system"):
        load_checkpoint(path)
    assert not marker.exists()


class Focus(torch.nn.Module):
    """Stands for a YOLOv5 block this project does not know (v5.0's Focus)."""


def test_unknown_class_is_refused(tmp_path) -> None:
    model = _random_model()
    model.model[0].extra = Focus()
    path = write_yolov5_checkpoint(tmp_path / "focus.pt", model, extra_globals={Focus: ("models.common", "Focus")})
    with pytest.raises(UserError, match="focus.pt: refused: the file names models.common.Focus"):
        load_checkpoint(path)


def test_mismatched_tensors_are_refused(tmp_path) -> None:
    model = _random_model()
    model.model[2].cv1.conv.weight = torch.nn.Parameter(torch.zeros(1, 1, 1, 1))
    path = write_yolov5_checkpoint(tmp_path / "bad.pt", model)
    with pytest.raises(UserError, match="bad.pt: 'model' tensors do not match .*shape: model.2.cv1.conv.weight"):
        load_checkpoint(path)


def test_fine_tuning_transfers_every_tensor_that_fits(tmp_path) -> None:
    source = _random_model(nc=80)
    ckpt = load_checkpoint(write_yolov5_checkpoint(tmp_path / "v5.pt", source, half=False))
    model = build_model(ckpt["model_cfg"], nc=2, weights=model_weights(ckpt), transfer=True)
    own, theirs = model.state_dict(), source.state_dict()
    head = isinstance(model.model[-1], Detect) and f"model.{len(model.model) - 1}.m."
    moved = [k for k in own if own[k].shape == theirs[k].shape]
    assert all(torch.equal(own[k], theirs[k]) for k in moved)
    assert sorted(set(own) - set(moved)) == sorted(k for k in own if k.startswith(head))  # only the class outputs
    assert torch.equal(own[f"{head[:-2]}anchors"], theirs[f"{head[:-2]}anchors"])  # the checkpoint's anchors
