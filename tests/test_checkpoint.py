from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch

from models.loading import load_model
from models.yolo import Model
from utils.checkpoint import load_checkpoint, model_state, restore_training_state, save_checkpoint
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


# ---- malformed files, first lines, configs out of bounds, names (issue 49, item 8) ----------------------------------

TINY_CFG = {
    "nc": 3,
    "anchors": [[10, 13, 16, 30], [30, 61, 62, 45], [116, 90, 156, 198]],
    "backbone": [[-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [8, 3, 2]]],
    "head": [[[0, 1, 2], 1, "Detect", ["nc", "anchors"]]],
}


def _with_data_pkl(good: bytes, payload: bytes) -> bytes:
    """``good``'s zip with its pickle replaced by ``payload``."""
    import io

    with zipfile.ZipFile(io.BytesIO(good)) as z:
        entries = [(info.filename, z.read(info)) for info in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in entries:
            z.writestr(name, payload if name.endswith("data.pkl") else data)
    return out.getvalue()


def test_malformed_checkpoints_are_one_line_errors_naming_the_file(tmp_path) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"model_cfg": {}, "model": {"w": torch.zeros(2)}}, buf)
    good = buf.getvalue()
    protocol0 = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2)}}, protocol0, pickle_protocol=0)
    cases = {
        "empty_pkl": _with_data_pkl(good, b""),
        "protocol0": protocol0.getvalue(),
        "mark_only": _with_data_pkl(good, b"("),
        "proto_only": _with_data_pkl(good, b"\x80\x02"),
        "text_pkl": _with_data_pkl(good, b"garbage"),
        "legacy_cut": b"\x80\x02",
        "empty_file": b"",
        "cut_zip": good[: len(good) // 2],
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        with pytest.raises(UserError) as info:
            load_checkpoint(path)
        assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value), name


def test_first_line_of_empty_and_multiline_messages() -> None:
    from utils.errors import describe, first_line

    assert first_line(EOFError()) == "EOFError" and describe(EOFError()) == "EOFError"
    assert first_line(ValueError("\n  bad value\nmore")) == "bad value"
    assert describe(KeyError("k")) == "KeyError: 'k'"


def test_model_configs_out_of_bounds_are_refused_before_building() -> None:
    from models import yolo

    for key, value in (("width_multiple", 64), ("nc", 10**7), ("depth_multiple", float("inf")), ("ch", 10**6)):
        with pytest.raises(UserError, match=key if key != "ch" else "input channels"):
            Model({**TINY_CFG, key: value})
    wide = {**TINY_CFG, "backbone": [[-1, 1, "Conv", [4000, 3, 2]], [-1, 1, "Conv", [4000, 5, 2]]]}
    wide["backbone"].append(TINY_CFG["backbone"][2])  # 4000 x 4000 x 25 weights: over the parameter bound
    with pytest.raises(UserError, match="parameters"):
        Model(wide)
    with pytest.raises(UserError, match="kernel 64"):
        Model({**TINY_CFG, "backbone": [[-1, 1, "Conv", [8, 64, 2]], *TINY_CFG["backbone"][1:]]})
    with pytest.raises(UserError, match="anchors"):
        Model({**TINY_CFG, "anchors": [[]]})
    with pytest.raises(UserError, match="layer 1"):
        Model({**TINY_CFG, "backbone": [TINY_CFG["backbone"][0], [5, 1, "Conv", [8, 3, 2]], TINY_CFG["backbone"][2]]})
    assert yolo.MAX_PARAMETERS < 10**9


def test_checkpoint_with_fewer_names_than_classes_loads_with_names_filled(tmp_path) -> None:
    from detect import _found

    model = Model(TINY_CFG)
    path = tmp_path / "few_names.pt"
    save_checkpoint({**model_state(model), "names": ["cat"]}, path)
    loaded, _ = load_model(path)
    assert loaded.names == ["cat", "1", "2"]
    assert _found(torch.tensor([[0, 0, 4, 4, 0.9, 2.0]]).numpy(), loaded.names) == "1 2"
    with pytest.raises(UserError, match="few_names.pt: "):  # a config the weights do not fit: one line
        save_checkpoint({**model_state(model), "model_cfg": {**TINY_CFG, "nc": 4}}, path)
        load_model(path)


def test_restored_moments_take_their_parameters_layout() -> None:
    # CUDA's fused AdamW refuses moments whose strides differ from their channels_last parameters' (a resume on a
    # GPU died so); checkpoints written with contiguous moments must still resume.
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(conv.parameters(), fused=True)
    conv(torch.randn(1, 3, 8, 8)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        for key, value in list(state.items()):
            state[key] = value.contiguous()
    fresh = torch.optim.AdamW(conv.parameters(), fused=True)
    restore_training_state({"optimizer": saved}, fresh, torch.amp.GradScaler("cpu", enabled=False), None)
    moments = fresh.state[conv.weight]
    assert conv.weight.stride() != conv.weight.contiguous().stride()  # the case at stake: a channels_last weight
    for key in ("exp_avg", "exp_avg_sq"):
        assert moments[key].stride() == conv.weight.stride(), key
        assert torch.equal(moments[key], optimizer.state[conv.weight][key])
