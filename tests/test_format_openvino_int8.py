"""OpenVINO (fp32, fp16, INT8) and ONNX INT8 on the narrow trained checkpoints of tests/deploy_fixtures.py: every
output layout's OpenVINO folder computes what PyTorch computes, its metadata.yaml carries Ultralytics' keys, val.py
and detect.py take the folder, and the fp16 and INT8 files pass export.py's accuracy gate; the INT8 ONNX is a QDQ
graph with signed symmetric INT8 and the head's decoding in float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import export
import val
from tests.deploy_fixtures import assert_same_rows, end2end
from utils.errors import UserError
from utils.formats import format_named, open_runner

# The keys of the metadata.yaml Ultralytics 8.4 writes into an OpenVINO folder for a detection model (less
# license/docs/head, which are about Ultralytics itself).
ULTRALYTICS_KEYS = {
    "description",
    "author",
    "date",
    "version",
    "stride",
    "task",
    "batch",
    "imgsz",
    "names",
    "args",
    "channels",
    "end2end",
}


class _OpenVinoOnce(dict):
    """A layout's fp32 OpenVINO folder (dynamic batch), exported on first use, once per test module."""

    def __init__(self, trained: dict[str, Path], folder: Path):
        super().__init__()
        self.trained, self.folder = trained, folder

    def __missing__(self, layout: str) -> Path:
        weights = self.folder / layout / self.trained[layout].name
        weights.parent.mkdir(exist_ok=True)
        weights.write_bytes(self.trained[layout].read_bytes())
        (path,) = export.run(weights=str(weights), include=["openvino"], dynamic=True, end2end=end2end(layout))
        self[layout] = path
        return path


@pytest.fixture(scope="module")
def openvino_fp32(trained, tmp_path_factory) -> dict[str, Path]:
    return _OpenVinoOnce(trained, tmp_path_factory.mktemp("openvino"))


def _copy(weights: Path, folder: Path) -> Path:
    out = folder / weights.name
    out.write_bytes(weights.read_bytes())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["yolov5", "anchor_free", "end2end"])
def test_openvino_fp32_computes_what_pytorch_computes(layout, trained, openvino_fp32) -> None:
    """A batch of 3 through the folder's runner (batch open) and through the .pt: the same output0."""
    runner = open_runner(openvino_fp32[layout])
    assert runner.meta.kind == "openvino" and runner.meta.batch is None and runner.meta.precision == "fp32"
    reference = open_runner(trained[layout], end2end=end2end(layout))
    assert runner.meta.layout == reference.meta.layout
    x = torch.rand(3, 3, *runner.meta.imgsz, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = runner(x).numpy(), reference.model(x)[0].numpy()
    assert got.shape == expected.shape
    if layout == "end2end":  # top-k may order rows of equal score either way
        assert_same_rows(got, expected, atol=1e-3, rtol=1e-4)
    else:
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_the_folder_holds_the_ir_and_ultralytics_metadata(openvino_fp32) -> None:
    import yaml

    folder = openvino_fp32["anchor_free"]
    assert folder.name == "narrow_yolo11_openvino_model"
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.yaml", "narrow_yolo11.bin", "narrow_yolo11.xml"]
    raw = yaml.safe_load((folder / "metadata.yaml").read_text())
    assert set(raw) >= ULTRALYTICS_KEYS
    assert raw["task"] == "detect" and raw["stride"] == 32 and raw["imgsz"] == [64, 64] and raw["end2end"] is False
    assert isinstance(raw["names"], dict) and sorted(raw["names"]) == [0, 1]  # {0: name, ...} as Ultralytics'
    assert raw["args"]["dynamic"] is True and raw["args"]["int8"] is False


@pytest.mark.slow
def test_val_py_and_detect_py_take_the_openvino_folder(trained, openvino_fp32, deploy_data, tmp_path) -> None:
    """val.py scores the folder as the .pt at the same square shape; detect.py finds the .pt's detections."""
    from models.families import family_of
    from utils.data.config import load_data_config
    from utils.evaluation.gate import split_map

    folder = openvino_fp32["anchor_free"]
    scored = val.run(
        weights=str(folder),
        data=str(deploy_data),
        imgsz=64,
        batch_size=4,
        workers=0,
        noplots=True,
        project=str(tmp_path),
    )
    runner = open_runner(trained["anchor_free"])
    cfg = load_data_config(str(deploy_data))
    reference = split_map(runner, family_of(runner.meta.family), cfg, cfg["val"], 64, 0, batch_size=4)
    assert scored.n_images == 16 and reference > 0.2 and abs(scored.map - reference) <= 1e-3
    source = deploy_data.parent / "images" / "val"
    runs = {
        w.suffix or "ov": detect.run(
            weights=str(w),
            source=str(source),
            imgsz=64,
            batch_size=4,
            nosave=True,
            project=str(tmp_path),
            name=w.suffix[1:] or "ov",
        ).detections
        for w in (trained["anchor_free"], folder)
    }
    assert sum(len(d) for d in runs[".pt"].values()) >= 8
    for key, det in runs[".pt"].items():
        other = runs["ov"][key]
        assert other.shape == det.shape, key
        assert_same_rows(other[:, :5], det[:, :5], atol=1e-2, err_msg=key)


@pytest.mark.slow
def test_openvino_fp16_passes_the_gate_with_half_the_weights(
    trained, openvino_fp32, deploy_data, tmp_path, capsys
) -> None:
    weights = _copy(trained["anchor_free"], tmp_path)
    (path,) = export.run(weights=str(weights), include=["openvino"], half=True, dynamic=True, data=str(deploy_data))
    assert path.name == "narrow_yolo11_fp16_openvino_model"
    assert "openvino    fp16" in capsys.readouterr().out
    assert open_runner(path).meta.precision == "fp16"
    fp32_bin = openvino_fp32["anchor_free"] / "narrow_yolo11.bin"
    assert (path / "narrow_yolo11.bin").stat().st_size < 0.6 * fp32_bin.stat().st_size


def _own_nodes(model, head: str) -> list:  # noqa: ANN001 (onnx.ModelProto)
    """The head's own nodes (its decoding), not those of its child modules: '/model/model.24/Sigmoid'."""
    return [n for n in model.graph.node if n.name.startswith(f"/model/{head}/") and n.name.count("/") == 3]


def test_the_int8_scope_maps_onto_the_onnx_nodes_of_the_decoding(trained, exported_onnx) -> None:
    """Anchor-free: DFL and the head's own operations are kept float; the head's convolutions and the rest are not."""
    from types import SimpleNamespace

    import onnx

    from models.families import family_of
    from utils.formats.onnx_int8 import float_nodes

    runner = open_runner(trained["anchor_free"])
    family = family_of(runner.meta.family)
    job = SimpleNamespace(int8_scope=family.int8_float_scope(runner.model), model=runner.model)
    model = onnx.load(str(exported_onnx["anchor_free"]))
    kept = set(float_nodes(model, family.export_module(runner.model), job))
    head = f"model.{len(runner.model.model) - 1}"
    own = {n.name for n in _own_nodes(model, head)}
    dfl = {n.name for n in model.graph.node if n.name.startswith(f"/model/{head}/dfl/")}
    assert own and dfl and own | dfl <= kept
    assert any(n.op_type == "Sigmoid" for n in _own_nodes(model, head))
    others = [n for n in model.graph.node if n.name not in kept]
    assert all(
        n.op_type != "Concat" or not n.name.startswith(f"/model/{head}/") or n.name.count("/") > 3 for n in others
    )
    assert any(n.op_type == "Conv" and n.name.startswith(f"/model/{head}/cv") for n in others)  # head convs: INT8
    assert not any(n.startswith("/model/model.0/") for n in kept)


@pytest.mark.slow
def test_int8_onnx_and_openvino_pass_the_gate(trained, deploy_data, tmp_path, capsys) -> None:
    """One --int8 call writes both, calibrated on train images; the ONNX is QDQ with signed symmetric INT8 zero
    points, every convolution's weights INT8 with per-channel scales but the head's prediction convolutions (float,
    as the family's INT8 scope says), biases float, and no output of the head's decoding quantized; OpenVINO has
    FakeQuantize operations."""
    import onnx
    from onnx import numpy_helper

    weights = _copy(trained["yolov5"], tmp_path)
    kept = export.run(weights=str(weights), include=["onnx", "openvino"], int8=True, data=str(deploy_data))
    assert [p.name for p in kept] == ["narrow_yolov5_int8.onnx", "narrow_yolov5_int8_openvino_model"]
    out = capsys.readouterr().out
    assert "onnx        int8" in out and "openvino    int8" in out and "REJECTED" not in out
    model = onnx.load(str(kept[0]))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quantizers and all(inits[n.input[2]].dtype == np.int8 and not inits[n.input[2]].any() for n in quantizers)
    head = f"model.{len(open_runner(weights).model.model) - 1}"
    prediction = [n for n in model.graph.node if n.op_type == "Conv" and n.name.startswith(f"/model/{head}/m.")]
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n not in prediction]
    producers = {out: node for node in model.graph.node for out in node.output}
    weight_dq = [producers[n.input[1]] for n in convs]
    assert all(p.op_type == "DequantizeLinear" and inits[p.input[1]].size > 1 for p in weight_dq)  # per channel
    assert len(prediction) == 3 and all(inits[n.input[1]].dtype == np.float32 for n in prediction)
    dequantized = [
        inits[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
    ]
    assert dequantized and all(a.dtype == np.int8 for a in dequantized)  # no INT32 biases: TensorRT refuses them
    decoding = {out for n in _own_nodes(model, head) for out in n.output}
    assert decoding and not [n.name for n in quantizers if n.input[0] in decoding]  # nothing decoded is quantized
    assert open_runner(kept[1]).meta.precision == "int8"
    assert 'type="FakeQuantize"' in (kept[1] / "narrow_yolov5.xml").read_text()
    import openvino as ov  # NNCF's MIXED preset leaves the activation functions' inputs float (docs/deploy.md)

    ops = ov.Core().read_model(str(kept[1] / "narrow_yolov5.xml")).get_ordered_ops()
    activations = [op for op in ops if op.get_type_name() in ("Swish", "Sigmoid")]
    assert activations and not [
        op.get_friendly_name() for op in activations if op.input_value(0).get_node().get_type_name() == "FakeQuantize"
    ]


def test_a_missing_openvino_is_one_line(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(UserError, match=r"^--include openvino: openvino needs openvino \(pip install openvino\)$"):
        format_named("openvino")
