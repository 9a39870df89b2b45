"""Our mAP against pycocotools' COCOeval on the same generated ground truth and detections.

COCOeval keeps at most maxDets[-1] detections per image and class; these tests pass maxDets=[1, 10, 1000]
so that nothing is dropped, and read AP from COCOeval's precision array (area "all", last maxDets).
"""

from __future__ import annotations

import numpy as np
import pytest

from utils.coco_json import coco_eval, coco_map, write_json
from utils.metrics import ap_per_class, match_detections, mean_metrics

TOLERANCE = 0.001


def random_boxes(rng: np.random.Generator, n: int, w: float, h: float, integer: bool = False) -> np.ndarray:
    """(n, 4) xyxy boxes inside a (w, h) image."""
    bw = rng.uniform(8, w / 3, n)
    bh = rng.uniform(8, h / 3, n)
    x1 = rng.uniform(0, w - bw)
    y1 = rng.uniform(0, h - bh)
    boxes = np.stack([x1, y1, x1 + bw, y1 + bh], 1)
    return np.round(boxes) if integer else boxes


def generate_case(seed: int, n_images: int = 25, nc: int = 6, integer: bool = False) -> list[dict]:
    """Images with gt (cls, xyxy) and detections (xyxy, score, cls).

    Class nc-1 never has ground truth (its detections must be ignored), class nc-2 is never predicted
    (AP 0), some images have no ground truth, scores are coarse so ties are common, and most objects get
    near-duplicate detections.
    """
    rng = np.random.default_rng(seed)
    images = []
    for i in range(n_images):
        w, h = float(rng.integers(200, 700)), float(rng.integers(200, 700))
        n_gt = 0 if i % 5 == 0 else int(rng.integers(1, 12))
        gt_boxes = random_boxes(rng, n_gt, w, h, integer)
        gt_cls = rng.integers(0, nc - 1, n_gt)  # never class nc-1
        det_boxes, det_cls = [], []
        for box, c in zip(gt_boxes, gt_cls):
            for _ in range(int(rng.integers(0, 4))):
                size = np.array([box[2] - box[0], box[3] - box[1]] * 2)
                jitter = rng.normal(0, 0.08, 4) * size
                det_boxes.append(box + (np.round(jitter) if integer else jitter))
                det_cls.append(c if rng.random() < 0.85 else rng.integers(0, nc))
        n_fp = int(rng.integers(0, 8))
        det_boxes.extend(random_boxes(rng, n_fp, w, h, integer))
        det_cls.extend(rng.integers(0, nc, n_fp))
        det_boxes = np.array(det_boxes, dtype=np.float64).reshape(-1, 4)
        det_boxes[:, 2:] = np.maximum(det_boxes[:, 2:], det_boxes[:, :2] + 1)  # keep w, h > 0
        det_cls = np.array(det_cls, dtype=int)
        det_cls[det_cls == nc - 2] = nc - 1  # class nc-2 is never predicted
        scores = np.round(rng.uniform(0.01, 1.0, len(det_cls)), 2)  # coarse: many ties
        images.append(
            {
                "w": w,
                "h": h,
                "gt_boxes": gt_boxes,
                "gt_cls": gt_cls,
                "det_boxes": det_boxes,
                "scores": scores,
                "det_cls": det_cls,
            }
        )
    return images


def ours(images: list[dict]) -> tuple[float, float]:
    correct, conf, pred_cls, target_cls = [], [], [], []
    for im in images:
        correct.append(match_detections(im["det_boxes"], im["scores"], im["det_cls"], im["gt_boxes"], im["gt_cls"]))
        conf.append(im["scores"])
        pred_cls.append(im["det_cls"])
        target_cls.append(im["gt_cls"])
    metrics = ap_per_class(
        np.concatenate(correct), np.concatenate(conf), np.concatenate(pred_cls), np.concatenate(target_cls)
    )
    _, _, map50, map50_95 = mean_metrics(metrics)
    return map50, map50_95


def reference(images: list[dict], nc: int, tmp_path, max_dets: int = 1000) -> tuple[float, float]:
    gt = {"images": [], "annotations": [], "categories": [{"id": c, "name": str(c)} for c in range(nc)]}
    results = []
    for image_id, im in enumerate(images):
        gt["images"].append({"id": image_id, "width": im["w"], "height": im["h"]})
        for box, c in zip(im["gt_boxes"], im["gt_cls"]):
            bw, bh = box[2] - box[0], box[3] - box[1]
            gt["annotations"].append(
                {
                    "id": len(gt["annotations"]) + 1,
                    "image_id": image_id,
                    "category_id": int(c),
                    "bbox": [box[0], box[1], bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                }
            )
        for box, s, c in zip(im["det_boxes"], im["scores"], im["det_cls"]):
            results.append(
                {
                    "image_id": image_id,
                    "category_id": int(c),
                    "score": float(s),
                    "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]],
                }
            )
    gt_path = write_json(gt, tmp_path / "gt.json")
    _, evaluation = coco_eval(gt_path, results, image_ids=range(len(images)), max_dets=(1, 10, max_dets))
    return coco_map(evaluation)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_detections_agree_with_cocoeval(seed, tmp_path):
    images = generate_case(seed)
    mine = ours(images)
    ref = reference(images, 6, tmp_path)
    assert 0.05 < ref[1] < 0.95  # a meaningful, non-degenerate case
    assert abs(mine[0] - ref[0]) <= TOLERANCE, (mine, ref)
    assert abs(mine[1] - ref[1]) <= TOLERANCE, (mine, ref)


@pytest.mark.parametrize("seed", [10, 11])
def test_integer_boxes_with_exact_iou_ties_agree(seed, tmp_path):
    """Integer coordinates make exactly equal IoUs (and IoU exactly at a threshold) frequent."""
    images = generate_case(seed, integer=True)
    mine, ref = ours(images), reference(images, 6, tmp_path)
    assert abs(mine[0] - ref[0]) <= TOLERANCE and abs(mine[1] - ref[1]) <= TOLERANCE, (mine, ref)


def test_hand_made_ties_match_cocoeval_exactly(tmp_path):
    """One detection equally overlapping two boxes, tied scores, a box at IoU exactly 0.5."""
    gt_boxes = np.array([[0, 0, 10, 10], [2, 0, 12, 10], [40, 40, 60, 60]], dtype=float)
    det_boxes = np.array(
        [
            [1, 0, 11, 10],  # IoU 9/11 with both of the first two boxes: COCOeval takes the later one
            [0, 0, 10, 10],  # then this one still finds box 0 at every threshold
            [2, 0, 12, 10],  # same score as the previous one: file order decides
            [40, 40, 60, 50],  # IoU exactly 0.5 with box 2
            [1, 0, 11, 10],
        ],
        dtype=float,
    )
    images = [
        {
            "w": 100.0,
            "h": 100.0,
            "gt_boxes": gt_boxes,
            "gt_cls": np.array([0, 0, 1]),
            "det_boxes": det_boxes,
            "scores": np.array([0.9, 0.8, 0.8, 0.7, 0.8]),
            "det_cls": np.array([0, 0, 0, 1, 0]),
        }
    ]
    mine, ref = ours(images), reference(images, 2, tmp_path)
    assert mine == pytest.approx(ref, abs=1e-12)


def test_default_max_dets_when_at_most_100_per_image(tmp_path):
    """With <= 100 detections per image and class, COCOeval's default maxDets=100 gives the same figures."""
    images = generate_case(4)
    assert max(len(im["scores"]) for im in images) <= 100
    mine, ref = ours(images), reference(images, 6, tmp_path, max_dets=100)
    assert abs(mine[0] - ref[0]) <= TOLERANCE and abs(mine[1] - ref[1]) <= TOLERANCE


def test_perfect_detections_score_one():
    images = generate_case(5)
    for im in images:
        im["det_boxes"], im["det_cls"] = im["gt_boxes"].copy(), im["gt_cls"].copy()
        im["scores"] = np.full(len(im["gt_cls"]), 0.9)
    assert ours(images) == pytest.approx((1.0, 1.0))


def test_no_detections_score_zero():
    images = generate_case(6)
    for im in images:
        im["det_boxes"], im["det_cls"], im["scores"] = np.zeros((0, 4)), np.zeros(0, int), np.zeros(0)
    assert ours(images) == (0.0, 0.0)


def test_yolo_labels_to_coco_ground_truth_and_results(tmp_path):
    """Ground truth written from YOLO labels, and detections equal to it, give AP 1 in COCOeval."""
    from utils.coco_json import detections_to_results, ground_truth_dict

    labels = [
        np.array([[0, 0.5, 0.5, 0.2, 0.4], [1, 0.25, 0.25, 0.1, 0.1]]),
        np.zeros((0, 5)),
        np.array([[1, 0.6, 0.3, 0.3, 0.2]]),
    ]
    shapes = [(100, 200), (50, 50), (300, 150)]  # (h, w)
    gt = ground_truth_dict(labels, shapes, [0, 1, 2], ["a.jpg", "dir/b.jpg", "c.jpg"], ["cat", "dog"])
    assert [im["width"] for im in gt["images"]] == [200, 50, 150] and gt["images"][1]["file_name"] == "b.jpg"
    assert [a["id"] for a in gt["annotations"]] == [1, 2, 3]  # COCOeval reads id 0 as "unmatched"
    assert gt["annotations"][0]["bbox"] == pytest.approx([80, 30, 40, 40])
    assert gt["annotations"][0]["area"] == pytest.approx(1600)
    assert gt["categories"] == [{"id": 0, "name": "cat"}, {"id": 1, "name": "dog"}]

    results = []
    for image_id in range(len(gt["images"])):
        rows = [a["bbox"] + [0.9, a["category_id"]] for a in gt["annotations"] if a["image_id"] == image_id]
        det = np.array([[x, y, x + w, y + h, s, c] for x, y, w, h, s, c in rows]).reshape(-1, 6)
        results += detections_to_results(det, image_id)
    assert results[0] == {"image_id": 0, "category_id": 0, "bbox": [80.0, 30.0, 40.0, 40.0], "score": 0.9}
    stats, evaluation = coco_eval(write_json(gt, tmp_path / "gt.json"), results)
    assert stats[0] == pytest.approx(1.0) and coco_map(evaluation) == pytest.approx((1.0, 1.0))


def test_malformed_ground_truth_or_results_are_one_line_naming_the_file(tmp_path) -> None:
    """A ground truth val.py scores against (the data YAML's ``annotations``) or a results file that COCOeval would
    misread or crash on: one UserError line naming the file and the problem, before pycocotools sees it."""
    import json

    from utils.errors import UserError

    ann = {"id": 1, "image_id": 1, "category_id": 0, "bbox": [2, 2, 10, 8], "area": 80, "iscrowd": 0}
    base = {"images": [{"id": 1, "width": 32, "height": 24}], "annotations": [ann], "categories": [{"id": 0}]}
    detection = {"image_id": 1, "category_id": 0, "bbox": [2, 2, 10, 8], "score": 0.9}
    assert coco_eval(write_json(base, tmp_path / "ok.json"), [detection])[0][0] == pytest.approx(1.0)
    broken = {
        "nan_area": (
            '{"images": [{"id": 1}], "annotations": [{"id": 1, "image_id": 1, "category_id": 0, '
            '"bbox": [2, 2, 10, 8], "area": NaN, "iscrowd": 0}], "categories": [{"id": 0}]}',
            "NaN is not a JSON number",
        ),
        "crowd_text": ({**base, "annotations": [{**ann, "iscrowd": "0"}]}, "iscrowd '0' is not 0 or 1"),
        "no_ann_id": (
            {**base, "annotations": [{**ann, "id": {}}]},
            r"annotation #0: id \{\} is not a non-zero integer",
        ),
        "bool_image": ({**base, "annotations": [{**ann, "image_id": True}]}, "image_id True .* is not an id"),
        "huge_box": ({**base, "annotations": [{**ann, "bbox": [0, 0, 10**400, 1]}]}, "bbox .* is not 4 finite numbers"),
        "list_id": ({**base, "images": [{"id": [1]}]}, r"image entry \{'id': \[1\]\} needs an integer 'id'"),
        "big_id": ({**base, "images": [{"id": 2**63}]}, "needs an integer 'id'"),
        "categories": ({**base, "categories": 1.5}, "no 'categories' list"),
        "deep": ("[" * 100000 + "]" * 100000, "nested too deep"),
        "not_utf8": (b"\xff\xfe{}", "cannot read COCO ground truth"),
    }
    for name, (content, why) in broken.items():
        path = tmp_path / f"{name}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(UserError, match=why) as e:
            coco_eval(path, [detection])
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value), name
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{**detection, "score": "high"}]))
    with pytest.raises(UserError, match=f"{results}: .*detection #0: score 'high' is not a finite number"):
        coco_eval(tmp_path / "ok.json", results)
    with pytest.raises(UserError, match=f"{tmp_path / 'ok.json'}: holds no image of id 7"):
        coco_eval(tmp_path / "ok.json", [{**detection, "image_id": 7}])
