"""Detection metrics on numpy arrays: COCO-style matching, per-class AP, P/R at max F1, confusion matrix.

How this agrees with pycocotools' COCOeval (bbox)
-------------------------------------------------
The matching and AP follow ``COCOeval.evaluateImg`` and ``COCOeval.accumulate`` step for step:

* Per image and class, detections are taken by descending score (stable sort, so tied scores keep the
  order in which they were given). At each IoU threshold t in 0.50:0.05:0.95 a detection takes the
  still-unmatched ground-truth box of its class with the highest IoU >= t (IoU exactly t matches; among
  equal IoUs the later ground-truth box wins, as in COCOeval's loop). Each ground-truth box is matched at
  most once per threshold. IoU is computed without the "+1" pixel convention and without an epsilon.
* Per class, detections of all images are ranked by score with a stable sort over (image order,
  detection order), precision is made monotone (the envelope), and AP is the mean of the precision
  sampled at the 101 recall points ``np.linspace(0, 1, 101)`` with ``searchsorted(..., side='left')``;
  recall points beyond the last recall reached count as precision 0.
* mAP averages over classes that have at least one ground-truth box; a class with ground truth and no
  detections counts as AP 0; detections of a class without ground truth are ignored.

What differs from COCOeval's default configuration:

* COCOeval keeps at most ``maxDets[-1]`` (100 by default) detections per image *and class*; we keep all
  (``max_det`` of NMS is the only cap). The agreement tests either pass ``maxDets=[1, 10, max_det]`` to
  COCOeval and read AP from its precision array at that last index, or keep <= 100 detections per image.
* Crowd annotations: YOLO labels have no ``iscrowd``, so every box counts. COCOeval instead ignores crowd
  ground truth (it is not counted in recall) and ignores detections matched to it, which may cover many
  instances. On a dataset with crowd boxes (COCO itself has about 1%), results from YOLO labels converted
  from COCO therefore differ slightly from COCOeval run on the original annotation file.
* Area ranges: we report only COCO's "all" range (area in [0, 1e10]).

Agreement to 0.001 on mAP50 and mAP50-95 is asserted in ``tests/test_coco_agreement.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from utils.boxes import box_iou_exact

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # COCO's thresholds; linspace avoids arange drift
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
CONF_POINTS = np.linspace(0.0, 1.0, 1000)  # x-axis of the P/R/F1-vs-confidence curves


def match_detections(
    det_boxes: np.ndarray,
    det_scores: np.ndarray,
    det_classes: np.ndarray,
    gt_boxes: np.ndarray,
    gt_classes: np.ndarray,
    iou_thresholds: np.ndarray = IOU_THRESHOLDS,
) -> np.ndarray:
    """Match one image's detections to its ground truth as COCOeval does; boxes are xyxy.

    Returns a bool array (n_det, n_thresholds), in the detections' given order: True where the detection
    is a true positive at that threshold.
    """
    n_det, n_thr = len(det_scores), len(iou_thresholds)
    correct = np.zeros((n_det, n_thr), dtype=bool)
    if n_det == 0 or len(gt_classes) == 0:
        return correct
    iou = box_iou_exact(det_boxes, gt_boxes)
    iou[np.asarray(det_classes)[:, None] != np.asarray(gt_classes)[None, :]] = 0.0  # other classes never match
    # COCOeval caps the threshold just below 1 so a perfect box still matches at every threshold
    thresholds = np.minimum(np.asarray(iou_thresholds, dtype=np.float64), 1 - 1e-10)
    order = np.argsort(-np.asarray(det_scores, dtype=np.float64), kind="mergesort")
    # a detection below the lowest threshold with every box is a false positive and changes no state
    order = order[iou[order].max(1) >= thresholds.min()]
    gt_taken = np.zeros((n_thr, len(gt_classes)), dtype=bool)
    reversed_cols = np.arange(len(gt_classes))[::-1]
    for d in order:
        row = iou[d]
        eligible = (row[None, :] >= thresholds[:, None]) & ~gt_taken  # (T, G)
        if not eligible.any():
            continue
        scored = np.where(eligible, row[None, :], -1.0)[:, ::-1]  # reversed so argmax picks the last tie
        best = reversed_cols[scored.argmax(1)]
        matched = eligible.any(1)
        gt_taken[np.nonzero(matched)[0], best[matched]] = True
        correct[d] = matched
    return correct


class ClassMetrics(NamedTuple):
    """Per-class results of ``ap_per_class`` for the K classes that have ground truth."""

    classes: np.ndarray  # (K,) class indices, ascending
    n_targets: np.ndarray  # (K,) ground-truth boxes per class
    p: np.ndarray  # (K,) precision at the confidence of the best mean F1
    r: np.ndarray  # (K,) recall at that confidence
    f1: np.ndarray  # (K,)
    ap: np.ndarray  # (K, T) AP at each IoU threshold (101-point, COCO)
    conf_at_best_f1: float
    p_curve: np.ndarray  # (K, 1000) precision vs confidence CONF_POINTS at IoU 0.5
    r_curve: np.ndarray  # (K, 1000)
    f1_curve: np.ndarray  # (K, 1000)
    pr_curve: np.ndarray  # (K, 101) interpolated precision at RECALL_POINTS at IoU 0.5

    @property
    def ap50(self) -> np.ndarray:
        return self.ap[:, 0] if self.ap.size else np.zeros(0)

    @property
    def ap50_95(self) -> np.ndarray:
        return self.ap.mean(1) if self.ap.size else np.zeros(0)


def _interpolated_precision(tp: np.ndarray, fp: np.ndarray, n_gt: int) -> np.ndarray:
    """COCO's 101-point precision for cumulative tp/fp counts of one class at one threshold."""
    n = len(tp)
    if n == 0:
        return np.zeros(len(RECALL_POINTS))
    recall = tp / n_gt
    precision = tp / (tp + fp + np.spacing(1))
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, RECALL_POINTS, side="left")
    return np.where(idx < n, envelope[np.minimum(idx, n - 1)], 0.0)


def _smooth(y: np.ndarray, fraction: float = 0.05) -> np.ndarray:
    """Box-filter a curve so the chosen max-F1 confidence is not a one-point spike."""
    n = round(len(y) * fraction * 2) // 2 + 1
    padded = np.concatenate((np.full(n // 2, y[0]), y, np.full(n // 2, y[-1])))
    return np.convolve(padded, np.ones(n) / n, mode="valid")


def ap_per_class(
    correct: np.ndarray,
    conf: np.ndarray,
    pred_cls: np.ndarray,
    target_cls: np.ndarray,
) -> ClassMetrics:
    """AP per class and threshold, and P/R at the confidence that maximises the mean F1 over classes.

    ``correct`` (N, T), ``conf`` (N,), ``pred_cls`` (N,) are all detections of all images, concatenated
    in image order (each image's detections in the order given to ``match_detections``); ``target_cls``
    (M,) are the classes of all ground-truth boxes. Ties in score are ranked by that order, as in COCOeval.
    """
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim == 1:  # a single threshold
        correct = correct[:, None]
    conf = np.asarray(conf, dtype=np.float64)
    pred_cls = np.asarray(pred_cls)
    target_cls = np.asarray(target_cls)
    order = np.argsort(-conf, kind="mergesort")
    correct, conf, pred_cls = correct[order], conf[order], pred_cls[order]

    classes, n_targets = np.unique(target_cls, return_counts=True)
    k, n_thr = len(classes), correct.shape[1]
    ap = np.zeros((k, n_thr))
    pr_curve = np.zeros((k, len(RECALL_POINTS)))
    p_curve = np.zeros((k, len(CONF_POINTS)))
    r_curve = np.zeros((k, len(CONF_POINTS)))
    for ci, (c, n_gt) in enumerate(zip(classes, n_targets)):
        mask = pred_cls == c
        tp = np.cumsum(correct[mask], 0, dtype=np.float64)  # (n, T)
        fp = np.cumsum(~correct[mask], 0, dtype=np.float64)
        for t in range(n_thr):
            q = _interpolated_precision(tp[:, t], fp[:, t], n_gt)
            ap[ci, t] = q.mean()
            if t == 0:
                pr_curve[ci] = q
        if mask.any():
            # curves vs confidence at IoU 0.5; conf is descending, np.interp needs ascending x
            recall = tp[:, 0] / n_gt
            precision = tp[:, 0] / (tp[:, 0] + fp[:, 0])
            r_curve[ci] = np.interp(-CONF_POINTS, -conf[mask], recall, left=0)
            p_curve[ci] = np.interp(-CONF_POINTS, -conf[mask], precision, left=1)

    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    best = int(_smooth(f1_curve.mean(0)).argmax()) if k else 0
    return ClassMetrics(
        classes=classes.astype(int),
        n_targets=n_targets,
        p=p_curve[:, best],
        r=r_curve[:, best],
        f1=f1_curve[:, best],
        ap=ap,
        conf_at_best_f1=float(CONF_POINTS[best]),
        p_curve=p_curve,
        r_curve=r_curve,
        f1_curve=f1_curve,
        pr_curve=pr_curve,
    )


def mean_metrics(metrics: ClassMetrics) -> tuple[float, float, float, float]:
    """(P, R, mAP50, mAP50-95) averaged over the classes that have ground truth; zeros when none do."""
    if len(metrics.classes) == 0:
        return 0.0, 0.0, 0.0, 0.0
    return (
        float(metrics.p.mean()),
        float(metrics.r.mean()),
        float(metrics.ap50.mean()),
        float(metrics.ap50_95.mean()),
    )


def fitness(x: Any) -> np.ndarray | float:
    """Model selection score 0.1 * mAP50 + 0.9 * mAP50-95 of rows [P, R, mAP50, mAP50-95, ...].

    Accepts an array-like whose last axis holds those four values first, or any object with ``map50`` and
    ``map`` attributes (such as val.py's ValResults).
    """
    if hasattr(x, "map50") and hasattr(x, "map"):
        return 0.1 * float(x.map50) + 0.9 * float(x.map)
    x = np.asarray(x, dtype=np.float64)
    score = 0.1 * x[..., 2] + 0.9 * x[..., 3]
    return float(score) if score.ndim == 0 else score


def confusion_matrix(
    detections: np.ndarray,
    labels: np.ndarray,
    nc: int,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
) -> np.ndarray:
    """Confusion counts of one image: (nc + 1, nc + 1), rows = predicted class, columns = true class.

    The last row/column is background: [c, nc] counts detections of class c that match no box (false
    positives), [nc, c] boxes of class c that no detection matches (missed). ``detections`` (n, 6) =
    [x1, y1, x2, y2, conf, cls]; ``labels`` (m, 5) = [cls, x1, y1, x2, y2]. Pairs with IoU > iou_thres
    are matched one-to-one, highest IoU first, whatever their classes (that is what a confusion is).
    """
    matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)
    detections = np.asarray(detections, dtype=np.float64).reshape(-1, 6)
    labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
    detections = detections[detections[:, 4] > conf_thres]
    det_cls = detections[:, 5].astype(int)
    gt_cls = labels[:, 0].astype(int)
    iou = box_iou_exact(detections[:, :4], labels[:, 1:])
    det_idx, gt_idx = np.nonzero(iou > iou_thres)
    order = np.argsort(-iou[det_idx, gt_idx], kind="mergesort")
    det_used = np.zeros(len(detections), dtype=bool)
    gt_used = np.zeros(len(labels), dtype=bool)
    for d, g in zip(det_idx[order], gt_idx[order]):
        if det_used[d] or gt_used[g]:
            continue
        det_used[d] = gt_used[g] = True
        matrix[det_cls[d], gt_cls[g]] += 1
    np.add.at(matrix[:, nc], det_cls[~det_used], 1)  # views: the counts land in matrix
    np.add.at(matrix[nc], gt_cls[~gt_used], 1)
    return matrix
