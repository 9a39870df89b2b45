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
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from utils.boxes import xywhn2xyxy
from utils.errors import UserError, first_line
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


ID_RANGE = (-(2**63), 2**63 - 1)  # the int64 range pycocotools' arrays hold ids in


def _shown(value: Any, n: int) -> str:
    """A value as a message quotes it: its repr, cut to ``n`` characters (no line break gets through)."""
    return repr(value)[:n]


def _is_id(value: Any, text_too: bool = False) -> bool:
    """An integer id in the int64 range (a boolean is not: ``true`` is not image 1); with ``text_too`` a string
    as well (image ids taken from file stems)."""
    if text_too and isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and ID_RANGE[0] <= value <= ID_RANGE[1]


def _finite(value: Any) -> bool:
    """A JSON number that is finite as a float (not a boolean, NaN, an infinity or an integer past float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _box_problem(box: Any) -> str:
    """Why a COCO ``bbox`` is not four finite numbers with a width and height of at least 0, or ''."""
    if not isinstance(box, list) or len(box) != 4 or not all(_finite(v) for v in box):
        return f"bbox {_shown(box, 60)} is not 4 finite numbers"
    if box[2] < 0 or box[3] < 0:
        return f"bbox {_shown(box, 60)} has a negative width or height"
    return ""


def _load_json(path: Path, what: str) -> Any:
    """A JSON file as Python objects; a one-line UserError when it cannot be read (``NaN`` and ``Infinity``,
    which Python's reader takes, are refused: they are not JSON)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not a JSON number")

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, parse_constant=refuse)
    except RecursionError as e:  # nested thousands deep: no COCO file is
        raise UserError(f"{path}: cannot read {what} (nested too deep)") from e
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
        raise UserError(f"{path}: cannot read {what} ({first_line(e)})") from e


def _ground_truth_problem(data: Any) -> str:
    """What COCOeval (bbox) would trip over in a ground truth, or '': the first problem found."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            return f"no {key!r} list"
    ids = set()
    for im in data["images"]:
        if not isinstance(im, dict) or not _is_id(im.get("id"), text_too=True) or im["id"] in ids:
            return f"image entry {_shown(im, 80)} needs an integer 'id' of its own"
        ids.add(im["id"])
    for c in data["categories"]:
        if not isinstance(c, dict) or not _is_id(c.get("id")):
            return f"category {_shown(c, 80)} needs an integer 'id'"
    for k, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            return f"annotation #{k} is not an object"
        why = _annotation_problem(ann)
        if why:
            return f"annotation #{k}: {why}"
    return ""


def _annotation_problem(ann: dict) -> str:
    if not _is_id(ann.get("id")) or ann["id"] == 0:
        return f"id {_shown(ann.get('id'), 40)} is not a non-zero integer (COCOeval reads 0 as no match)"
    if not _is_id(ann.get("image_id"), text_too=True) or not _is_id(ann.get("category_id")):
        return f"image_id {_shown(ann.get('image_id'), 40)} or category_id {_shown(ann.get('category_id'), 40)} is not an id"
    crowd = ann.get("iscrowd")
    if isinstance(crowd, bool) or not isinstance(crowd, int) or crowd not in (0, 1):
        return f"iscrowd {_shown(crowd, 40)} is not 0 or 1"
    if not _finite(ann.get("area")) or ann["area"] < 0:
        return f"area {_shown(ann.get('area'), 40)} is not a finite number of at least 0"
    return _box_problem(ann.get("bbox"))


def _results_problem(results: Any) -> str:
    """What COCOeval would trip over in a list of detections, or ''."""
    if not isinstance(results, list):
        return "not a JSON list of detections"
    for k, r in enumerate(results):
        if not isinstance(r, dict):
            return f"detection #{k} is not an object"
        if not _is_id(r.get("image_id"), text_too=True) or not _is_id(r.get("category_id")):
            return f"detection #{k}: image_id or category_id is not an id"
        if not _finite(r.get("score")):
            return f"detection #{k}: score {_shown(r.get('score'), 40)} is not a finite number"
        why = _box_problem(r.get("bbox"))
        if why:
            return f"detection #{k}: {why}"
    return ""


def read_ground_truth(gt: str | Path | dict) -> dict:
    """A COCO ground truth (a file, or its parsed dict: ``gt`` names it in messages) checked for what COCOeval
    reads: integer ids (boolean and out-of-range ones are not), ``iscrowd`` 0 or 1, finite areas and boxes. A
    one-line UserError naming the file and the first problem otherwise, never pycocotools' traceback."""
    data = gt if isinstance(gt, dict) else _load_json(Path(gt), "COCO ground truth")
    why = _ground_truth_problem(data)
    if why:
        raise UserError(f"{'ground truth' if isinstance(gt, dict) else gt}: not usable as COCO ground truth ({why})")
    return data


def coco_eval(
    gt_json: str | Path,
    results: str | Path | list[dict],
    image_ids: Iterable[int | str] | None = None,
    max_dets: Sequence[int] = (1, 10, 100),
) -> tuple[np.ndarray, dict]:
    """Run pycocotools' COCOeval (bbox); return its 12 summary figures and its ``eval`` dict.

    Both files are checked first (``read_ground_truth``; the results likewise): a malformed one, or results of an
    image the ground truth does not hold, is a one-line UserError naming the file. pycocotools prints progress on
    stdout; that text goes to the log at DEBUG level instead. With ``max_dets`` other than (1, 10, 100) the
    summary figures that name maxDets=100 come out as -1; read ``eval['precision'][..., 0, -1]`` (area "all",
    last maxDets) instead.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as e:
        raise UserError(f"pycocotools: not installed, needed for COCO evaluation ({e})") from e

    data = read_ground_truth(gt_json)
    source = "results" if isinstance(results, list) else str(results)
    detections: list[dict] = results if isinstance(results, list) else _load_json(Path(results), "COCO results")
    why = _results_problem(detections)
    if why:
        raise UserError(f"{source}: not usable as COCO results ({why})")
    if not detections:
        LOGGER.warning("COCO evaluation skipped: no detections")
        return np.zeros(12), {}
    held = {im["id"] for im in data["images"]}
    absent = [r["image_id"] for r in detections if r["image_id"] not in held]
    if absent:
        raise UserError(f"{gt_json}: holds no image of id {_shown(absent[0], 60)} (that {source} has detections of)")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        gt = COCO()
        gt.dataset = data
        gt.createIndex()
        dt = gt.loadRes(detections)
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
