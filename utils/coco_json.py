"""COCO JSON files: ground truth from YOLO labels, detections as COCO results, and running COCOeval.

Conventions: image ids are given by the caller (val.py uses the image's index in the dataset),
category id = class index, annotation ids start at 1 (COCOeval treats id 0 as "no match"), boxes are
[x_min, y_min, width, height] in pixels of the original image, area = width * height, iscrowd = 0.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from collections.abc import Iterable, Sequence

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


def write_json(obj: object, path: str | Path) -> Path:
    """Write JSON atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return path


def ground_truth_dict(
    labels: Sequence[np.ndarray],
    shapes: Sequence[tuple[int, int]],
    image_ids: Sequence[int],
    file_names: Sequence[str],
    names: Sequence[str],
) -> dict:
    """COCO ground truth from YOLO labels: one (n, 5) [cls, x, y, w, h] normalised array per image.

    ``shapes`` are the original (height, width) of each image.
    """
    images, annotations = [], []
    for lab, (h, w), image_id, file_name in zip(labels, shapes, image_ids, file_names):
        images.append({"id": int(image_id), "width": int(w), "height": int(h), "file_name": Path(file_name).name})
        lab = np.asarray(lab, dtype=np.float64).reshape(-1, 5)
        xyxy = xywhn2xyxy(lab[:, 1:5], w, h)
        for cls, (x1, y1, x2, y2) in zip(lab[:, 0], xyxy):
            bw, bh = x2 - x1, y2 - y1
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": int(image_id),
                    "category_id": int(cls),
                    "bbox": [float(x1), float(y1), float(bw), float(bh)],
                    "area": float(bw * bh),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": i, "name": str(n)} for i, n in enumerate(names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def detections_to_results(detections: np.ndarray, image_id: int, class_map: Sequence[int] | None = None) -> list[dict]:
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
                "image_id": int(image_id),
                "category_id": category,
                "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)],
                "score": round(conf, 5),
            }
        )
    return results


def coco_eval(
    gt_json: str | Path,
    results: str | Path | list[dict],
    image_ids: Iterable[int] | None = None,
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
            evaluator.params.imgIds = sorted(int(i) for i in image_ids)
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
