"""COCO identities in val.py's JSON: image ids from file names, COCO's 91 category ids, official annotations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_val import IMAGE_SIZES, ColourOracle, make_dataset

from models.families import YOLOV5
from utils.coco_json import (
    COCO80_TO_91,
    COCO_NAMES,
    category_ids,
    ground_truth_dict,
    image_ids_for,
    is_coco_classes,
    write_json,
)
from utils.data.loader import create_dataloader
from utils.validation import OutputOptions, validate


def test_image_ids_come_from_file_names() -> None:
    assert image_ids_for(["a/000000397133.jpg", "b/000000000139.png"]) == [397133, 139]
    assert image_ids_for(["a/cat.jpg", "b/dog.jpg"]) == ["cat", "dog"]
    assert image_ids_for(["a/12.jpg", "b/dog.jpg"]) == ["12", "dog"]  # one type, so COCOeval can sort them
    assert image_ids_for(["a/1.jpg", "b/1.jpg"]) == ["a/1.jpg", "b/1.jpg"]  # never two images with one id


def test_coco_names_map_to_coco_category_ids() -> None:
    ids = category_ids(list(COCO_NAMES))
    assert len(ids) == len(set(ids)) == 80 and ids[0] == 1 and ids[-1] == 90
    assert ids[COCO_NAMES.index("stop sign")] == 13 and ids[COCO_NAMES.index("toothbrush")] == 90
    assert not set(ids) & {12, 26, 29, 30, 45, 66, 68, 69, 71, 83}
    assert category_ids(["red", "green"]) == [0, 1] and not is_coco_classes(COCO_NAMES[:79])


@pytest.mark.slow
def test_predictions_json_scores_against_the_dataset_annotations(tmp_path, capsys) -> None:
    import pycocotools  # noqa: F401  (a test requirement: missing, the test fails rather than skips)

    from utils.log import setup_logging

    setup_logging()  # the result lines go to stdout, as in val.py

    yaml_file = make_dataset(tmp_path / "data")
    root = yaml_file.parent
    stems = {}
    for i in range(len(IMAGE_SIZES)):  # COCO-style names: the id is the number in the file name
        stems[i] = f"{397133 + i:012d}"
        (root / "images" / "val" / f"im{i}.png").rename(root / "images" / "val" / f"{stems[i]}.png")
        (root / "labels" / "val" / f"im{i}.txt").rename(root / "labels" / "val" / f"{stems[i]}.txt")
    # The dataset's own COCO annotations: its images and one more that val.py does not see.
    labels = [np.loadtxt(root / "labels" / "val" / f"{stems[i]}.txt", ndmin=2).reshape(-1, 5) for i in stems]
    shapes = list(IMAGE_SIZES) + [(50, 50)]
    labels.append(np.array([[0, 0.5, 0.5, 0.2, 0.2]]))
    ids = [int(s) for s in stems.values()] + [1]
    annotations = write_json(
        ground_truth_dict(labels, shapes, ids, [f"{i}.png" for i in ids], COCO_NAMES, COCO80_TO_91),
        tmp_path / "instances_val2017.json",
    )

    loader, _ = create_dataloader(str(root / "images" / "val"), 128, 4, 32, rect=True, pad=0.5, workers=0)
    r = validate(
        ColourOracle(),
        loader,
        names=list(COCO_NAMES),
        device="cpu",
        family=YOLOV5,
        outputs=OutputOptions(save_dir=tmp_path / "run", save_json=True, annotations_json=annotations),
    )
    predictions = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert {p["image_id"] for p in predictions} <= {int(s) for s in stems.values()}
    assert {p["category_id"] for p in predictions} <= {1, 2}  # person and bicycle, COCO's ids
    printed = capsys.readouterr().out
    assert "(pycocotools, instances_val2017.json)" in printed
    official = float(printed.split("| ")[1].split()[0])
    assert official == pytest.approx(r.coco_stats[0], abs=1e-4) and r.map > 0.8  # the extra image is not scored
