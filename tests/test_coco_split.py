"""A COCO JSON as a split: lookup of its images, boxes, crowds, classes, bad items, the cache, ids in --save-json,
and the same training as the YOLO-label form of the same set."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import write_rectangles_dataset

from utils.data.config import load_data_config
from utils.data.labels import load_labels, read_table
from utils.data.splits import CocoSplit
from utils.errors import UserError

NAMES = ["red", "blue"]


def coco_from_yolo(root: Path, split: str, out: Path, category_ids=(1, 2), extra_categories=()) -> dict:
    """A COCO JSON of a YOLO-label split (pixel boxes of the same rows), written to ``out``; returns it."""
    images, annotations = [], []
    for k, im in enumerate(sorted((root / "images" / split).iterdir())):
        h, w = cv2.imread(str(im)).shape[:2]
        image_id = 100 + 3 * k  # ids unrelated to the file names
        images.append({"id": image_id, "file_name": im.name, "width": w, "height": h})
        rows = np.loadtxt(root / "labels" / split / f"{im.stem}.txt", ndmin=2)
        for cls, x, y, bw, bh in rows:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category_ids[int(cls)],
                    "iscrowd": 0,
                    "area": bw * w * bh * h,
                    "bbox": [(x - bw / 2) * w, (y - bh / 2) * h, bw * w, bh * h],
                }
            )
    categories = [{"id": c, "name": n} for c, n in zip(category_ids, NAMES)] + list(extra_categories)
    data = {"images": images, "annotations": annotations, "categories": categories}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return data


@pytest.fixture()
def coco_root(tmp_path: Path) -> Path:
    write_rectangles_dataset(tmp_path, n_train=8, n_val=4)
    coco_from_yolo(tmp_path, "train", tmp_path / "annotations" / "instances_train.json")
    coco_from_yolo(tmp_path, "val", tmp_path / "annotations" / "instances_val.json")
    return tmp_path


def _split(root: Path, data: dict, name: str = "instances_x.json", **kw) -> CocoSplit:
    path = root / "annotations" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return CocoSplit(str(path), **kw)


def test_coco_split_gives_the_labels_of_the_yolo_form(coco_root: Path) -> None:
    (coco_root / "coco.yaml").write_text(
        f"path: {coco_root}\ntrain: annotations/instances_train.json\n"
        "val: {annotations: annotations/instances_val.json, images: images/val}\n"
    )
    cfg = load_data_config(coco_root / "coco.yaml")
    assert cfg["names"] == NAMES and cfg["annotations"] == str(coco_root / "annotations" / "instances_val.json")
    coco = load_labels(cfg["train"], verbose=False)
    yolo = load_labels(str(coco_root / "images" / "train"), nc=2, verbose=False)
    assert list(coco.im_files) == list(yolo.im_files)  # found in images/train (images/<stem> of the JSON)
    for a, b in zip(coco.labels, yolo.labels):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert list(coco.extra["image_id"]) == [100 + 3 * k for k in range(8)]
    assert list(coco.meta["category_ids"]) == [1, 2]


@pytest.fixture()
def log_lines():
    """The text LOGGER writes while the test runs (it does not propagate to pytest's caplog)."""
    import logging

    from utils.log import LOGGER

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    handler = Lines()
    LOGGER.addHandler(handler)
    level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    yield handler.lines
    LOGGER.setLevel(level)
    LOGGER.removeHandler(handler)


def test_coco_forms_boxes_crowds_backgrounds_and_bad_items(tmp_path: Path, log_lines) -> None:
    images = tmp_path / "train2017"
    (images / "sub").mkdir(parents=True)
    for name in ("a.jpg", "b.jpg", "sub/c.jpg", "d.jpg"):
        cv2.imwrite(str(images / name), np.full((50, 100, 3), 128, np.uint8))
    data = {
        "images": [
            {"id": 1, "file_name": "a.jpg", "width": 100, "height": 50},
            {"id": 2, "file_name": "b.jpg", "width": 100, "height": 50},
            {"id": 3, "file_name": "sub/c.jpg", "width": 100, "height": 50},  # a subfolder in file_name
            {"id": 4, "file_name": "d.jpg", "width": 100, "height": 50},  # background: no annotation
            {"id": 5, "file_name": "gone.jpg", "width": 100, "height": 50},
            {"id": 6, "file_name": "x" * 300, "width": 100, "height": 50},  # longer than a file name may be
        ],  # listed but missing
        "categories": [{"id": 0, "name": "objects"}, {"id": 7, "name": "cat"}, {"id": 3, "name": "dog"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 7, "bbox": [10, 10, 20, 10], "iscrowd": 0},
            {"id": 11, "image_id": 1, "category_id": 3, "bbox": [-1, 0, 20, 51], "iscrowd": 0},  # clipped
            {"id": 12, "image_id": 1, "category_id": 3, "bbox": [0, 0, 100, 50], "iscrowd": 1},  # crowd
            {"id": 13, "image_id": 2, "category_id": 7, "bbox": [150, 10, 20, 10]},  # far outside
            {"id": 14, "image_id": 2, "category_id": 7, "bbox": [10, 10, 0, 10]},  # no area
            {"id": 15, "image_id": 99, "category_id": 7, "bbox": [10, 10, 5, 5]},  # unknown image
            {"id": 16, "image_id": 3, "category_id": 42, "bbox": [10, 10, 5, 5]},  # unknown category
            {"id": 17, "image_id": 3, "category_id": 3, "bbox": [50, 25, 50, 25]},
        ],
    }
    split = _split(tmp_path, data, "instances_train2017.json")
    table = load_labels(split, prefix="train: ")
    c = table.counts
    assert (
        c["crowd_annotations_left_out"],
        c["clipped_boxes"],
        c["bad_boxes"],
        c["unknown_image_annotations"],
        c["unknown_category_annotations"],
        c["missing_images"],
        c["unused_categories"],
    ) == (1, 1, 2, 1, 1, 2, 1)
    assert (c["labelled"], c["background"], c["empty"], c["corrupt"]) == (2, 1, 1, 2)
    files = [os.path.relpath(f, images) for f in table.im_files]
    assert files == ["a.jpg", "b.jpg", "d.jpg", "sub/c.jpg"]  # ordered by path, gone.jpg skipped
    # classes by category id: objects (0), dog (3), cat (7)
    np.testing.assert_allclose(table.labels[0], [[2, 0.2, 0.3, 0.2, 0.2], [1, 0.095, 0.5, 0.19, 1.0]], atol=1e-6)
    assert len(table.labels[1]) == 0 and table.status[1] == 2  # annotated, but nothing usable: empty
    np.testing.assert_allclose(table.labels[3], [[1, 0.75, 0.75, 0.5, 0.5]], atol=1e-6)
    log = "\n".join(log_lines)
    for item in ("annotation 13", "annotation 14", "annotation 15", "annotation 16", "image 5 'gone.jpg'"):
        assert item in log and str(split.annotations) in log, item
    assert "categories without annotations: 0 'objects'" in log
    assert str(tmp_path / "annotations" / "gone.jpg") in log and str(images / "gone.jpg") in log  # places tried


def test_coco_classes_by_yaml_names_and_unknown_category_error(coco_root: Path) -> None:
    (coco_root / "by_name.yaml").write_text(
        f"path: {coco_root}\ntrain: annotations/instances_train.json\n"
        "val: annotations/instances_val.json\nnames: [blue, red, green]\n"
    )
    cfg = load_data_config(coco_root / "by_name.yaml")
    named = load_labels(cfg["train"], verbose=False)
    by_id = load_labels(CocoSplit(cfg["train"].annotations), verbose=False)
    for a, b in zip(named.labels, by_id.labels):
        np.testing.assert_array_equal(a[:, 0], 1 - b[:, 0])  # red is class 1 now, blue class 0
    assert list(named.meta["category_ids"]) == [2, 1, -1]
    (coco_root / "short.yaml").write_text(
        f"path: {coco_root}\ntrain: annotations/instances_train.json\n"
        "val: annotations/instances_val.json\nnames: [red]\n"
    )
    with pytest.raises(UserError, match=r"instances_train.json: category 2 'blue' is not in the data YAML's names"):
        load_labels(load_data_config(coco_root / "short.yaml")["train"], verbose=False)


def test_not_coco_json_and_no_image_folder_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "annotations" / "labels.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"info": {}, "images": []}))
    with pytest.raises(UserError, match=r"labels.json: not a COCO JSON file \(no 'annotations' list\)"):
        load_labels(CocoSplit(str(bad)), verbose=False)
    bad.write_text("{not json")
    with pytest.raises(UserError, match="labels.json: cannot read COCO JSON"):
        load_labels(CocoSplit(str(bad)), verbose=False)
    split = _split(
        tmp_path,
        {"images": [{"id": 1, "file_name": "x.jpg"}], "annotations": [], "categories": [{"id": 1, "name": "a"}]},
        "instances_val.json",
    )
    with pytest.raises(UserError) as e:
        load_labels(split, verbose=False)
    message = str(e.value)
    assert "\n" not in message and "'x.jpg' not found in any of" in message
    assert all(str(p) in message for p in (tmp_path / "annotations", tmp_path / "val", tmp_path / "images" / "val"))


def test_roboflow_layout_and_cache_rebuilt_when_the_json_changes(tmp_path: Path) -> None:
    folder = tmp_path / "train"
    folder.mkdir()
    cv2.imwrite(str(folder / "a.jpg"), np.full((40, 40, 3), 90, np.uint8))
    data = {
        "images": [{"id": 0, "file_name": "a.jpg", "width": 40, "height": 40}],
        "annotations": [{"id": 1, "image_id": 0, "category_id": 1, "bbox": [0, 0, 20, 20]}],
        "categories": [{"id": 0, "name": "things"}, {"id": 1, "name": "a"}],
    }
    path = folder / "_annotations.coco.json"  # Roboflow: the JSON beside its images
    path.write_text(json.dumps(data))
    first, reused = read_table(CocoSplit(str(path)), verbose=False)
    assert not reused and Path(first.cache_file).is_file() and first.labels[0][0, 0] == 1
    assert read_table(CocoSplit(str(path)), verbose=False)[1]  # unchanged: from the cache
    data["annotations"][0]["bbox"] = [0, 0, 40, 40]
    path.write_text(json.dumps(data))
    os.utime(path, ns=(1, 1))
    again, reused = read_table(CocoSplit(str(path)), verbose=False)
    assert not reused and again.labels[0][0, 3] == pytest.approx(1.0)
    Path(again.cache_file).write_bytes(b"damaged")
    assert not read_table(CocoSplit(str(path)), verbose=False)[1]


def _results(run: Path) -> np.ndarray:
    """results.csv's values but the time split's (measurements, not results)."""
    with open(run / "results.csv") as f:
        header, *rows = list(csv.reader(f))
    kept = [i for i, name in enumerate(header) if not name.strip().startswith("time/")]
    return np.array([[float(r[i]) for i in kept] for r in rows])


@pytest.mark.slow
def test_coco_json_and_yolo_labels_train_identically(coco_root: Path, train_here) -> None:
    (coco_root / "coco.yaml").write_text(
        f"path: {coco_root}\ntrain: annotations/instances_train.json\nval: annotations/instances_val.json\n"
    )
    common = ["--epochs", "1", "--deterministic", "--seed", "3", "--exist-ok", "--name", "r"]
    assert train_here("--data", coco_root / "rectangles.yaml", "--project", coco_root / "yolo", *common)[0] == 0
    assert train_here("--data", coco_root / "coco.yaml", "--project", coco_root / "coco", *common)[0] == 0
    yolo, coco = _results(coco_root / "yolo" / "r"), _results(coco_root / "coco" / "r")
    assert yolo.shape == coco.shape and yolo.shape[0] == 1
    np.testing.assert_allclose(coco, yolo, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_save_json_scores_against_the_val_json_with_its_ids(coco_root: Path, tmp_path: Path, capsys) -> None:
    import pycocotools  # noqa: F401  (a test requirement: missing, the test fails rather than skips)
    from test_val import ColourOracle

    from utils.log import setup_logging

    setup_logging()  # the result lines go to stdout, as in val.py

    from models.families import YOLOV5
    from utils.data.loader import create_dataloader
    from utils.validation import OutputOptions, validate

    cfg = load_data_config(_yaml(coco_root))
    labels = load_labels(cfg["val"], verbose=False)
    loader, _ = create_dataloader(None, 128, 4, 32, rect=True, pad=0.5, workers=0, label_set=labels)
    r = validate(
        ColourOracle(),
        loader,
        names=cfg["names"],
        device="cpu",
        family=YOLOV5,
        outputs=OutputOptions(save_dir=tmp_path / "run", save_json=True, annotations_json=cfg["annotations"]),
    )
    predictions = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert predictions and {p["image_id"] for p in predictions} <= {100, 103, 106, 109}
    assert {p["category_id"] for p in predictions} <= {1, 2}
    printed = capsys.readouterr().out
    assert "(pycocotools, instances_val.json)" in printed
    assert float(printed.split("| ")[1].split()[0]) == pytest.approx(r.coco_stats[0], abs=1e-4)


def _yaml(root: Path) -> Path:
    path = root / "coco.yaml"
    path.write_text(f"path: {root}\ntrain: annotations/instances_train.json\nval: annotations/instances_val.json\n")
    return path


def test_shards_converts_a_coco_split(coco_root: Path) -> None:
    import webdataset  # noqa: F401  (a requirement: missing, the test fails rather than skips)

    from shards import main

    assert main(["--data", str(_yaml(coco_root)), "--out", str(coco_root / "sh"), "--workers", "1"]) == 0
    shard_cfg = load_data_config(coco_root / "sh" / "data.yaml")
    assert shard_cfg["names"] == NAMES
    coco = load_labels(load_data_config(_yaml(coco_root))["train"], verbose=False)
    shards = load_labels(shard_cfg["train"], nc=2, verbose=False)
    assert len(shards) == len(coco) == 8
    np.testing.assert_array_equal(shards.labels.rows, coco.labels.rows)  # every float32 digit kept


def test_coco_non_finite_out_of_range_and_mistyped_numbers_are_named_label_errors(tmp_path: Path, capsys) -> None:
    images = tmp_path / "train"
    images.mkdir()
    for name in "abcde":
        cv2.imwrite(str(images / f"{name}.jpg"), np.full((50, 100, 3), 128, np.uint8))
    widths = {"a": float("nan"), "b": float("inf"), "c": "BIG", "d": 10**12, "e": 100}  # BIG: written as 1e400
    box = [10, 10, 20, 10]
    data = {
        "images": [
            {"id": k, "file_name": f"{n}.jpg", "width": w, "height": 50} for k, (n, w) in enumerate(widths.items())
        ],
        "categories": [{"id": 1, "name": "red"}, {"id": 2, "name": "blue"}],
        "annotations": [
            *({"id": 10 + k, "image_id": k, "category_id": 1, "bbox": box} for k in range(4)),  # bad sizes
            {"id": 20, "image_id": 4, "category_id": 1, "bbox": [float("nan"), 10, 20, 10]},
            {"id": 21, "image_id": 4, "category_id": 1, "bbox": [10, 10, float("inf"), 10]},
            {"id": 22, "image_id": 4, "category_id": 1, "bbox": [True, 10, 20, 10]},
            {"id": 23, "image_id": True, "category_id": 2, "bbox": box},  # not image 1
            {"id": 24, "image_id": 4, "category_id": 2, "bbox": box, "iscrowd": "0"},  # neither 0 nor 1
            {"id": 25, "image_id": 4, "category_id": True, "bbox": box},  # not category 1
            {"id": 26, "image_id": 4, "category_id": 2, "bbox": [50, 20, 30, 20], "iscrowd": 0},  # the good one
        ],
    }
    path = tmp_path / "annotations" / "instances_train.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data).replace('"BIG"', "1e400"))
    table = load_labels(CocoSplit(str(path)), verbose=False)
    assert np.isfinite(np.asarray(table.labels.rows)).all()
    assert table.counts["bad_boxes"] == 7 and table.counts["bad_annotations"] == 3
    assert table.counts.get("crowd_annotations_left_out", 0) == 0
    assert [len(r) for r in table.labels] == [0, 0, 0, 0, 1] and table.labels[4][0, 0] == 1
    for k in (10, 11, 12, 13, 20, 21, 22, 23, 24, 25):
        assert any(m.startswith(f"{path}: ") and f"annotation {k}" in m for m in table.messages), k
    assert any("iscrowd '0' is not 0 or 1" in m for m in table.messages)
    assert any("image 0 width/height nanx50 is not a finite size" in m for m in table.messages)

    # check_data.py counts them as label errors
    import check_data

    yaml_file = tmp_path / "data.yaml"
    yaml_file.write_text(f"path: {tmp_path}\ntrain: {path}\nval: {path}\n")
    assert check_data.main(["--data", str(yaml_file), "--noplots", "--strict", "--workers", "0"]) == 1
    assert "10 label errors" in capsys.readouterr().out


BASE_COCO = {
    "images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 50}],
    "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 10]}],
    "categories": [{"id": 1, "name": "red"}],
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"categories": [{"id": 1, "name": "red"}, {"id": 1, "name": "blue"}]}, "category id 1 is listed twice"),
        ({"categories": 1.5}, "'categories' is '1.5', not a list"),
        ({"categories": [{"id": True, "name": "red"}]}, "needs an integer 'id'"),
        ({"images": [{"id": [1], "file_name": "a.jpg"}]}, r"image id \[1\] is not an integer"),
        ({"images": [{"id": 2**63, "file_name": "a.jpg"}]}, "image id 9223372036854775808 is not an integer"),
        ({"images": [{"id": True, "file_name": "a.jpg"}]}, "image id True is not an integer"),
        ({"images": [{"id": 1, "file_name": "a.jpg"}] * 2}, "image id 1 is listed twice"),
        # strings holding a line break (the fuzzer's): quoted with their escapes, so the error stays one line
        ({"images": [{"id": "\n7", "file_name": "a.jpg"}]}, r"image id '\\n7' is not an integer"),
        ({"categories": ["x\u2028y"]}, r"category 'x\\u2028y' needs an integer 'id'"),
        ("deep", r"cannot read COCO JSON \(nested too deep\)"),
        ("digits", "cannot read COCO JSON"),
    ],
)
def test_coco_json_shapes_no_reader_expects_are_one_line_errors(tmp_path: Path, change, message) -> None:
    cv2.imwrite(str(tmp_path / "a.jpg"), np.full((50, 100, 3), 128, np.uint8))
    path = tmp_path / "labels.json"
    if change == "deep":
        path.write_text('{"images": ' + "[" * 100_000 + "]" * 100_000 + ', "annotations": []}')
    elif change == "digits":
        path.write_text(json.dumps(BASE_COCO).replace('"width": 100', '"width": ' + "7" * 5000))
    else:
        path.write_text(json.dumps({**BASE_COCO, **change}))
    with pytest.raises(UserError, match=message) as e:
        load_labels(CocoSplit(str(path)), verbose=False)
    assert str(e.value).startswith(str(path)) and len(str(e.value).splitlines()) == 1
