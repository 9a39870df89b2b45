"""Plots for validation and training: batch mosaics (cv2), and matplotlib charts rendered with Agg.

Charts use ``matplotlib.figure.Figure`` with an Agg canvas directly, never pyplot, so nothing global
(the backend, rcParams, open figures) is touched and no display is needed. Fonts are matplotlib's
bundled DejaVu and cv2's Hershey: nothing is downloaded.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import torch

from utils.boxes import xywh2xyxy, xyxy2xywh
from utils.errors import UserError, first_line
from utils.log import LOGGER

if TYPE_CHECKING:  # matplotlib is imported only when a plot is drawn
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

# 20 well-separated colours (RGB), cycled by class index
_PALETTE_HEX = (
    "FF3838",
    "FF9D97",
    "FF701F",
    "FFB21D",
    "CFD231",
    "48F90A",
    "92CC17",
    "3DDB86",
    "1A9334",
    "00D4BB",
    "2C99A8",
    "00C2FF",
    "344593",
    "6473FF",
    "0018EC",
    "8438FF",
    "520085",
    "CB38FF",
    "FF95C8",
    "FF37C7",
)


def class_colour(index: int, bgr: bool = False) -> tuple[int, int, int]:
    h = _PALETTE_HEX[int(index) % len(_PALETTE_HEX)]
    rgb = (int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16))
    return rgb[::-1] if bgr else rgb


def _new_figure(width: float, height: float, fitted: bool = True) -> Figure:
    """A matplotlib figure on its own Agg canvas; ``fitted``: margins fitted to its labels when drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="tight" if fitted else None)  # tight_layout=False would fit too
    FigureCanvasAgg(fig)
    return fig


def panel_grid(
    n_panels: int, n_cols: int, panel_width: float, panel_height: float, left: float = 0.7
) -> tuple[Figure, Any]:
    """A figure of ``n_panels`` small charts, ``n_cols`` to a row, and its axes (flat; the unused ones hidden);
    ``left``: the margin in inches (more for a label of the whole figure there).

    Margins are fixed, not fitted: fitting them (tight layout) measures every tick label of every panel and took
    most of the drawing time of a chart with one panel per results.csv column or hyper-parameter."""
    n_rows = max(1, math.ceil(n_panels / n_cols))
    width, height = n_cols * panel_width, n_rows * panel_height
    fig = _new_figure(width, height, fitted=False)
    # Inches: room for tick labels on the left and below, and for each panel's title above it.
    fig.subplots_adjust(
        left=left / width, right=1 - 0.2 / width, bottom=0.4 / height, top=1 - 0.4 / height, wspace=0.35, hspace=0.45
    )
    axes = np.atleast_1d(fig.subplots(n_rows, n_cols, squeeze=False)).ravel()
    for ax in axes[n_panels:]:
        ax.set_axis_off()
    return fig, axes[:n_panels]


def save_figure(fig: Figure, path: str | Path, dpi: int = 200) -> Path:
    """``fig`` written to ``path`` (format from its suffix), its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def output_to_target(detections: Sequence[torch.Tensor], max_det: int = 300) -> np.ndarray:
    """NMS output per image -> (N, 7) [image_index, cls, x, y, w, h, conf] in pixels, for ``plot_images``."""
    rows = []
    for i, det in enumerate(detections):
        det = det[:max_det].detach().float().cpu()
        index = torch.full((det.shape[0], 1), float(i))
        rows.append(torch.cat((index, det[:, 5:6], xyxy2xywh(det[:, :4]), det[:, 4:5]), 1))
    return torch.cat(rows, 0).numpy() if rows else np.zeros((0, 7), dtype=np.float32)


def plot_images(
    imgs: torch.Tensor | np.ndarray,
    targets: torch.Tensor | np.ndarray,
    paths: Sequence[str] | None = None,
    fname: str | Path = "images.jpg",
    names: Sequence[str] | None = None,
    max_size: int = 1920,
    max_subplots: int = 16,
    conf_thres: float = 0.25,
) -> Path:
    """Draw a grid of a batch's images with their boxes and save it (format from ``fname``'s suffix).

    ``imgs`` uint8 (B, 3, H, W) RGB (float in [0, 1] is accepted too). ``targets`` (N, 6) =
    [image_index, cls, x, y, w, h] or (N, 7) with a confidence last; boxes are xywh either normalised
    (all <= 1.1) or in pixels of the batch image. Rows with a confidence below ``conf_thres`` are not drawn.
    """
    if isinstance(imgs, torch.Tensor):
        imgs = imgs.detach().cpu().float().numpy()
    if isinstance(targets, torch.Tensor):
        targets = targets.detach().cpu().float().numpy()
    imgs = np.asarray(imgs)
    targets = np.asarray(targets, dtype=np.float64).reshape(-1, targets.shape[-1] if np.size(targets) else 6)
    if imgs.size and imgs.max() <= 1.0:
        imgs = imgs * 255
    bs, _, h, w = imgs.shape
    bs = min(bs, max_subplots)
    cols = math.ceil(bs**0.5)
    scale = min(1.0, max_size / (max(h, w) * cols))
    th, tw = math.ceil(h * scale), math.ceil(w * scale)
    grid_rows = math.ceil(bs / cols)
    canvas = np.full((grid_rows * th, cols * tw, 3), 255, dtype=np.uint8)
    line = max(1, round(2 * scale * max(h, w) / 640))
    font = max(0.3, 0.5 * scale * max(h, w) / 640)

    boxes_px = targets[:, 2:6].copy()
    if len(boxes_px) and boxes_px.max() <= 1.1:
        boxes_px *= [w, h, w, h]
    boxes_px = xywh2xyxy(boxes_px) * scale

    for i in range(bs):
        x0, y0 = (i % cols) * tw, (i // cols) * th
        tile = np.ascontiguousarray(imgs[i].transpose(1, 2, 0)[:, :, ::-1].clip(0, 255).astype(np.uint8))  # BGR
        if scale < 1:
            tile = cv2.resize(tile, (tw, th), interpolation=cv2.INTER_AREA)
        canvas[y0 : y0 + tile.shape[0], x0 : x0 + tile.shape[1]] = tile
        cv2.rectangle(canvas, (x0, y0), (x0 + tw - 1, y0 + th - 1), (255, 255, 255), 2)
        if paths is not None and i < len(paths):
            cv2.putText(
                canvas,
                Path(paths[i]).name[:40],
                (x0 + 5, y0 + 15),
                cv2.FONT_HERSHEY_SIMPLEX,
                font,
                (220, 220, 220),
                1,
                cv2.LINE_AA,
            )
        mine = targets[:, 0].astype(int) == i
        for row, box in zip(targets[mine], boxes_px[mine]):
            has_conf = targets.shape[1] >= 7
            if has_conf and row[6] < conf_thres:
                continue
            cls = int(row[1])
            colour = class_colour(cls, bgr=True)
            p1 = (int(box[0]) + x0, int(box[1]) + y0)
            p2 = (int(box[2]) + x0, int(box[3]) + y0)
            cv2.rectangle(canvas, p1, p2, colour, line, cv2.LINE_AA)
            label = names[cls] if names is not None and cls < len(names) else str(cls)
            if has_conf:
                label = f"{label} {row[6]:.2f}"
            cv2.putText(
                canvas, label, (p1[0], max(p1[1] - 3, y0 + 10)), cv2.FONT_HERSHEY_SIMPLEX, font, colour, 1, cv2.LINE_AA
            )
    fname = Path(fname)
    fname.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(fname), canvas):
        LOGGER.warning(f"{fname}: could not write image")
    return fname


def plot_confusion_matrix(
    matrix: np.ndarray, names: Sequence[str], save_path: str | Path, normalize: bool = True
) -> Path:
    """Heat map of a (nc + 1, nc + 1) confusion matrix (rows predicted, columns true, last = background).

    With ``normalize`` each column is divided by its total, so a column shows where a true class went.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    nc = matrix.shape[0] - 1
    shown = matrix / (matrix.sum(0, keepdims=True) + 1e-9) if normalize else matrix
    shown = np.where(shown < 0.005, np.nan, shown)  # leave empty cells blank
    labels = list(names)[:nc] + ["background"] if nc < 30 else None
    fig = _new_figure(12, 9)
    ax = fig.add_subplot()
    im = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=1.0 if normalize else None)
    fig.colorbar(im, ax=ax, fraction=0.046)
    if labels is not None:
        ax.set_xticks(range(nc + 1), labels, rotation=90, fontsize=8)
        ax.set_yticks(range(nc + 1), labels, fontsize=8)
        for r in range(nc + 1):
            for c in range(nc + 1):
                if not np.isnan(shown[r, c]):
                    ax.text(
                        c,
                        r,
                        f"{shown[r, c]:.2f}" if normalize else f"{int(shown[r, c])}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion Matrix" + (" (column-normalised)" if normalize else ""))
    return save_figure(fig, save_path, dpi=150)


def plot_pr_curve(
    recall_points: np.ndarray, precision: np.ndarray, ap50: np.ndarray, names: Sequence[str], save_path: str | Path
) -> Path:
    """Precision-recall curves at IoU 0.5: ``precision`` (K, R) over ``recall_points`` (R,), one row per class."""
    fig = _new_figure(9, 6)
    ax = fig.add_subplot()
    per_class = len(names) < 21
    for i, y in enumerate(precision):
        ax.plot(
            recall_points,
            y,
            linewidth=1,
            label=f"{names[i]} {ap50[i]:.3f}" if per_class else None,
            color=None if per_class else "grey",
        )
    if len(precision):
        ax.plot(
            recall_points,
            precision.mean(0),
            linewidth=3,
            color="blue",
            label=f"all classes {np.mean(ap50):.3f} mAP@0.5",
        )
    ax.set_xlabel("Recall")
    ax.set_ylabel("Precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left", fontsize=8)
    ax.set_title("Precision-Recall Curve")
    return save_figure(fig, save_path)


def plot_metric_curve(
    conf_points: np.ndarray, values: np.ndarray, names: Sequence[str], save_path: str | Path, ylabel: str
) -> Path:
    """A metric (F1, precision or recall) vs confidence: ``values`` (K, C) over ``conf_points`` (C,)."""
    fig = _new_figure(9, 6)
    ax = fig.add_subplot()
    per_class = len(names) < 21
    for i, y in enumerate(values):
        ax.plot(conf_points, y, linewidth=1, label=names[i] if per_class else None, color=None if per_class else "grey")
    if len(values):
        mean = values.mean(0)
        best = int(mean.argmax())
        ax.plot(
            conf_points,
            mean,
            linewidth=3,
            color="blue",
            label=f"all classes {mean[best]:.2f} at {conf_points[best]:.3f}",
        )
    ax.set_xlabel("Confidence")
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left", fontsize=8)
    ax.set_title(f"{ylabel}-Confidence Curve")
    return save_figure(fig, save_path)


def plot_labels(labels: np.ndarray, names: Sequence[str], save_dir: str | Path) -> Path:
    """labels.jpg: instances per class, and box centres and sizes (normalised) of all dataset labels (n, 5)."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
    nc = max(len(names), int(labels[:, 0].max()) + 1 if len(labels) else 0)
    fig = _new_figure(10, 8)
    axes = fig.subplots(2, 2)
    counts = np.bincount(labels[:, 0].astype(int), minlength=nc)
    axes[0, 0].bar(range(nc), counts, color=[np.array(class_colour(i)) / 255 for i in range(nc)])
    axes[0, 0].set_ylabel("instances")
    if 0 < nc < 30:
        axes[0, 0].set_xticks(
            range(nc), list(names)[:nc] + [str(i) for i in range(len(names), nc)], rotation=90, fontsize=8
        )
    else:
        axes[0, 0].set_xlabel("classes")
    # every box drawn centred, to show the spread of shapes
    axes[0, 1].set_xlim(0, 1)
    axes[0, 1].set_ylim(1, 0)
    for cls, _, _, bw, bh in labels[:1000]:
        axes[0, 1].add_patch(_rectangle((0.5 - bw / 2, 0.5 - bh / 2), bw, bh, np.array(class_colour(int(cls))) / 255))
    axes[0, 1].set_title("box shapes (first 1000)")
    axes[1, 0].hist2d(labels[:, 1], labels[:, 2], bins=50, range=[[0, 1], [0, 1]], cmap="Blues")
    axes[1, 0].set_xlabel("x")
    axes[1, 0].set_ylabel("y")
    axes[1, 1].hist2d(labels[:, 3], labels[:, 4], bins=50, range=[[0, 1], [0, 1]], cmap="Blues")
    axes[1, 1].set_xlabel("width")
    axes[1, 1].set_ylabel("height")
    return save_figure(fig, Path(save_dir) / "labels.jpg")


def _rectangle(xy: tuple[float, float], w: float, h: float, colour: np.ndarray) -> Rectangle:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, fill=False, linewidth=0.5, edgecolor=colour, alpha=0.4)


def read_results_csv(csv_file: str | Path) -> tuple[list[str], np.ndarray]:
    """Column names (stripped) and a float array (rows, columns) of a results.csv; a file that is not text or has a
    row that is not numbers is a one-line UserError (nothing to plot from; the file itself is left as it is)."""
    try:
        with open(csv_file, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if row]
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{csv_file}: not a results.csv ({first_line(e)})") from e
    if not rows:
        return [], np.zeros((0, 0))
    header = [c.strip() for c in rows[0]]
    try:
        values = np.array([[float(v) for v in row] for row in rows[1:]], dtype=np.float64).reshape(-1, len(header))
    except ValueError as e:  # a row edited or cut short
        raise UserError(f"{csv_file}: a row that is not {len(header)} numbers ({first_line(e)})") from e
    return header, values


def plot_results(csv_file: str | Path) -> Path:
    """results.png next to ``csv_file``: every column of results.csv against the first (epoch)."""
    csv_file = Path(csv_file)
    header, values = read_results_csv(csv_file)
    columns = header[1:]
    fig, axes = panel_grid(len(columns), 5, 3, 3)
    for ax, j, name in zip(axes, range(1, len(header)), columns):
        y = values[:, j]
        ax.plot(values[:, 0], y, marker=".", linewidth=2, markersize=6)
        if len(y) > 2:  # a light running mean shows the trend under noisy losses
            k = min(5, len(y))
            ax.plot(values[k - 1 :, 0], np.convolve(y, np.ones(k) / k, mode="valid"), ":", linewidth=2)
        ax.set_title(name, fontsize=11, y=1.0)  # a fixed place: not measured per panel
    return save_figure(fig, csv_file.with_name("results.png"))
