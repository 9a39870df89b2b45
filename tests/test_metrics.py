"""Matching, AP, P/R at max F1, fitness and the confusion matrix on hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest

from utils.metrics import (
    IOU_THRESHOLDS,
    ap_per_class,
    box_iou_exact,
    confusion_matrix,
    fitness,
    match_detections,
    mean_metrics,
)


def test_box_iou_exact_has_no_plus_one_and_no_epsilon():
    iou = box_iou_exact(np.array([[0, 0, 10, 10]]), np.array([[0, 0, 10, 5], [20, 20, 30, 30], [5, 5, 5, 5]]))
    assert iou.tolist() == [[0.5, 0.0, 0.0]]


def test_each_box_matched_once_best_iou_first_by_score():
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    dets = np.array([[0, 0, 10, 9], [0, 0, 10, 10]], dtype=float)  # the better box has the lower score
    correct = match_detections(dets, np.array([0.9, 0.5]), np.array([0, 0]), gt, np.array([0]))
    assert correct[0, :9].all() and not correct[0, 9]  # IoU 0.9: the higher score takes the box up to 0.9
    assert not correct[1, :9].any() and correct[1, 9]  # the later one only gets it where the first failed


def test_detection_of_another_class_never_matches():
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    correct = match_detections(gt, np.array([0.9]), np.array([1]), gt, np.array([0]))
    assert not correct.any()


def test_match_iou_thresholds_inclusive():
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    det = np.array([[0, 0, 10, 7.5]])  # IoU exactly 0.75
    correct = match_detections(det, np.array([0.9]), np.array([0]), gt, np.array([0]))
    assert correct[0].tolist() == (IOU_THRESHOLDS <= 0.75 + 1e-12).tolist()


def test_ap_of_half_right_ranking():
    # two gt boxes; ranked detections: TP, FP, TP  -> precision envelope 1 up to recall 0.5, 2/3 after
    correct = np.array([[True], [False], [True]])
    metrics = ap_per_class(correct, np.array([0.9, 0.8, 0.7]), np.array([0, 0, 0]), np.array([0, 0]))
    expected = (51 * 1.0 + 50 * (2 / 3)) / 101
    assert metrics.ap[0, 0] == pytest.approx(expected)
    assert metrics.classes.tolist() == [0] and metrics.n_targets.tolist() == [2]


def test_classes_without_ground_truth_are_left_out_and_missing_ones_count_zero():
    correct = np.ones((3, 10), dtype=bool)
    correct[2] = False
    metrics = ap_per_class(correct, np.array([0.9, 0.8, 0.95]), np.array([0, 0, 5]), np.array([0, 0, 1]))
    assert metrics.classes.tolist() == [0, 1]
    assert metrics.ap50.tolist() == pytest.approx([1.0, 0.0])
    p, r, map50, map50_95 = mean_metrics(metrics)
    assert map50 == pytest.approx(0.5) and map50_95 == pytest.approx(0.5)


def test_precision_recall_at_best_f1():
    # class 0: perfect at conf >= 0.5; a low-confidence FP below it
    correct = np.array([[True], [True], [False]])
    metrics = ap_per_class(correct, np.array([0.9, 0.8, 0.1]), np.array([0, 0, 0]), np.array([0, 0]))
    assert 0.1 < metrics.conf_at_best_f1 < 0.8
    # the curves interpolate linearly between detections' confidences, so P is just under 1 there
    assert metrics.p[0] > 0.95 and metrics.r[0] == pytest.approx(1.0)
    assert metrics.p_curve.shape == (1, 1000) and metrics.pr_curve.shape == (1, 101)


def test_no_ground_truth_at_all():
    metrics = ap_per_class(np.zeros((2, 10), bool), np.array([0.5, 0.4]), np.array([0, 1]), np.zeros(0))
    assert len(metrics.classes) == 0
    assert mean_metrics(metrics) == (0.0, 0.0, 0.0, 0.0)


def test_fitness_weights():
    assert fitness([0.3, 0.4, 0.5, 0.2]) == pytest.approx(0.1 * 0.5 + 0.9 * 0.2)
    assert fitness(np.array([[0, 0, 1, 0], [0, 0, 0, 1]])).tolist() == pytest.approx([0.1, 0.9])

    class Results:
        map50, map = 0.6, 0.4

    assert fitness(Results()) == pytest.approx(0.42)


def test_confusion_matrix_hand_made():
    labels = np.array([[0, 0, 0, 10, 10], [1, 20, 20, 30, 30], [2, 50, 50, 60, 60], [1, 80, 80, 90, 90]], float)
    detections = np.array(
        [
            [0, 0, 10, 10, 0.9, 0],  # correct class 0
            [0, 0, 10, 10.5, 0.8, 0],  # duplicate: the box is taken -> false positive of class 0
            [20, 20, 30, 30, 0.9, 2],  # class 1 predicted as 2
            [100, 100, 110, 110, 0.9, 1],  # nothing there -> false positive of class 1
            [50, 50, 60, 60, 0.1, 2],  # below conf_thres: ignored, so box 2 counts as missed
        ]
    )
    m = confusion_matrix(detections, labels, nc=3, conf_thres=0.25, iou_thres=0.45)
    expected = np.zeros((4, 4), int)
    expected[0, 0] = 1  # rows predicted, columns true
    expected[2, 1] = 1
    expected[0, 3] = 1  # FP class 0
    expected[1, 3] = 1  # FP class 1
    expected[3, 2] = 1  # missed class 2
    expected[3, 1] = 1  # missed class 1 (the box at 80..90)
    assert m.tolist() == expected.tolist()
    assert m.sum() == 6


def test_confusion_matrix_empty_inputs():
    assert confusion_matrix(np.zeros((0, 6)), np.zeros((0, 5)), nc=2).sum() == 0
    m = confusion_matrix(np.zeros((0, 6)), np.array([[1, 0, 0, 5, 5]]), nc=2)
    assert m[2, 1] == 1 and m.sum() == 1
