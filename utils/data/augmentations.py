"""Image and box augmentations for detection training.

All functions are pure with respect to global state: every random draw comes from the
``numpy.random.Generator`` passed in, so the same seed always gives the same output.
Images are BGR uint8 HWC arrays. Pixel boxes use edge coordinates: pixel column ``i`` spans
``[i, i + 1)``, so a box covering columns 3..5 is ``x1=3, x2=6``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

from utils.boxes import xywhn2xyxy

FILL_VALUE = 114  # grey used for letterbox padding, mosaic canvas and warp borders
_FILL_BGR = (FILL_VALUE, FILL_VALUE, FILL_VALUE)


def long_side_shape(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """(h, w) of an h0 x w0 image resized so that its longer side is ``imgsz``."""
    ratio = imgsz / max(h0, w0)
    if ratio == 1:
        return h0, w0
    return max(1, round(h0 * ratio)), max(1, round(w0 * ratio))


def resize_to_long_side(
    img: np.ndarray, imgsz: int, augment: bool = False
) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """Resize so the longer side is ``imgsz``; returns (img, (h0, w0), (h, w)).

    INTER_AREA is used when shrinking for evaluation (best quality); INTER_LINEAR otherwise
    because it is much faster and training augmentation hides the difference.
    """
    h0, w0 = img.shape[:2]
    h, w = long_side_shape(h0, w0, imgsz)
    if (h, w) == (h0, w0):
        return img, (h0, w0), (h0, w0)
    interp = cv2.INTER_AREA if (max(h, w) < max(h0, w0) and not augment) else cv2.INTER_LINEAR
    return cv2.resize(img, (w, h), interpolation=interp), (h0, w0), (h, w)


def linear_resize_source_span(start: int, stop: int, n_src: int, n_dst: int) -> tuple[int, int]:
    """Source pixels [a, b) from which a linear resize of ``n_src`` pixels onto ``n_dst`` computes output pixels
    [start, stop): each output reads its two nearest sources (a 2x shrink, which OpenCV does as a 2x2 mean,
    reads the same two); one more on each side absorbs OpenCV's fixed-point rounding."""
    k = n_src / n_dst
    a = math.floor((start + 0.5) * k - 0.5) - 1
    b = math.floor((stop - 0.5) * k - 0.5) + 3
    return max(0, a), min(n_src, b)


def letterbox(
    img: np.ndarray,
    new_shape: tuple[int, int] | int = (640, 640),
    color: tuple[int, int, int] = _FILL_BGR,
    auto: bool = False,
    scaleup: bool = True,
    stride: int = 32,
) -> tuple[np.ndarray, tuple[float, float], tuple[float, float]]:
    """Resize keeping the aspect ratio, then pad (centred) to ``new_shape`` = (h, w).

    Returns ``(img, (ratio_w, ratio_h), (pad_w, pad_h))`` such that an original pixel box maps to
    ``x * ratio_w + pad_w``, ``y * ratio_h + pad_h``. The ratios are the exact per-axis ones of the
    rounded resize, and the pads are the exact left and top padding (when the total padding is odd
    the extra pixel goes right/bottom). ``auto`` pads only up to a multiple of ``stride``;
    ``scaleup=False`` never enlarges the image.
    """
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    h0, w0 = img.shape[:2]
    gain = min(new_shape[0] / h0, new_shape[1] / w0)
    if not scaleup:
        gain = min(gain, 1.0)
    w, h = max(1, round(w0 * gain)), max(1, round(h0 * gain))
    pad_w_total, pad_h_total = new_shape[1] - w, new_shape[0] - h
    if auto:
        pad_w_total, pad_h_total = pad_w_total % stride, pad_h_total % stride

    if (w, h) != (w0, h0):
        img = cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)
    left, top = pad_w_total // 2, pad_h_total // 2
    right, bottom = pad_w_total - left, pad_h_total - top
    if pad_w_total or pad_h_total:
        img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=color)
    return img, (w / w0, h / h0), (float(left), float(top))


def augment_hsv(
    img: np.ndarray, rng: np.random.Generator, hgain: float = 0.5, sgain: float = 0.5, vgain: float = 0.5
) -> np.ndarray:
    """Multiply hue, saturation and value by random gains in ``[1 - gain, 1 + gain]``.

    Modifies ``img`` (BGR uint8, 3 channels) IN PLACE and also returns it. A no-op, drawing nothing
    from ``rng``, when all gains are 0.
    """
    if not (hgain or sgain or vgain):
        return img
    gains = rng.uniform(-1.0, 1.0, 3) * (hgain, sgain, vgain) + 1.0
    levels = np.arange(256, dtype=np.float32)
    tables = (
        ((levels * gains[0]) % 180).astype(np.uint8),  # OpenCV 8-bit hue lives in [0, 180)
        np.clip(levels * gains[1], 0, 255).astype(np.uint8),
        np.clip(levels * gains[2], 0, 255).astype(np.uint8),
    )
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    channels = cv2.split(hsv)
    for channel, table in zip(channels, tables):  # one-channel LUTs beat one 3-channel LUT, split and merge included
        cv2.LUT(channel, table, dst=channel)
    cv2.merge(channels, dst=hsv)
    cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR, dst=img)
    return img


def box_candidates(
    box1: np.ndarray,
    box2: np.ndarray,
    wh_thr: float = 2,
    ar_thr: float = 100,
    area_thr: float = 0.1,
    eps: float = 1e-16,
) -> np.ndarray:
    """Mask of boxes worth keeping after augmentation.

    ``box1`` (before, already scaled by the augmentation's zoom) and ``box2`` (after) are xyxy
    arrays of shape (n, 4). A box is kept when it is wider and taller than ``wh_thr`` pixels, keeps
    more than ``area_thr`` of its area and its aspect ratio is below ``ar_thr``.
    """
    w1, h1 = box1[:, 2] - box1[:, 0], box1[:, 3] - box1[:, 1]
    w2, h2 = box2[:, 2] - box2[:, 0], box2[:, 3] - box2[:, 1]
    aspect = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (aspect < ar_thr)


def _translation(dx: float, dy: float) -> np.ndarray:
    m = np.eye(3)
    m[0, 2], m[1, 2] = dx, dy
    return m


def random_warp_matrix(
    rng: np.random.Generator,
    in_wh: tuple[int, int],
    out_wh: tuple[int, int],
    degrees: float = 10,
    translate: float = 0.1,
    scale: float = 0.1,
    shear: float = 10,
    perspective: float = 0.0,
) -> tuple[np.ndarray, float]:
    """A random 3x3 warp (in edge coordinates) from an ``in_wh`` image to an ``out_wh`` one, and its zoom.

    The input's centre goes to a random point near the output's centre; rotation, zoom, shear and
    perspective act around it.
    """
    # Always draw the same number of values in the same order so streams stay aligned across settings.
    px, py = rng.uniform(-perspective, perspective, 2)
    angle = rng.uniform(-degrees, degrees)
    zoom = float(rng.uniform(1 - scale, 1 + scale))
    shear_x, shear_y = np.tan(np.radians(rng.uniform(-shear, shear, 2)))
    tx, ty = rng.uniform(0.5 - translate, 0.5 + translate, 2) * out_wh

    centre = _translation(-in_wh[0] / 2, -in_wh[1] / 2)
    persp = np.eye(3)
    persp[2, 0], persp[2, 1] = px, py
    rot_scale = np.eye(3)
    rot_scale[:2] = cv2.getRotationMatrix2D((0, 0), angle, zoom)
    shear_m = np.eye(3)
    shear_m[0, 1], shear_m[1, 0] = shear_x, shear_y
    return _translation(tx, ty) @ shear_m @ rot_scale @ persp @ centre, zoom


def _is_perspective(matrix: np.ndarray) -> bool:
    return bool(matrix[2, 0] or matrix[2, 1])


def warp_image(
    img: np.ndarray, matrix: np.ndarray, out_wh: tuple[int, int], origin: tuple[int, int] = (0, 0)
) -> np.ndarray:
    """Warp ``img`` by ``matrix`` (edge coordinates) into an ``out_wh`` image filled with grey outside it.

    ``img`` may be a crop of the image the matrix was drawn for, whose top-left pixel sits at ``origin``
    of that image: the result is the same as warping the whole image, as long as the crop holds every
    pixel the output samples (see ``sampled_window``).
    """
    # cv2 samples at pixel centres (pixel i sits at i, not i + 0.5): shift so that boxes in edge
    # coordinates and the warped pixels stay exactly aligned, even under zoom.
    pixel_matrix = _translation(-0.5, -0.5) @ matrix @ _translation(0.5 + origin[0], 0.5 + origin[1])
    if _is_perspective(matrix):
        return cv2.warpPerspective(img, pixel_matrix, out_wh, borderValue=_FILL_BGR)
    return cv2.warpAffine(img, pixel_matrix[:2], out_wh, borderValue=_FILL_BGR)


def sampled_window(
    matrix: np.ndarray, out_wh: tuple[int, int], in_wh: tuple[int, int], margin: int = 2
) -> tuple[int, int, int, int] | None:
    """Pixel window (x1, y1, x2, y2) of an ``in_wh`` image that warping it by ``matrix`` reads.

    Covers the source of every output pixel plus ``margin`` pixels for interpolation, clipped to the
    input; the whole input when a perspective maps part of the output from beyond the horizon; None
    when the output reads no input pixel at all.
    """
    out_w, out_h = out_wh
    corners = np.array([[0, 0, 1], [out_w, 0, 1], [0, out_h, 1], [out_w, out_h, 1]], dtype=np.float64)
    src = corners @ np.linalg.inv(matrix).T
    if (src[:, 2] <= 0).any():
        return 0, 0, in_wh[0], in_wh[1]
    xy = src[:, :2] / src[:, 2:3]  # corners of the output in input edge coordinates
    x1, y1 = np.floor(xy.min(0)).astype(int) - margin
    x2, y2 = np.ceil(xy.max(0)).astype(int) + margin
    x1, y1, x2, y2 = max(int(x1), 0), max(int(y1), 0), min(int(x2), in_wh[0]), min(int(y2), in_wh[1])
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


@dataclass(frozen=True)
class WarpPlan:
    """How to produce a warped image: which input pixels to read and how.

    ``matrix`` is the warp the pixels actually get (edge coordinates): boxes must be moved with it.
    ``window`` (x1, y1, x2, y2) is the input region read, None when the output shows no input pixel.
    ``resize_to`` is set for warps without rotation, shear or perspective: the output rectangle the window
    is resized onto (it may reach past the output, which keeps only its inside), a separable resize being
    several times cheaper than a general warp.
    """

    matrix: np.ndarray
    window: tuple[int, int, int, int] | None
    resize_to: tuple[int, int, int, int] | None = None


def _resize_span(scale: float, shift: float, n_in: int, n_out: int) -> tuple[int, int, int, int] | None:
    """Input pixels [a, b) that ``x -> scale * x + shift`` shows in [0, n_out), with one more on each side for
    interpolation, and the whole-pixel output span [c, d) they are resized onto (it may reach past the output)."""
    a, b = max(0, math.floor(-shift / scale) - 1), min(n_in, math.ceil((n_out - shift) / scale) + 1)
    c, d = round(scale * a + shift), round(scale * b + shift)
    return (a, b, c, d) if b > a and d > c and d > 0 and c < n_out else None


def plan_warp(matrix: np.ndarray, out_wh: tuple[int, int], in_wh: tuple[int, int]) -> WarpPlan:
    """Plan warping an ``in_wh`` image by ``matrix`` into ``out_wh``.

    An axis-aligned matrix (zoom and translation only: the default augmentation) becomes a resize of whole
    input pixels onto whole output pixels; its scale and shift move by under a pixel to make that exact, and
    the returned matrix is that adjusted one.
    """
    axis_aligned = matrix[0, 1] == 0 and matrix[1, 0] == 0 and not _is_perspective(matrix)
    if axis_aligned and matrix[0, 0] > 0 and matrix[1, 1] > 0:  # a zoom <= 0 (hyp scale >= 1) flips or collapses
        spans = [_resize_span(matrix[i, i], matrix[i, 2], in_wh[i], out_wh[i]) for i in (0, 1)]
        if spans[0] is None or spans[1] is None:
            return WarpPlan(matrix, None)
        (ax, bx, cx, dx), (ay, by, cy, dy) = spans[0], spans[1]
        sx, sy = (dx - cx) / (bx - ax), (dy - cy) / (by - ay)
        exact = np.array([[sx, 0.0, cx - ax * sx], [0.0, sy, cy - ay * sy], [0.0, 0.0, 1.0]])
        return WarpPlan(exact, (ax, ay, bx, by), (cx, cy, dx, dy))
    return WarpPlan(matrix, sampled_window(matrix, out_wh, in_wh))


def render_warp(window_img: np.ndarray | None, plan: WarpPlan, out_wh: tuple[int, int]) -> np.ndarray:
    """The warped image from the pixels of ``plan.window`` (``window_img``; None when there is no window)."""
    if plan.window is None or window_img is None:
        return np.full((out_wh[1], out_wh[0], 3), FILL_VALUE, dtype=np.uint8)
    if plan.resize_to is None:
        return warp_image(window_img, plan.matrix, out_wh, origin=plan.window[:2])
    x1, y1, x2, y2 = plan.resize_to
    resized = cv2.resize(window_img, (x2 - x1, y2 - y1), interpolation=cv2.INTER_LINEAR)
    if resized.ndim == 2:  # cv2 drops a single channel's axis
        resized = resized[..., None]
    if (x1, y1, x2, y2) == (0, 0, *out_wh):
        return resized
    ox1, oy1, ox2, oy2 = max(x1, 0), max(y1, 0), min(x2, out_wh[0]), min(y2, out_wh[1])
    inside = resized[oy1 - y1 : oy2 - y1, ox1 - x1 : ox2 - x1]
    if (ox1, oy1, ox2, oy2) == (0, 0, *out_wh):
        return np.ascontiguousarray(inside)
    out = np.full((out_wh[1], out_wh[0], window_img.shape[2]), FILL_VALUE, dtype=window_img.dtype)
    out[oy1:oy2, ox1:ox2] = inside
    return out


def warp_boxes(labels: np.ndarray, matrix: np.ndarray, zoom: float, out_wh: tuple[int, int]) -> np.ndarray:
    """Warp (n, 5) [cls, x1, y1, x2, y2] pixel labels; drops the degenerate ones (``box_candidates``).

    Each box becomes the enclosing box of its 4 warped corners, clipped to the output. Returns a new array.
    """
    n = len(labels)
    if n == 0:
        return labels.copy()
    corners = np.ones((n * 4, 3))
    corners[:, :2] = labels[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)  # the 4 corners of each box
    corners = corners @ matrix.T
    xy = corners[:, :2] / corners[:, 2:3] if _is_perspective(matrix) else corners[:, :2]
    xy = xy.reshape(n, 4, 2)
    boxes = np.concatenate((xy.min(1), xy.max(1)), axis=1)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, out_wh[0])
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, out_wh[1])

    keep = box_candidates(labels[:, 1:5] * zoom, boxes)
    out = labels[keep].copy()
    out[:, 1:5] = boxes[keep]
    return out


def random_perspective(
    img: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    degrees: float = 10,
    translate: float = 0.1,
    scale: float = 0.1,
    shear: float = 10,
    perspective: float = 0.0,
    border: tuple[int, int] = (0, 0),
) -> tuple[np.ndarray, np.ndarray]:
    """Random rotation, scale, shear, translation and perspective applied to an image and its boxes.

    ``labels`` is (n, 5) = [cls, x1, y1, x2, y2] in pixels. The output image has size
    ``(h + 2 * border[0], w + 2 * border[1])``; a negative border crops (e.g. a 2s mosaic to s).
    Boxes become the enclosing box of their 4 warped corners, clipped to the output, and
    degenerate ones are dropped with ``box_candidates``. Returns new arrays.
    """
    out_wh = (img.shape[1] + 2 * border[1], img.shape[0] + 2 * border[0])
    matrix, zoom = random_warp_matrix(
        rng, (img.shape[1], img.shape[0]), out_wh, degrees, translate, scale, shear, perspective
    )
    if border[0] == 0 and border[1] == 0 and np.allclose(matrix, np.eye(3)):
        return img, warp_boxes(labels, matrix, zoom, out_wh)
    plan = plan_warp(matrix, out_wh, (img.shape[1], img.shape[0]))
    if plan.window is None:  # nothing of the image shows
        img = np.full((out_wh[1], out_wh[0], img.shape[2]), FILL_VALUE, dtype=img.dtype)
    elif plan.resize_to is None:
        img = warp_image(img, plan.matrix, out_wh)
    else:
        x1, y1, x2, y2 = plan.window
        img = render_warp(img[y1:y2, x1:x2], plan, out_wh)
    return img, warp_boxes(labels, plan.matrix, zoom, out_wh)


def mosaic_layout(shapes_hw: list[tuple[int, int]], imgsz: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Top-left canvas corners of 4 tiles of the given (h, w) around a random centre of a 2 * imgsz canvas.

    Tile k touches the centre with its bottom-right, bottom-left, top-right and top-left corner
    respectively; a corner may lie outside the canvas.
    """
    xc, yc = (int(v) for v in rng.uniform(0.5 * imgsz, 1.5 * imgsz, 2))
    return [(xc - w if k in (0, 2) else xc, yc - h if k in (0, 1) else yc) for k, (h, w) in enumerate(shapes_hw)]


def _mosaic_labels(
    labels: list[np.ndarray], shapes_hw: list[tuple[int, int]], corners: list[tuple[int, int]], size: int
) -> np.ndarray:
    placed = []
    for lab, (h, w), (left, top) in zip(labels, shapes_hw, corners):
        if len(lab):
            boxes = np.asarray(lab, dtype=np.float32).copy()
            boxes[:, 1:] = xywhn2xyxy(boxes[:, 1:], w, h, left, top)
            placed.append(boxes)
    out = np.concatenate(placed, 0) if placed else np.zeros((0, 5), dtype=np.float32)
    out[:, 1:] = out[:, 1:].clip(0, size)
    return out


TileLoader = Callable[[int, tuple[int, int, int, int], np.ndarray], None]


def _paste_tiles(
    canvas: np.ndarray,
    window: tuple[int, int, int, int],
    load: TileLoader,
    shapes_hw: list[tuple[int, int]],
    corners: list[tuple[int, int]],
    map_fn: Callable = map,
) -> None:
    """Fill ``canvas`` (which shows ``window`` of the mosaic) with the visible part of each tile.

    Only tiles that overlap the window are loaded, as ``load(k, region, out)`` through ``map_fn``: it writes
    ``region`` (x1, y1, x2, y2, in tile k's pixels) of tile k into ``out``, the canvas view where it shows.
    """
    wx1, wy1, wx2, wy2 = window
    visible = []
    for k, ((h, w), (left, top)) in enumerate(zip(shapes_hw, corners)):
        x1, y1 = max(left, wx1), max(top, wy1)
        x2, y2 = min(left + w, wx2), min(top + h, wy2)
        if x2 > x1 and y2 > y1:
            out = canvas[y1 - wy1 : y2 - wy1, x1 - wx1 : x2 - wx1]
            visible.append((k, (x1 - left, y1 - top, x2 - left, y2 - top), out))
    for _ in map_fn(lambda args: load(*args), visible):  # consume: the loads happen here
        pass


def paste_region(tile: np.ndarray, region: tuple[int, int, int, int], out: np.ndarray) -> None:
    """A tile loader's usual body: copy ``region`` (x1, y1, x2, y2) of the whole ``tile`` into ``out``."""
    x1, y1, x2, y2 = region
    part = tile[y1:y2, x1:x2]
    if part.shape != out.shape:
        raise ValueError(f"mosaic tile of shape {tile.shape[:2]} has no region {region} of shape {out.shape[:2]}")
    out[...] = part


def mosaic4(
    images: list[np.ndarray], labels: list[np.ndarray], imgsz: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Tile 4 images around a random centre of a ``2 * imgsz`` square canvas filled with grey.

    ``images`` are BGR uint8 with long side ``imgsz``; ``labels`` are (n, 5) [cls, x, y, w, h]
    normalised to their own image. Image k touches the centre with its bottom-right, bottom-left,
    top-right and top-left corner respectively. Returns the canvas and (n, 5) [cls, x1, y1, x2, y2]
    labels in canvas pixels, clipped to the canvas.
    """
    if len(images) != 4 or len(labels) != 4:
        raise ValueError(f"mosaic4 needs 4 images and 4 label arrays, got {len(images)} and {len(labels)}")
    size = 2 * imgsz
    shapes_hw = [img.shape[:2] for img in images]
    corners = mosaic_layout(shapes_hw, imgsz, rng)
    canvas = np.full((size, size, images[0].shape[2]), FILL_VALUE, dtype=np.uint8)
    _paste_tiles(
        canvas, (0, 0, size, size), lambda k, region, out: paste_region(images[k], region, out), shapes_hw, corners
    )
    return canvas, _mosaic_labels(labels, shapes_hw, corners, size)


@dataclass(frozen=True)
class Warp:
    """The ranges of a random warp (``random_perspective``'s): rotation (+/- degrees), translation (+/- fraction),
    zoom (+/- gain), shear (+/- degrees), perspective (+/- fraction)."""

    degrees: float = 10
    translate: float = 0.1
    scale: float = 0.1
    shear: float = 10
    perspective: float = 0.0


def warped_mosaic4(
    load: TileLoader,
    shapes_hw: list[tuple[int, int]],
    labels: list[np.ndarray],
    imgsz: int,
    rng: np.random.Generator,
    warp: Warp = Warp(),
    map_fn: Callable = map,
) -> tuple[np.ndarray, np.ndarray]:
    """``mosaic4`` then ``random_perspective`` (with ``warp``'s ranges) down to imgsz, building only the part of
    the canvas that shows.

    Same draws and same output as the two steps (border ``-imgsz // 2``), but only the canvas window the
    warp reads is filled (about a third of the 2 * imgsz canvas on average) and ``load(k, region, out)``
    is called only for tiles the output shows (one tile in ten is hidden with the default scale and
    translation): it writes the (x1, y1, x2, y2) region that shows of tile k (BGR uint8 of shape
    ``shapes_hw[k]``) into the canvas view ``out`` (``paste_region`` does it from a whole tile).
    ``map_fn`` (``map`` or a thread pool's) calls ``load`` over the visible tiles. Axis-aligned warps are
    resizes (``plan_warp``).
    """
    if len(shapes_hw) != 4 or len(labels) != 4:
        raise ValueError(f"warped_mosaic4 needs 4 shapes and 4 label arrays, got {len(shapes_hw)} and {len(labels)}")
    size = 2 * imgsz
    corners = mosaic_layout(shapes_hw, imgsz, rng)
    border = -imgsz // 2
    out_wh = (size + 2 * border, size + 2 * border)
    matrix, zoom = random_warp_matrix(
        rng, (size, size), out_wh, warp.degrees, warp.translate, warp.scale, warp.shear, warp.perspective
    )
    plan = plan_warp(matrix, out_wh, (size, size))
    canvas = None
    if plan.window is not None:
        x1, y1, x2, y2 = plan.window
        canvas = np.full((y2 - y1, x2 - x1, 3), FILL_VALUE, dtype=np.uint8)
        _paste_tiles(canvas, plan.window, load, shapes_hw, corners, map_fn)
    img = render_warp(canvas, plan, out_wh)
    return img, warp_boxes(_mosaic_labels(labels, shapes_hw, corners, size), plan.matrix, zoom, out_wh)


def mixup(
    img1: np.ndarray, labels1: np.ndarray, img2: np.ndarray, labels2: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Blend two same-sized images with a Beta(32, 32) ratio and keep the labels of both."""
    if img1.shape != img2.shape:
        raise ValueError(f"mixup needs images of the same shape, got {img1.shape} and {img2.shape}")
    ratio = float(rng.beta(32.0, 32.0))
    img = cv2.addWeighted(img1, ratio, img2, 1.0 - ratio, 0.0)
    return img, np.concatenate((labels1, labels2), 0)


def random_flips(
    img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, flipud: float = 0.0, fliplr: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Flip up-down with probability ``flipud`` and left-right with probability ``fliplr``.

    ``labels`` are (n, 5) normalised [cls, x, y, w, h]. Returns a contiguous image (the input when
    nothing flips) and a new label array.
    """
    draw_ud, draw_lr = rng.random(2)  # always two draws so the stream does not depend on the settings
    up_down, left_right = draw_ud < flipud, draw_lr < fliplr
    labels = labels.copy()
    if up_down:
        labels[:, 2] = 1 - labels[:, 2]
    if left_right:
        labels[:, 1] = 1 - labels[:, 1]
    if up_down or left_right:
        # cv2 flip codes: 0 = around the x axis, 1 = around the y axis, -1 = both in one pass
        img = cv2.flip(img, -1 if (up_down and left_right) else int(left_right))
    return img, labels


# ---- the DETR recipes' augmentations (torchvision v2's semantics, drawn from the sample's own generator) ----------

_LEVELS = np.arange(256, dtype=np.float32)


def photometric_distort(img: np.ndarray, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """torchvision v2's RandomPhotometricDistort: brightness in [0.875, 1.125], contrast in [0.5, 1.5] (before or
    after the colour changes, even odds), saturation in [0.5, 1.5], hue shifted by up to 0.05 of the circle and the
    channels permuted, each with probability ``p``; on uint8 pixels, each change rounded as torchvision's on uint8
    images (lookup tables and OpenCV's 8-bit HSV, hue in steps of 2 degrees). BGR uint8 in; a new array out, or
    ``img`` itself when nothing changes. The draws are the same whatever ``p``."""
    gates = rng.random(6)  # brightness, contrast, contrast first, saturation, hue, permutation
    brightness, contrast, saturation = (float(rng.uniform(a, b)) for a, b in ((0.875, 1.125), (0.5, 1.5), (0.5, 1.5)))
    hue, order = float(rng.uniform(-0.05, 0.05)), rng.permutation(3)
    on = gates < p
    if not on[[0, 1, 3, 4, 5]].any():
        return img
    out = img
    if on[0]:
        out = cv2.LUT(out, _table(_LEVELS * brightness))
    if on[1] and gates[2] < 0.5:
        out = _contrast(out, contrast)
    if on[3]:
        grey = cv2.cvtColor(cv2.cvtColor(out, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
        out = cv2.addWeighted(out, saturation, grey, 1.0 - saturation, 0.0)
    if on[4]:
        h, sat, val = cv2.split(cv2.cvtColor(out, cv2.COLOR_BGR2HSV))  # OpenCV's 8-bit hue lives in [0, 180)
        h = cv2.LUT(h, ((_LEVELS + round(hue * 180)) % 180).astype(np.uint8))
        out = cv2.cvtColor(cv2.merge((h, sat, val)), cv2.COLOR_HSV2BGR)
    if on[1] and gates[2] >= 0.5:
        out = _contrast(out, contrast)
    if on[5]:
        permuted = np.empty_like(out)
        cv2.mixChannels([out], [permuted], [int(v) for k in range(3) for v in (order[k], k)])
        out = permuted
    return out if out is not img else img.copy()


def _table(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def _contrast(img: np.ndarray, factor: float) -> np.ndarray:
    """Blend with the image's mean grey level (torchvision's adjust_contrast)."""
    mean = float(cv2.mean(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY))[0])
    return cv2.LUT(img, _table(_LEVELS * factor + mean * (1.0 - factor)))


@dataclass(frozen=True)
class ZoomCrop:
    """The rates of ``zoom_out_crop``: RandomZoomOut's probability and largest side ratio, RandomIoUCrop's
    probability, and the zoom-out canvas's fill (the recipes' 0, black)."""

    zoom_out: float = 0.5
    zoom_out_max: float = 4.0
    iou_crop: float = 0.8
    fill: int = 0


IOU_CROP_OPTIONS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)  # the least IoU with some box a crop must reach (1: no crop)
IOU_CROP_TRIALS = 40  # crops tried per drawn least IoU
IOU_CROP_ROUNDS = 50  # least IoUs drawn before giving up (torchvision draws until one fits)


def iou_crop_window(
    boxes: np.ndarray, wh: tuple[int, int], rng: np.random.Generator
) -> tuple[int, int, int, int] | None:
    """torchvision v2's RandomIoUCrop choice (SSD's): a crop (x1, y1, x2, y2) of a ``wh`` image of 0.3 to 1 of each
    side, aspect ratio 0.5 to 2, holding some box's centre and reaching the least IoU with some box drawn from
    ``IOU_CROP_OPTIONS``; None for no crop (the option 1, no boxes, or no crop found in ``IOU_CROP_ROUNDS``)."""
    if not len(boxes):
        return None
    w, h = wh
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    for _ in range(IOU_CROP_ROUNDS):
        least = IOU_CROP_OPTIONS[int(rng.integers(len(IOU_CROP_OPTIONS)))]
        if least >= 1.0:
            return None
        for _ in range(IOU_CROP_TRIALS):
            sw, sh = 0.3 + 0.7 * rng.random(2)
            new_w, new_h = int(w * sw), int(h * sh)
            if not (new_h and 0.5 <= new_w / new_h <= 2.0):
                continue
            fx, fy = rng.random(2)
            x1, y1 = int((w - new_w) * fx), int((h - new_h) * fy)
            x2, y2 = x1 + new_w, y1 + new_h
            if x1 == x2 or y1 == y2:
                continue
            inside = (x1 < centres[:, 0]) & (centres[:, 0] < x2) & (y1 < centres[:, 1]) & (centres[:, 1] < y2)
            if not inside.any():
                continue
            iw = (np.minimum(boxes[:, 2], x2) - np.maximum(boxes[:, 0], x1)).clip(0)
            ih = (np.minimum(boxes[:, 3], y2) - np.maximum(boxes[:, 1], y1)).clip(0)
            iou = iw * ih / (areas + new_w * new_h - iw * ih + 1e-12)
            if iou.max() >= least:
                return x1, y1, x2, y2
    return None


def zoom_out_crop(
    img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, rates: ZoomCrop, max_side: int
) -> tuple[np.ndarray, np.ndarray]:
    """RandomZoomOut then RandomIoUCrop (torchvision v2's, as the DETR recipes chain them) on a BGR image and its
    (n, 5) [cls, x1, y1, x2, y2] pixel labels.

    Zoom-out places the image at a random spot of a canvas 1 to ``zoom_out_max`` times its size filled with
    ``fill``; the crop keeps the boxes whose centre it holds, clipped to it, and drops the others and those under a
    pixel. Only the crop is made, at most ``max_side`` on its longer side (the training size: the letterbox after
    this would shrink it anyway), so a 4x canvas is never built in full. Returns new arrays; the draws are the same
    whatever the rates."""
    h, w = img.shape[:2]
    zoom_gate, ratio, fx, fy, crop_gate = rng.random(), rng.uniform(1.0, rates.zoom_out_max), *rng.random(3)
    left = top = 0
    canvas_w, canvas_h = w, h
    if zoom_gate < rates.zoom_out:
        canvas_w, canvas_h = int(w * ratio), int(h * ratio)
        left, top = int((canvas_w - w) * fx), int((canvas_h - h) * fy)
    boxes = labels[:, 1:5] + np.array([left, top, left, top], dtype=labels.dtype)
    window = iou_crop_window(boxes, (canvas_w, canvas_h), rng) if crop_gate < rates.iou_crop else None
    x1, y1, x2, y2 = window or (0, 0, canvas_w, canvas_h)
    if window is not None:
        centres = (boxes[:, :2] + boxes[:, 2:]) / 2
        kept = (x1 < centres[:, 0]) & (centres[:, 0] < x2) & (y1 < centres[:, 1]) & (centres[:, 1] < y2)
        labels, boxes = labels[kept], boxes[kept]
    boxes = boxes.astype(np.float64)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(x1, x2)
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(y1, y2)
    out, boxes = _render_window(img, (left, top), (x1, y1, x2, y2), boxes, rates.fill, max_side)
    out_labels = np.concatenate((labels[:, :1], boxes), 1).astype(labels.dtype)
    big_enough = ((boxes[:, 2] - boxes[:, 0]) >= 1) & ((boxes[:, 3] - boxes[:, 1]) >= 1)
    return out, out_labels[big_enough]


def _render_window(
    img: np.ndarray,
    origin: tuple[int, int],
    window: tuple[int, int, int, int],
    boxes: np.ndarray,
    fill: int,
    max_side: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``window`` (x1, y1, x2, y2) of a canvas filled with ``fill`` that holds ``img`` at ``origin``, shrunk to
    at most ``max_side`` on its longer side, and ``boxes`` (canvas pixels, on the image) moved onto it exactly as
    the image's pixels are."""
    x1, y1, x2, y2 = window
    h, w = img.shape[:2]
    gain = min(1.0, max_side / max(x2 - x1, y2 - y1))
    out = np.full((max(1, round((y2 - y1) * gain)), max(1, round((x2 - x1) * gain)), img.shape[2]), fill, np.uint8)
    ix1, iy1 = max(origin[0], x1), max(origin[1], y1)
    ix2, iy2 = min(origin[0] + w, x2), min(origin[1] + h, y2)
    px1, py1, px2, py2 = (round((v - o) * gain) for v, o in ((ix1, x1), (iy1, y1), (ix2, x1), (iy2, y1)))
    if ix2 <= ix1 or iy2 <= iy1 or px2 <= px1 or py2 <= py1:  # no pixel of the image shows: no box either
        return out, np.zeros((len(boxes), 4))
    part = img[iy1 - origin[1] : iy2 - origin[1], ix1 - origin[0] : ix2 - origin[0]]
    size = (px2 - px1, py2 - py1)
    out[py1:py2, px1:px2] = (
        part if part.shape[1::-1] == size else cv2.resize(part, size, interpolation=cv2.INTER_LINEAR)
    )
    scale = np.array([size[0] / (ix2 - ix1), size[1] / (iy2 - iy1)] * 2)
    return out, (boxes - np.array([ix1, iy1, ix1, iy1])) * scale + np.array([px1, py1, px1, py1])
