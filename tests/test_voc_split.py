"""Pascal VOC XML as a split: YOLOv5's box conversion, difficult objects left out, classes from object names."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from utils.data.config import load_data_config
from utils.data.labels import load_labels
from utils.errors import UserError


def _xml(name: str, w: int, h: int, objects: list[tuple[str, int, tuple[int, int, int, int]]]) -> str:
    body = "".join(
        f"<object><name>{n}</name><difficult>{d}</difficult><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin>"
        f"<xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>"
        for n, d, b in objects
    )
    return (
        f"<annotation><filename>{name}</filename><size><width>{w}</width><height>{h}</height><depth>3</depth>"
        f"</size>{body}</annotation>"
    )


def make_voc(root: Path) -> Path:
    voc = root / "VOCdevkit" / "VOC2007"
    for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (voc / sub).mkdir(parents=True)
    samples = {
        "000002": [("dog", 0, (11, 21, 60, 40)), ("cat", 1, (1, 1, 10, 10))],  # the cat is difficult
        "000001": [("person", 0, (1, 1, 100, 50)), ("dog", 0, (50, 10, 90, 45))],
        "000003": [],  # no objects: background
        "000004": [("cat", 0, (5, 5, 30, 30))],
    }
    for i, objects in samples.items():
        cv2.imwrite(str(voc / "JPEGImages" / f"{i}.jpg"), np.full((50, 100, 3), 120, np.uint8))
        (voc / "Annotations" / f"{i}.xml").write_text(_xml(f"{i}.jpg", 100, 50, objects))
    (voc / "ImageSets" / "Main" / "train.txt").write_text("000002\n000001\n000003\n")
    (voc / "ImageSets" / "Main" / "val.txt").write_text("000004\n000005\n")  # 000005 is listed but missing
    yaml_file = root / "voc.yaml"
    yaml_file.write_text(
        f"path: {root / 'VOCdevkit'}\ntrain: {{voc: VOC2007, set: train}}\nval: {{voc: [VOC2007], set: val}}\n"
    )
    return yaml_file


def _yolov5_convert(w: float, h: float, box: tuple[float, float, float, float]) -> list[float]:
    """YOLOv5's data/VOC.yaml convert_box, box = (xmin, xmax, ymin, ymax): the numbers the reader must give."""
    dw, dh = 1.0 / w, 1.0 / h
    x, y = (box[0] + box[1]) / 2.0 - 1, (box[2] + box[3]) / 2.0 - 1
    return [x * dw, y * dh, (box[1] - box[0]) * dw, (box[3] - box[2]) * dh]


def test_voc_split_converts_as_yolov5_and_leaves_difficult_out(tmp_path: Path) -> None:
    cfg = load_data_config(make_voc(tmp_path))
    assert cfg["names"] == ["cat", "dog", "person"]  # sorted set of the object names, difficult ones included
    train = load_labels(cfg["train"], verbose=False)
    assert [Path(f).stem for f in train.im_files] == ["000001", "000002", "000003"]  # by path
    assert train.counts["difficult_left_out"] == 1 and train.counts["background"] == 1
    np.testing.assert_allclose(
        train.labels[0],
        [[2, *_yolov5_convert(100, 50, (1, 100, 1, 50))], [1, *_yolov5_convert(100, 50, (50, 90, 10, 45))]],
        atol=1e-6,
    )
    np.testing.assert_allclose(train.labels[1], [[1, *_yolov5_convert(100, 50, (11, 60, 21, 40))]], atol=1e-6)
    val = load_labels(cfg["val"], verbose=False)
    assert len(val) == 1 and val.counts["corrupt"] == 1 and any("000005" in m and "missing" in m for m in val.messages)


def test_voc_names_from_yaml_and_bad_form(tmp_path: Path) -> None:
    yaml_file = make_voc(tmp_path)
    yaml_file.write_text(yaml_file.read_text() + "names: [person, dog]\n")
    cfg = load_data_config(yaml_file)
    train = load_labels(cfg["train"], verbose=False)
    assert "unknown_class_objects" not in train.counts  # the only cat is difficult: left out first
    assert list(train.labels[0][:, 0]) == [0, 1]
    val = load_labels(cfg["val"], verbose=False)  # its only object, a cat, is not in names: skipped and counted
    assert val.counts["unknown_class_objects"] == 1 and len(val.labels[0]) == 0
    assert any("000004.xml: object 1 'cat' is not in the data YAML's names" in m for m in val.messages)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"path: {tmp_path / 'VOCdevkit'}\ntrain: {{voc: VOC2007}}\nval: {{voc: VOC2007, set: val}}\nnames: [a]\n"
    )
    with pytest.raises(UserError, match=r"a VOC split is \{voc: <folder or list>, set: <ImageSets/Main name>\}"):
        load_data_config(bad)


def test_voc_non_finite_or_out_of_range_numbers_are_named_label_errors(tmp_path: Path) -> None:
    yaml_file = make_voc(tmp_path)
    voc = tmp_path / "VOCdevkit" / "VOC2007"
    bad = {  # image id: (width, height, corners): each a label error naming its tag
        "000001": ("nan", 50, (1, 1, 100, 50)),
        "000002": ("inf", 50, (1, 1, 100, 50)),
        "000003": (100, "1e400", (1, 1, 100, 50)),
        "000004": (10**12, 50, (1, 1, 100, 50)),
        "000006": (100, 50, ("nan", 1, 100, 50)),
        "000007": (100, 50, (1, "-inf", 100, 50)),
        "000009": (0, 0, (1, 1, 100, 50)),  # VOC's 0: unknown, the image's own size is used
    }
    for i, (w, h, box) in bad.items():
        cv2.imwrite(str(voc / "JPEGImages" / f"{i}.jpg"), np.full((50, 100, 3), 120, np.uint8))
        (voc / "Annotations" / f"{i}.xml").write_text(_xml(f"{i}.jpg", w, h, [("dog", 0, box)]))
    (voc / "ImageSets" / "Main" / "train.txt").write_text("".join(f"{i}\n" for i in [*bad, "000009"]))
    table = load_labels(load_data_config(yaml_file)["train"], verbose=False)
    assert np.isfinite(np.asarray(table.labels.rows)).all()
    assert table.counts["corrupt"] == table.counts["label_files_unusable"] == 6  # label errors, not bad images
    assert len(table.usable()) == 1 and len(table.usable().labels[0]) == 1
    for i, what in zip(bad, ("<width> 'nan'", "<width> 'inf'", "<height> '1e400'", "<width> 1e+12", "'nan'", "'-inf'")):
        assert any(m.startswith(str(voc / "Annotations" / f"{i}.xml")) and what in m for m in table.messages), i


def test_voc_ids_that_leave_the_folder_are_never_opened_and_are_named(tmp_path: Path) -> None:
    """ImageSets lines become paths: an absolute id or one climbing out with ``..`` is refused, named and counted
    (check_data.py's label errors), and a ``set`` that is not a file name is one line."""
    yaml_file = make_voc(tmp_path)
    voc = tmp_path / "VOCdevkit" / "VOC2007"
    outside = tmp_path / "outside"
    outside.mkdir()
    cv2.imwrite(str(outside / "secret.jpg"), np.full((50, 100, 3), 120, np.uint8))
    (outside / "secret.xml").write_text(_xml("secret.jpg", 100, 50, [("dog", 0, (1, 1, 50, 40))]))
    (voc / "ImageSets" / "Main" / "train.txt").write_text(
        f"000002\n../../../outside/secret\n{outside}/secret\n./000001\n"
    )
    train = load_labels(load_data_config(yaml_file)["train"], verbose=False)
    assert [Path(f).stem for f in train.im_files] == ["000001", "000002"]
    assert train.counts["ids_outside_dataset"] == 2
    assert "train.txt: line 2: id '../../../outside/secret' names a file outside" in train.messages[0]
    assert f"train.txt: line 3: id {str(outside / 'secret')[:80]!r} names a file outside" in train.messages[1]
    from utils.data.health import LABEL_ERROR_KEYS

    assert "ids_outside_dataset" in LABEL_ERROR_KEYS
    bad_set = tmp_path / "bad_set.yaml"
    bad_set.write_text(f"path: {tmp_path / 'VOCdevkit'}\ntrain: {{voc: VOC2007, set: ../../../x}}\nval: x\n")
    with pytest.raises(UserError, match=r"VOC set '\.\./\.\./\.\./x' is not a file name in ImageSets/Main"):
        load_data_config(bad_set)
