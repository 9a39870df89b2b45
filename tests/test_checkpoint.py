from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch

from models.loading import load_model
from models.yolo import Model
from utils.checkpoint import load_checkpoint, model_state, save_checkpoint
from utils.errors import UserError


def test_round_trip_gives_identical_outputs_and_loads_weights_only(tmp_path) -> None:
    model = Model("models/yolov5n.yaml", nc=4)
    model.names = ["a", "b", "c", "d"]
    path = tmp_path / "w.pt"
    save_checkpoint({**model_state(model), "epoch": 3}, path)
    raw = torch.load(path, weights_only=True)  # must open without arbitrary unpickling
    assert raw["epoch"] == 3
    loaded, ckpt = load_model(path)
    model.eval()
    x = torch.rand(2, 3, 96, 96)
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])
    assert loaded.names == ["a", "b", "c", "d"] and ckpt["epoch"] == 3


def test_save_leaves_no_temporary_file_and_replaces_atomically(tmp_path) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint({"model_cfg": {}, "model": {}, "epoch": 1}, path)
    save_checkpoint({"model_cfg": {}, "model": {}, "epoch": 2}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    assert load_checkpoint(path)["epoch"] == 2


class _RunsCommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_does_not_run(tmp_path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model_cfg": {}, "model": _RunsCommand(str(marker))}, path)  # a zip checkpoint with a payload
    with pytest.raises(UserError, match="refused"):
        load_checkpoint(path)
    legacy = tmp_path / "evil_legacy.pt"
    legacy.write_bytes(pickle.dumps(_RunsCommand(str(marker))))
    with pytest.raises(UserError):
        load_checkpoint(legacy)
    assert not marker.exists()


def test_pickled_model_object_is_refused(tmp_path) -> None:
    # Its classes pass the YOLOv5 import's allow-list, but it is not a YOLOv5 checkpoint (no Detect strides).
    path = tmp_path / "whole_model.pt"
    torch.save({"model": Model("models/yolov5n.yaml", nc=1)}, path)
    with pytest.raises(UserError, match="whole_model.pt: "):
        load_checkpoint(path)


def test_missing_truncated_and_foreign_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")
    good = tmp_path / "good.pt"
    save_checkpoint(model_state(Model("models/yolov5n.yaml", nc=1)), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(UserError, match=str(truncated.name)):
        load_checkpoint(truncated)
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)
    with pytest.raises(UserError, match="not a checkpoint of this project"):
        load_checkpoint(plain)
    assert zipfile.is_zipfile(good)
