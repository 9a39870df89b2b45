"""COCO JSON files: ground truth from YOLO labels, detections as COCO results, and running COCOeval.

Conventions: image ids come from the file names as in YOLOv5 (the stem as an integer where it is one, else
the stem; see ``image_ids_for``), so predictions.json can be scored against any ground truth of the same
images; category id = class index, except on COCO's 80 classes, which are written as COCO's 91-id numbering
(``COCO80_TO_91``); annotation ids start at 1 (COCOeval treats id 0 as "no match"), boxes are
[x_min, y_min, width, height] in pixels of the original image, area = width * height, iscrowd = 0.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from utils.boxes import xywhn2xyxy
from utils.errors import UserError
from utils.files import atomic_output
from utils.log import LOGGER

COCO_STAT_NAMES = (
    "AP@[.50:.95] all",
    "AP@.50 all",
    "AP@.75 all",
    "AP@[.50:.95] small",
    "AP@[.50:.95] medium",
    "AP@[.50:.95] large",
    "AR@[.50:.95] maxDets=1",
    "AR@[.50:.95] maxDets=10",
    "AR@[.50:.95] maxDets=100",
    "AR@[.50:.95] small",
    "AR@[.50:.95] medium",
    "AR@[.50:.95] large",
)


# COCO's 80 detection classes in the order YOLOv5's data YAMLs list them (category ids ascending).
COCO_NAMES = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
# COCO numbers its categories 1..90 with gaps (ids its 2014 paper planned but never annotated).
_COCO_UNUSED_IDS = (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)
COCO80_TO_91 = tuple(i for i in range(1, 91) if i not in _COCO_UNUSED_IDS)


def is_coco_classes(names: Sequence[str]) -> bool:
    """True for COCO's 80 classes in COCO's order (the names YOLOv5's coco*.yaml files use)."""
    return tuple(str(n) for n in names) == COCO_NAMES


def category_ids(names: Sequence[str]) -> list[int]:
    """The category id written for each class: COCO's ids on COCO's classes, else the class index."""
    return list(COCO80_TO_91) if is_coco_classes(names) else list(range(len(names)))


def image_id_from_path(path: str | Path) -> int | str:
    """YOLOv5's image id: the file stem as an integer where it is one (COCO's 000000397133.jpg -> 397133)."""
    stem = Path(path).stem
    return int(stem) if stem.isdecimal() else stem


def image_ids_for(paths: Sequence[str | Path]) -> list[int | str]:
    """Image ids for a dataset's files, from their names; one type for all, and unique.

    When some stems are numbers and some not, all ids are the stems as text (COCOeval sorts the ids, and
    cannot sort a mix). When two files share a stem, all ids become the full paths, with a warning.
    """
    ids = [image_id_from_path(p) for p in paths]
    if any(isinstance(i, str) for i in ids):
        ids = [Path(p).stem for p in paths]
    if len(set(ids)) != len(ids):
        LOGGER.warning("WARNING image ids: several files share a file name; using full paths as image ids")
        ids = [str(p) for p in paths]
    return ids


def write_json(obj: object, path: str | Path) -> Path:
    """Write JSON atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return path


def ground_truth_dict(
    labels: Sequence[np.ndarray],
    shapes: Sequence[tuple[int, int]],
    image_ids: Sequence[int | str],
    file_names: Sequence[str],
    names: Sequence[str],
    class_map: Sequence[int] | None = None,
) -> dict:
    """COCO ground truth from YOLO labels: one (n, 5) [cls, x, y, w, h] normalised array per image.

    ``shapes`` are the original (height, width) of each image; ``class_map`` maps class index to category id
    (identity when None).
    """
    class_map = list(range(len(names))) if class_map is None else list(class_map)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for lab, (h, w), image_id, file_name in zip(labels, shapes, image_ids, file_names):
        image_id = image_id if isinstance(image_id, str) else int(image_id)
        images.append({"id": image_id, "width": int(w), "height": int(h), "file_name": Path(file_name).name})
        lab = np.asarray(lab, dtype=np.float64).reshape(-1, 5)
        xyxy = xywhn2xyxy(lab[:, 1:5], w, h)
        for cls, (x1, y1, x2, y2) in zip(lab[:, 0], xyxy):
            bw, bh = x2 - x1, y2 - y1
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": int(class_map[int(cls)]),
                    "bbox": [float(x1), float(y1), float(bw), float(bh)],
                    "area": float(bw * bh),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": int(class_map[i]), "name": str(n)} for i, n in enumerate(names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def detections_to_results(
    detections: np.ndarray, image_id: int | str, class_map: Sequence[int] | None = None
) -> list[dict]:
    """COCO results entries for one image's detections (n, 6) = [x1, y1, x2, y2, conf, cls] in original pixels.

    ``class_map`` maps class index to category id (identity when None). Rounding keeps files small; it may
    turn nearly equal scores into ties, which COCOeval then ranks by file order.
    """
    detections = np.asarray(detections, dtype=np.float64).reshape(-1, 6)
    results = []
    for x1, y1, x2, y2, conf, cls in detections:
        category = int(cls) if class_map is None else int(class_map[int(cls)])
        results.append(
            {
                "image_id": image_id if isinstance(image_id, str) else int(image_id),
                "category_id": category,
                "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)],
                "score": round(conf, 5),
            }
        )
    return results


def coco_eval(
    gt_json: str | Path,
    results: str | Path | list[dict],
    image_ids: Iterable[int | str] | None = None,
    max_dets: Sequence[int] = (1, 10, 100),
) -> tuple[np.ndarray, dict]:
    """Run pycocotools' COCOeval (bbox); return its 12 summary figures and its ``eval`` dict.

    pycocotools prints progress on stdout; that text goes to the log at DEBUG level instead. With
    ``max_dets`` other than (1, 10, 100) the summary figures that name maxDets=100 come out as -1; read
    ``eval['precision'][..., 0, -1]`` (area "all", last maxDets) instead.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as e:
        raise UserError(f"pycocotools: not installed, needed for COCO evaluation ({e})") from e

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        gt = COCO(str(gt_json))
        if isinstance(results, (str, Path)):
            results = json.loads(Path(results).read_text())
        if not results:
            LOGGER.warning("COCO evaluation skipped: no detections")
            return np.zeros(12), {}
        dt = gt.loadRes(results)
        evaluator = COCOeval(gt, dt, "bbox")
        if image_ids is not None:
            evaluator.params.imgIds = sorted(i if isinstance(i, str) else int(i) for i in image_ids)
        evaluator.params.maxDets = list(max_dets)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    LOGGER.debug(captured.getvalue())
    return np.asarray(evaluator.stats, dtype=np.float64), evaluator.eval


def coco_map(eval_result: dict) -> tuple[float, float]:
    """(mAP50, mAP50-95) from COCOeval's ``eval`` dict at area "all" and the last maxDets entry."""
    precision = eval_result["precision"][:, :, :, 0, -1]  # (T, R, K)
    valid = precision[0, 0] > -1  # classes with ground truth
    if not valid.any():
        return 0.0, 0.0
    per_class = precision[:, :, valid].mean(1)  # (T, K)
    return float(per_class[0].mean()), float(per_class.mean())


def format_coco_stats(stats: np.ndarray) -> str:
    """The 12 COCOeval figures, one per line."""
    return "\n".join(f"  {name:<24} {value:.4f}" for name, value in zip(COCO_STAT_NAMES, stats))


def json_identities(dataset: object, names: Sequence[str]) -> tuple[list[int], dict[str, int | str]]:
    """(category id of each class, image id of each file) for predictions.json.

    A split read from a COCO JSON (its LabelTable holds ``image_id`` per sample and ``category_ids`` per class)
    keeps that JSON's own ids, so the predictions score against it directly; any other split takes ids from the
    file names and COCO's 91-id numbering on COCO's classes (``image_ids_for``, ``category_ids``).
    """
    table = getattr(dataset, "table", None)
    extra, meta = getattr(table, "extra", {}), getattr(table, "meta", {})
    if table is not None and "image_id" in extra and len(meta.get("category_ids", ())) == len(names):
        return [int(c) for c in meta["category_ids"]], dict(zip(table.im_files, extra["image_id"].tolist()))
    files = list(getattr(dataset, "im_files", None) or [])
    return category_ids(names), dict(zip(files, image_ids_for(files))) if files else {}
