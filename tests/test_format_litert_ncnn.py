"""LiteRT (.tflite) and NCNN (folder) exports of the narrow trained checkpoints (tests/deploy_fixtures.py): every
output layout in fp32 against PyTorch through ``open_runner``, LiteRT fp16 and INT8 and NCNN fp16 on the anchor-free
layout, the metadata where Ultralytics' readers look for it, what cannot be written (one line each), and val.py and
detect.py on the files.

LiteRT's converter takes most of a minute per model on a loaded 2-core CPU, and its time grows with the graph: the
anchor-free layout is the trained narrow model (whose float graph its fp16 and INT8 exports quantize), the YOLOv5 and
end-to-end layouts a model of three convolutions and the family's head (``converted``), since what differs between
layouts is the head and its decoding. Each is converted once per session (across pytest-xdist workers too;
``_convert`` is memoised here, and what it converts is checked by the fp32 tests).
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import detect
import export
import val
from tests.deploy_fixtures import IMGSZ, assert_same_rows, end2end
from utils.errors import UserError
from utils.formats import format_named, open_runner

pytestmark = pytest.mark.slow


class _OncePerLayout(dict):
    """A format's export of each layout (fp32, or another precision of the anchor-free one), written on first use."""

    def __init__(self, trained: dict[str, Path], folder: Path, fmt: str):
        super().__init__()
        self.trained, self.folder, self.fmt = trained, folder, fmt
        self.data: Path | None = None  # the data YAML, for INT8

    def __missing__(self, key: tuple[str, str]) -> Path:
        layout, precision = key
        weights = self.folder / f"{layout}_{precision}" / self.trained[layout].name
        weights.parent.mkdir()
        shutil.copyfile(self.trained[layout], weights)
        options = {"fp16": {"half": True}, "int8": {"int8": True, "data": str(self.data), "max_drop": 1.0}}
        (path,) = export.run(
            weights=str(weights),
            include=[self.fmt],
            imgsz=[IMGSZ],
            end2end=end2end(layout),
            **options.get(precision, {}),
        )
        self[key] = path
        return path


HEAD_ONLY_ANCHORS = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
HEAD_ONLY_FAMILIES = {
    "yolov5": ("yolov5", {"anchors": HEAD_ONLY_ANCHORS}),
    "end2end": ("yolo26", {"end2end": True, "reg_max": 1}),
}


def head_only_checkpoint(layout: str, path: Path) -> Path:
    """An untrained model of that layout: three strided convolutions (P3, P4, P5) and the family's head."""
    from models.yolo import build_model
    from utils.checkpoint import model_state, save_checkpoint

    family, extra = HEAD_ONLY_FAMILIES[layout]
    detect_args = ["nc", "anchors"] if "anchors" in extra else ["nc"]
    cfg = {
        "family": family,
        "nc": 2,
        "depth_multiple": 1.0,
        "width_multiple": 1.0,
        **extra,
        "backbone": [[-1, 1, "Conv", [8, 3, 8]], [-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [8, 3, 2]]],
        "head": [[[0, 1, 2], 1, "Detect", detect_args]],
    }
    torch.manual_seed(0)
    model = build_model(cfg, names=["red", "blue"])
    save_checkpoint({**model_state(model), "opt": {"imgsz": IMGSZ}}, path)
    return path


@pytest.fixture(scope="session")
def converted(trained, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint each layout's exports come from (see the module docstring)."""
    folder = tmp_path_factory.mktemp("head_only")
    out = {"anchor_free": trained["anchor_free"]}
    for layout in HEAD_ONLY_FAMILIES:
        (folder / layout).mkdir()
        out[layout] = head_only_checkpoint(layout, folder / layout / "best.pt")
    return out


def _shared_folder(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees (each worker has its own base folder)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def litert_files(converted, deploy_data, tmp_path_factory):
    """LiteRT files on demand; the float conversion of each model once per session, across xdist workers too."""
    from filelock import FileLock

    from utils.formats import litert

    real, cache = litert._convert, _shared_folder(tmp_path_factory) / "litert_float_graphs"
    cache.mkdir(exist_ok=True)

    def convert_once(module, example, path):  # noqa: ANN001, ANN202
        weights = sum(float(p.double().sum()) for p in module.state_dict().values())
        done = cache / f"{module.layout}_{'x'.join(map(str, example.shape))}_{weights:.6e}.tflite"
        with FileLock(str(done) + ".lock"):
            if not done.exists():
                real(module, example, path)
                shutil.copyfile(path, done)
        shutil.copyfile(done, path)

    files = _OncePerLayout(converted, tmp_path_factory.mktemp("litert"), "litert")
    files.data = deploy_data
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(litert, "_convert", convert_once)
        yield files


@pytest.fixture(scope="session")
def ncnn_files(converted, tmp_path_factory):
    return _OncePerLayout(converted, tmp_path_factory.mktemp("ncnn"), "ncnn")


def _compare_with_pytorch(path: Path, weights: Path, layout: str, atol: float) -> None:
    """The exported file's output through open_runner against the .pt's, on a batch of 2 (a fixed-batch file
    runs it in pieces)."""
    x = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = open_runner(weights, end2end=end2end(layout))(x).numpy()
        got = open_runner(path)(x).numpy()
    assert got.shape == expected.shape
    if layout == "end2end":  # top-k may order rows of equal score either way
        assert_same_rows(got, expected, atol=atol, rtol=1e-3)
    else:
        np.testing.assert_allclose(got, expected, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("layout", ["yolov5", "anchor_free", "end2end"])
@pytest.mark.traces_with_dynamo  # LiteRT's converter runs torch.export
def test_litert_fp32_computes_what_pytorch_computes(layout, litert_files, converted) -> None:
    path = litert_files[layout, "fp32"]
    assert path.name == converted[layout].stem + ".tflite"  # Ultralytics' name: best.tflite
    runner = open_runner(path)
    assert (runner.meta.layout, runner.meta.imgsz, runner.meta.batch, runner.meta.precision) == (
        layout,
        (IMGSZ, IMGSZ),
        1,
        "fp32",
    )
    _compare_with_pytorch(path, converted[layout], layout, atol=1e-3)


@pytest.mark.parametrize("layout", ["yolov5", "anchor_free"])
def test_ncnn_fp32_computes_what_pytorch_computes(layout, ncnn_files, converted) -> None:
    path = ncnn_files[layout, "fp32"]
    assert path.name == converted[layout].stem + "_ncnn_model"
    assert sorted(p.name for p in path.iterdir()) == ["metadata.yaml", "model.ncnn.bin", "model.ncnn.param"]
    assert open_runner(path).meta.precision == "fp32"
    _compare_with_pytorch(path, converted[layout], layout, atol=1e-3)


def test_yolo26_goes_to_ncnn_with_nms_after_the_network_not_end_to_end(converted, tmp_path) -> None:
    """ncnn has no top-k or gather layer: --end2end is one line; YOLO26's one-to-many output exports and runs."""
    weights = tmp_path / converted["end2end"].name
    shutil.copyfile(converted["end2end"], weights)
    with pytest.raises(UserError, match=r"^--end2end: ncnn has no top-k and gather layers"):
        export.run(weights=str(weights), include=["ncnn"], imgsz=[IMGSZ], end2end=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [weights.name]  # nothing written
    (path,) = export.run(weights=str(weights), include=["ncnn"], imgsz=[IMGSZ])
    assert open_runner(path).meta.layout == "anchor_free"
    _compare_with_pytorch(path, weights, "anchor_free", atol=1e-3)


@pytest.mark.traces_with_dynamo  # LiteRT's converter runs torch.export
def test_litert_fp16_stores_fp16_weights_and_keeps_the_output(litert_files, trained) -> None:
    from ai_edge_litert.interpreter import Interpreter

    path = litert_files["anchor_free", "fp16"]
    assert path.name == trained["anchor_free"].stem + "_fp16.tflite"
    assert path.stat().st_size < 0.6 * litert_files["anchor_free", "fp32"].stat().st_size
    assert np.float16 in {d["dtype"] for d in Interpreter(model_path=str(path)).get_tensor_details()}
    assert open_runner(path).meta.precision == "fp16"
    _compare_with_pytorch(path, trained["anchor_free"], "anchor_free", atol=0.05)


@pytest.mark.traces_with_dynamo  # LiteRT's converter runs torch.export
def test_litert_int8_quantizes_all_but_the_head_and_stays_near_pytorch(litert_files, trained, capsys) -> None:
    """INT8 calibrated on train images (gate at --max-drop 1 so that the file is kept whatever it scores here):
    int8 weights and activations, float input and output, the head's decoding in float; its mAP50-95 on the val
    split within 0.05 of the .pt's."""
    from ai_edge_litert.interpreter import Interpreter

    path = litert_files["anchor_free", "int8"]
    assert path.name == trained["anchor_free"].stem + "_int8.tflite"
    interpreter = Interpreter(model_path=str(path))
    details = interpreter.get_tensor_details()
    assert interpreter.get_input_details()[0]["dtype"] == np.float32
    assert interpreter.get_output_details()[0]["dtype"] == np.float32
    int8 = [d["name"] for d in details if d["dtype"] == np.int8]
    assert len(int8) > 100
    head = "AnchorFreeDetect_23"
    decoding = [d for d in details if d["name"].split(";")[0].endswith(head) and d["dtype"] != np.int32]
    assert decoding and all(d["dtype"] == np.float32 for d in decoding)  # the head's own ops stay float
    assert not [n for n in int8 if "DFL_dfl" in n]  # DFL (its Int8Scope module) too
    table = capsys.readouterr().out.split("Accuracy gate on the val split")[1].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:4]}
    assert rows["litert"][1] == "int8" and abs(float(rows["litert"][3]) - float(rows["pytorch"][3])) < 0.05
    assert open_runner(path).meta.precision == "int8"


def test_ncnn_fp16_stores_fp16_weights_and_keeps_the_output(ncnn_files, trained) -> None:
    path = ncnn_files["anchor_free", "fp16"]
    assert path.name == trained["anchor_free"].stem + "_fp16_ncnn_model"
    fp32 = ncnn_files["anchor_free", "fp32"]
    assert (path / "model.ncnn.bin").stat().st_size < 0.6 * (fp32 / "model.ncnn.bin").stat().st_size
    assert open_runner(path).meta.precision == "fp16"
    _compare_with_pytorch(path, trained["anchor_free"], "anchor_free", atol=0.05)


@pytest.mark.traces_with_dynamo  # LiteRT's converter runs torch.export
def test_metadata_is_where_ultralytics_readers_look(litert_files, ncnn_files) -> None:
    with zipfile.ZipFile(litert_files["anchor_free", "fp32"]) as archive:  # appended to the flatbuffer
        litert = json.loads(archive.read("metadata.json"))
    ncnn = yaml.safe_load((ncnn_files["anchor_free", "fp32"] / "metadata.yaml").read_text())
    for raw in (litert, ncnn):
        assert raw["task"] == "detect" and {int(k): v for k, v in raw["names"].items()} == {0: "red", 1: "blue"}
        assert raw["imgsz"] == [IMGSZ, IMGSZ] and raw["batch"] == 1 and raw["end2end"] is False
        assert raw["stride"] == 32 and "yolo_train" in raw


def test_what_cannot_be_written_is_one_line(trained, tmp_path, monkeypatch) -> None:
    import importlib.util

    weights = tmp_path / trained["yolov5"].name
    shutil.copyfile(trained["yolov5"], weights)
    with pytest.raises(UserError, match=r"^--include ncnn: no int8 files \(ncnn's INT8 tools"):
        export.run(weights=str(weights), include=["ncnn"], int8=True, data="x.yaml")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("pnnx", "ai_edge_quantizer") else real(name, *a)
    )
    with pytest.raises(UserError, match=r"^--include ncnn: ncnn needs pnnx \(pip install pnnx\)$"):
        format_named("ncnn")
    with pytest.raises(
        UserError,
        match=r"^--include litert: litert needs ai-edge-quantizer \(pip install "
        r"ai-edge-quantizer\)$",
    ):
        format_named("litert")
    assert sorted(p.name for p in tmp_path.iterdir()) == [weights.name]


@pytest.mark.traces_with_dynamo  # LiteRT's converter runs torch.export
def test_val_py_scores_the_tflite_as_the_pt(litert_files, trained, deploy_data, tmp_path) -> None:
    from models.families import family_of
    from utils.data.config import load_data_config
    from utils.evaluation.gate import split_map

    result = val.run(
        weights=str(litert_files["anchor_free", "fp32"]),
        data=str(deploy_data),
        imgsz=IMGSZ,
        batch_size=4,
        workers=0,
        noplots=True,
        project=str(tmp_path),
    )
    runner = open_runner(trained["anchor_free"])
    cfg = load_data_config(str(deploy_data))
    reference = split_map(runner, family_of(runner.meta.family), cfg, cfg["val"], IMGSZ, 0, batch_size=4)
    assert result.n_images == 16 and result.map > 0.05 and abs(result.map - reference) <= 1e-3


def test_detect_py_finds_with_the_ncnn_folder_what_it_finds_with_the_pt(
    ncnn_files, trained, deploy_data, tmp_path
) -> None:
    source = deploy_data.parent / "images" / "val"
    runs = [
        detect.run(
            weights=str(w), source=str(source), imgsz=IMGSZ, batch_size=4, nosave=True, project=str(tmp_path), name=name
        )
        for name, w in (("pt", trained["anchor_free"]), ("ncnn", ncnn_files["anchor_free", "fp32"]))
    ]
    found, other = runs[0].detections, runs[1].detections
    assert sum(len(d) for d in found.values()) >= 8 and found.keys() == other.keys()
    for key, det in found.items():
        assert other[key].shape == det.shape, key
        assert_same_rows(other[key], det, atol=1e-2, err_msg=key)
