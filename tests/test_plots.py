"""Plots write real image files without touching matplotlib's global state."""

from __future__ import annotations

import re
import sys

import cv2
import numpy as np
import pytest
import torch

from utils.errors import UserError
from utils.metrics import CONF_POINTS, RECALL_POINTS
from utils.plots import (
    output_to_target,
    plot_confusion_matrix,
    plot_images,
    plot_labels,
    plot_metric_curve,
    plot_pr_curve,
    plot_results,
)
from utils.results_log import append_results_row, result_columns
from utils.run_dir import increment_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_images_with_labels_and_predictions(tmp_path):
    imgs = torch.zeros((3, 3, 64, 96), dtype=torch.uint8)
    imgs[:, 1] = 200  # green
    labels = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.4], [2, 1, 0.3, 0.3, 0.2, 0.2]])
    out = plot_images(
        imgs, labels, ["a.jpg", "b.jpg", "c.jpg"], tmp_path / "labels.png", names=["cat", "dog"]
    )  # png: exact pixels
    image = cv2.imread(str(out))
    assert image is not None and image.shape[0] >= 64 and image.shape[1] >= 96
    # the box of class 0 (red in the palette, BGR (56, 56, 255)) is drawn on the green first tile
    reds = (image[..., 2] > 180) & (image[..., 1] < 120)
    assert reds[:64, :96].any()

    det = [torch.tensor([[10.0, 10.0, 40.0, 30.0, 0.9, 1.0], [0, 0, 5, 5, 0.1, 0]]), torch.zeros((0, 6))]
    targets = output_to_target(det)
    assert targets.shape == (2, 7) and targets[0, :2].tolist() == [0, 1]
    assert targets[0, 2:6].tolist() == [25.0, 20.0, 30.0, 20.0]
    out = plot_images(imgs[:2], targets, None, tmp_path / "pred.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_charts_are_png_and_matplotlib_state_untouched(tmp_path):
    was_pyplot_loaded = "matplotlib.pyplot" in sys.modules
    names = ["a", "b", "c"]
    matrix = np.array([[5, 1, 0, 2], [0, 3, 0, 1], [1, 0, 4, 0], [1, 2, 0, 0]])
    rng = np.random.default_rng(0)
    files = [
        plot_confusion_matrix(matrix, names, tmp_path / "confusion_matrix.png"),
        plot_pr_curve(
            RECALL_POINTS,
            np.sort(rng.random((3, 101)))[:, ::-1],
            np.array([0.5, 0.6, 0.7]),
            names,
            tmp_path / "PR_curve.png",
        ),
        plot_metric_curve(CONF_POINTS, rng.random((3, 1000)), names, tmp_path / "F1_curve.png", "F1"),
    ]
    for f in files:
        assert f.read_bytes()[:8] == PNG_MAGIC
    assert ("matplotlib.pyplot" in sys.modules) == was_pyplot_loaded


def test_plot_labels_and_results(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.concatenate([rng.integers(0, 4, (200, 1)), rng.uniform(0.05, 0.5, (200, 4))], 1)
    out = plot_labels(labels, ["a", "b", "c", "d"], tmp_path)
    assert out.name == "labels.jpg" and cv2.imread(str(out)) is not None

    csv_file = tmp_path / "results.csv"
    columns = result_columns(("box", "cls", "dfl"))
    for epoch in range(4):
        append_results_row(csv_file, [epoch] + list(rng.random(len(columns) - 1)), columns)
    out = plot_results(csv_file)
    assert out == tmp_path / "results.png" and out.read_bytes()[:8] == PNG_MAGIC

    cut = tmp_path / "cut" / "results.csv"  # a row cut short (a full disk, an editor): one error naming the file
    cut.parent.mkdir()
    cut.write_text(csv_file.read_text().rsplit(",", 3)[0] + "\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(cut))}: a row that is not {len(columns)} numbers"):
        plot_results(cut)
    cut.write_bytes(b"epoch,\xff\n")  # not UTF-8
    with pytest.raises(UserError, match=rf"^{re.escape(str(cut))}: not a results.csv \(.*\)$"):
        plot_results(cut)


def test_increment_path(tmp_path):
    assert increment_path(tmp_path / "exp") == tmp_path / "exp"
    (tmp_path / "exp").mkdir()
    assert increment_path(tmp_path / "exp") == tmp_path / "exp2"
    assert increment_path(tmp_path / "exp", exist_ok=True) == tmp_path / "exp"
    made = increment_path(tmp_path / "exp", mkdir=True)
    assert made == tmp_path / "exp2" and made.is_dir()
    assert increment_path(tmp_path / "exp") == tmp_path / "exp3"
