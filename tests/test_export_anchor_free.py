"""export.py, detect.py and val.py on checkpoints of YOLOv8, YOLO11 and YOLO26 written by Ultralytics' own trainer
(tests/fixtures/ultralytics): the exported ONNX and TorchScript files compute Ultralytics' own outputs and carry
the metadata its apps read."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import export
import val
from tests.conftest import write_rectangles_dataset, write_video
from tests.ultralytics_reference import FIXTURES, assert_close_to_ultralytics, assert_same_end2end_detections, reference
from utils.errors import UserError
from utils.formats import open_runner

FAMILIES = {"yolov8": "yolov8-final.pt", "yolo11": "yolo11-final.pt", "yolo26": "yolo26-final.pt"}


def _export(folder: Path, family: str, **options) -> dict[str, Path]:
    weights = folder / FAMILIES[family]
    shutil.copyfile(FIXTURES / FAMILIES[family], weights)
    x, _ = reference(family)
    files = export.run(
        weights=str(weights), imgsz=list(x.shape[2:]), batch_size=x.shape[0], include=["onnx", "torchscript"], **options
    )
    return {p.suffix: p for p in files}


class _ExportedOnce(dict):
    """A family's fixture exported on first use, once per test process: ONNX with a dynamic batch, TorchScript traced
    at the reference batch. Lazily, so a worker that runs one of these tests exports only the family it needs."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, family: str) -> dict[str, Path]:
        self[family] = _export(self.tmp_path_factory.mktemp(family), family, dynamic=True)
        return self[family]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict[str, Path]]:
    return _ExportedOnce(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_files_compute_ultralytics_outputs(exported, family) -> None:
    files = exported[family]
    assert set(files) == {".onnx", ".torchscript"}
    x, ref = reference(family)
    for path in files.values():
        runner = open_runner(path)
        meta = runner.meta
        assert meta.layout == "anchor_free" and meta.family == family and meta.imgsz == tuple(x.shape[2:])
        with torch.no_grad():
            assert_close_to_ultralytics(runner(x), ref["pred"], str(path))  # (B, 4 + nc, A)


@pytest.mark.slow
def test_yolo26_end2end_export_computes_ultralytics_end2end_output(tmp_path) -> None:
    weights = tmp_path / FAMILIES["yolo26"]
    shutil.copyfile(FIXTURES / FAMILIES["yolo26"], weights)
    x, ref = reference("yolo26")
    # ONNX only: the TorchScript path is the same trace as the one-to-many output's, tested above.
    files = {
        p.suffix: p
        for p in export.run(
            weights=str(weights), imgsz=list(x.shape[2:]), batch_size=x.shape[0], include=["onnx"], end2end=True
        )
    }
    for path in files.values():
        runner = open_runner(path, end2end=True)
        assert runner.meta.layout == "end2end"
        with torch.no_grad():
            out = runner(x)
        assert out.shape == (2, 300, 6)
        assert_same_end2end_detections(out, ref["end2end"], str(path))


def test_end2end_needs_a_one_to_one_head(tmp_path) -> None:
    with pytest.raises(
        UserError, match=r"--end2end: .*yolo11-final\.pt has no one-to-one head \(YOLO26, D-FINE, RT-DETRv2 only\)"
    ):
        export.run(weights=str(FIXTURES / "yolo11-final.pt"), imgsz=[64], include=["onnx"], end2end=True)


@pytest.mark.slow
def test_onnx_metadata_as_ultralytics_writes_it(exported) -> None:
    import onnx

    files = exported["yolo11"]
    proto = onnx.load(str(files[".onnx"]))
    props = {p.key: p.value for p in proto.metadata_props}
    theirs = json.loads((FIXTURES / "onnx_metadata.json").read_text())
    assert [i.name for i in proto.graph.input] == json.loads(theirs.pop("_input_names")) == ["images"]
    assert [o.name for o in proto.graph.output] == json.loads(theirs.pop("_output_names")) == ["output0"]
    apps_read = ("names", "stride", "task", "batch", "imgsz", "channels", "end2end")
    assert set(apps_read) <= set(props) and set(apps_read) <= set(theirs)
    for key in ("stride", "task", "channels", "end2end"):  # same value strings for the same model
        assert props[key] == theirs[key], key
    names = ast.literal_eval(props["names"])  # Ultralytics' apps read these values with ast.literal_eval
    assert names == ast.literal_eval(theirs["names"]) == {i: f"class{i}" for i in range(20)}
    assert ast.literal_eval(props["imgsz"]) == [64, 96] and int(props["batch"]) == 2
    ours = json.loads(props["yolo_train"])
    assert ours["family"] == "yolo11" and ours["layout"] == "anchor_free" and ours["batch"] is None  # dynamic
    ts_meta = open_runner(files[".torchscript"]).meta
    assert ts_meta.names == [f"class{i}" for i in range(20)] and ts_meta.batch == 2


def _images(folder: Path, n: int = 3) -> Path:
    import cv2

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        img = rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)
        cv2.imwrite(str(folder / f"{i}.jpg"), img)
    return folder


@pytest.mark.slow
def test_detect_and_val_run_on_ultralytics_checkpoints(tmp_path) -> None:
    source = _images(tmp_path / "images")
    for family, end2end in (("yolov8", False), ("yolo26", True)):
        result = detect.run(
            weights=str(FIXTURES / FAMILIES[family]),
            source=str(source),
            imgsz=64,
            conf_thres=0.0,
            max_det=20,
            save_txt=True,
            project=str(tmp_path / "runs"),
            name=f"{family}{end2end}",
            end2end=end2end,
        )
        assert len(result.detections) == 3
        for det in result.detections.values():  # conf 0 keeps boxes: a check of the layout's decoding
            assert det.shape[1] == 6 and 0 < len(det) <= 20
            nc = 5 if family == "yolo26" else 3
            assert (det[:, 4] >= 0).all() and (det[:, 4] <= 1).all() and (det[:, 5] < nc).all()
            assert (det[:, 2] >= det[:, 0]).all() and (det[:, 3] >= det[:, 1]).all()
    data = write_rectangles_dataset(tmp_path / "data", n_train=2, n_val=4, size=64, n_classes=3)
    results = val.run(
        data=str(data),
        weights=str(FIXTURES / FAMILIES["yolov8"]),
        imgsz=64,
        batch_size=2,
        workers=0,
        noplots=True,
        project=str(tmp_path / "val"),
        name="v8",
    )
    assert 0 <= results.map <= results.map50 <= 1 and results.n_images == 4
    data5 = write_rectangles_dataset(tmp_path / "data5", n_train=2, n_val=4, size=64, n_classes=5)
    for end2end in (False, True):  # YOLO26: the one-to-many head with NMS, or the one-to-one head's top-k as is
        results = val.run(
            data=str(data5),
            weights=str(FIXTURES / FAMILIES["yolo26"]),
            imgsz=64,
            batch_size=2,
            workers=0,
            noplots=True,
            project=str(tmp_path / "val"),
            name=f"v26{end2end}",
            end2end=end2end,
        )
        assert 0 <= results.map <= results.map50 <= 1 and results.n_images == 4
        if end2end:
            assert 0 < results.n_detections <= 4 * 300


def test_detect_on_a_video_with_an_ultralytics_checkpoint(tmp_path) -> None:
    import cv2

    video = write_video(tmp_path / "clip.mp4", frames=3)
    for family, end2end in (("yolo11", False), ("yolo26", True)):
        result = detect.run(
            weights=str(FIXTURES / FAMILIES[family]),
            source=str(video),
            imgsz=64,
            conf_thres=0.0,
            max_det=10,
            project=str(tmp_path / "runs"),
            name=family,
            end2end=end2end,
        )
        assert sorted(result.detections) == [f"{video}:{i}" for i in range(3)]
        assert all(det.shape[1] == 6 and 0 < len(det) <= 10 for det in result.detections.values())
        out = cv2.VideoCapture(str(result.save_dir / "clip.mp4"))
        assert out.isOpened() and int(out.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
        out.release()


def test_ultralytics_own_export_metadata_is_read() -> None:
    """An ONNX file exported by Ultralytics (its metadata_props as committed) describes itself to our backends."""
    from utils.formats.metadata import ModelMeta

    props = json.loads((FIXTURES / "onnx_metadata.json").read_text())
    meta = ModelMeta.from_onnx_props(props, Path("yolo11n.onnx"))
    assert meta.names == [f"class{i}" for i in range(20)] and meta.stride == 32 and meta.imgsz == (64, 64)
    assert (meta.family, meta.layout, meta.batch) == ("yolo11", "anchor_free", 1)
    with pytest.raises(UserError, match=r"an Ultralytics segment model"):
        ModelMeta.from_onnx_props({**props, "task": "segment"}, Path("seg.onnx"))


def test_test_time_augmentation_on_ultralytics_checkpoints(tmp_path) -> None:
    source = _images(tmp_path / "images")
    # YOLO26 through its one-to-many head, before NMS
    result = detect.run(
        weights=str(FIXTURES / FAMILIES["yolo26"]),
        source=str(source),
        imgsz=64,
        conf_thres=0.0,
        max_det=20,
        augment=True,
        nosave=True,
        project=str(tmp_path / "runs"),
    )
    assert len(result.detections) == 3
    for det in result.detections.values():  # boxes of every pass mapped back inside the 80 x 64 images
        assert det.shape[1] == 6 and 0 < len(det) <= 20
        assert (det[:, :4] >= 0).all() and (det[:, [0, 2]] <= 80).all() and (det[:, [1, 3]] <= 64).all()
    data = write_rectangles_dataset(tmp_path / "data", n_train=2, n_val=4, size=64, n_classes=3)
    results = val.run(
        data=str(data),
        weights=str(FIXTURES / FAMILIES["yolov8"]),
        imgsz=64,
        batch_size=2,
        workers=0,
        augment=True,
        noplots=True,
        project=str(tmp_path / "val"),
    )
    assert results.plain is not None and results.n_images == results.plain.n_images == 4
    # The one-to-one head's detections are final: nothing to merge (val.py makes the same check).
    with pytest.raises(UserError, match=r"^--augment needs predictions before NMS .*--end2end"):
        detect.run(
            weights=str(FIXTURES / FAMILIES["yolo26"]),
            source=str(source),
            imgsz=64,
            augment=True,
            end2end=True,
            project=str(tmp_path / "refused"),
        )


@pytest.mark.parametrize("stride", ["0", "inf", "-32", "32.5", "1e400"])
def test_exported_metadata_refuses_a_stride_that_is_not_one(stride) -> None:
    from utils.formats.metadata import ModelMeta

    props = json.loads((FIXTURES / "onnx_metadata.json").read_text())
    with pytest.raises(UserError, match=r"x.onnx: metadata unreadable \(ValueError: stride .* is not a whole number"):
        ModelMeta.from_onnx_props({**props, "stride": stride}, Path("x.onnx"))  # Ultralytics' props
    record = f'{{"names": ["a"], "stride": {stride.replace("inf", "Infinity")}}}'
    with pytest.raises(UserError, match=r"x.onnx: metadata unreadable \(ValueError: stride .* is not a whole number"):
        ModelMeta.from_json(record, "onnx", Path("x.onnx"))  # ours
