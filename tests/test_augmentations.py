"""Tests for utils/augmentations.py on generated images: boxes must stay on their pixels."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from utils.boxes import xywhn2xyxy, xyxy2xywhn
from utils.data.augmentations import (
    Warp,
    augment_hsv,
    box_candidates,
    letterbox,
    linear_resize_source_span,
    mixup,
    mosaic4,
    paste_region,
    random_flips,
    random_perspective,
    resize_to_long_side,
    warped_mosaic4,
)

# Saturated colours: blending any of them with the dark noise background or the grey fill can only
# ever come close (all channels within COLOUR_TOL) to the colour itself, never to another one.
PALETTE = np.array(
    [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255), (0, 255, 255), (255, 255, 255)],
    dtype=np.int16,
)
COLOUR_TOL = 30
NOISE_MAX = 60


def noise_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    return rng.integers(0, NOISE_MAX + 1, (h, w, 3), dtype=np.uint8)


def draw_rects(img: np.ndarray, classes: list[int], rng: np.random.Generator) -> np.ndarray:
    """Draw one filled rectangle per class in side-by-side strips; returns (n, 5) [cls, x1, y1, x2, y2] px."""
    h, w = img.shape[:2]
    strip = w // len(classes)
    labels = []
    for k, cls in enumerate(classes):
        bw = int(rng.integers(strip // 3, strip * 2 // 3))
        bh = int(rng.integers(h // 4, h * 2 // 3))
        x1 = k * strip + int(rng.integers(2, strip - bw - 1))
        y1 = int(rng.integers(2, h - bh - 1))
        img[y1 : y1 + bh, x1 : x1 + bw] = PALETTE[cls]
        labels.append((cls, x1, y1, x1 + bw, y1 + bh))
    return np.array(labels, dtype=np.float32)


def colour_bbox(img: np.ndarray, cls: int) -> np.ndarray | None:
    """Edge-coordinate bounding box (x1, y1, x2, y2) of the pixels showing the colour of ``cls``."""
    mask = np.all(np.abs(img.astype(np.int16) - PALETTE[cls]) <= COLOUR_TOL, axis=2)
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=np.float64)


def make_mosaic_inputs(seed: int, imgsz: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """4 noise images with long side ``imgsz`` and 7 coloured rectangles spread over them."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for classes in ([0, 1], [2, 3], [4, 5], [6]):
        short = int(rng.integers(imgsz // 2, imgsz + 1))
        h, w = (imgsz, short) if rng.random() < 0.5 else (short, imgsz)
        img = noise_image(rng, h, w)
        px = draw_rects(img, classes, rng)
        norm = px.copy()
        norm[:, 1:] = xyxy2xywhn(px[:, 1:], w, h)
        images.append(img)
        labels.append(norm)
    return images, labels


def assert_boxes_on_colours(img: np.ndarray, labels: np.ndarray, tol: float) -> None:
    assert len(np.unique(labels[:, 0])) == len(labels), "each colour was drawn once"
    for cls, *box in labels:
        region = colour_bbox(img, int(cls))
        assert region is not None, f"class {cls}: box {box} kept but its colour is gone"
        np.testing.assert_allclose(box, region, atol=tol, err_msg=f"class {int(cls)}")


# ---------------------------------------------------------------- letterbox / resize


def test_letterbox_shape_ratio_and_pad() -> None:
    img = np.zeros((60, 100, 3), dtype=np.uint8)
    out, ratio, pad = letterbox(img, 128)
    assert out.shape == (128, 128, 3)
    assert ratio == pytest.approx((128 / 100, 77 / 60))
    assert pad == (0.0, 25.0)  # 51 rows of padding: 25 on top, 26 below
    assert (out[:25] == 114).all() and (out[25 + 77 :] == 114).all() and (out[25 : 25 + 77] == 0).all()

    out, ratio, pad = letterbox(img, 128, auto=True, stride=32)
    assert out.shape == (96, 128, 3)  # 77 rows padded only up to the next multiple of 32
    assert pad == (0.0, 9.0)

    out, ratio, pad = letterbox(img, (96, 160))
    assert out.shape == (96, 160, 3)
    assert ratio == pytest.approx((1.6, 1.6)) and pad == (0.0, 0.0)

    out, ratio, pad = letterbox(img, 640, scaleup=False)
    assert out.shape == (640, 640, 3)
    assert ratio == (1.0, 1.0) and pad == (270.0, 290.0)
    assert (out[290:350, 270:370] == 0).all()


@pytest.mark.parametrize("new_shape", [64, 128, 200, (96, 160)])
def test_letterbox_box_lands_on_its_pixels(new_shape: int | tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    img = noise_image(rng, 73, 111)
    labels = draw_rects(img, [3, 4], rng)
    out, (rw, rh), (pw, ph) = letterbox(img, new_shape)
    for cls, x1, y1, x2, y2 in labels:
        mapped = np.array([x1 * rw + pw, y1 * rh + ph, x2 * rw + pw, y2 * rh + ph])
        # Upscaling blurs each edge over about ``ratio`` pixels, moving the colour threshold with it.
        np.testing.assert_allclose(mapped, colour_bbox(out, int(cls)), atol=max(1.0, rw, rh))


def test_resize_to_long_side() -> None:
    img = np.zeros((300, 200, 3), dtype=np.uint8)
    for augment in (False, True):
        out, (h0, w0), (h, w) = resize_to_long_side(img, 160, augment)
        assert out.shape == (160, 107, 3) and (h0, w0) == (300, 200) and (h, w) == (160, 107)
    out, _, (h, w) = resize_to_long_side(img, 600)
    assert out.shape == (600, 400, 3) and (h, w) == (600, 400)
    out, _, _ = resize_to_long_side(img, 300)
    assert out is img


# ---------------------------------------------------------------- mosaic + perspective alignment


def test_mosaic4_places_images_and_boxes_exactly() -> None:
    imgsz = 96
    for seed in range(5):
        images, labels = make_mosaic_inputs(seed, imgsz)
        canvas, out = mosaic4(images, labels, imgsz, np.random.default_rng(seed))
        assert canvas.shape == (2 * imgsz, 2 * imgsz, 3) and canvas.dtype == np.uint8
        assert out.shape[1] == 5 and out[:, 1:].min() >= 0 and out[:, 1:].max() <= 2 * imgsz
        assert sorted(out[:, 0]) == list(range(7))
        # Clipped boxes may keep a zero-size sliver; every visible rectangle must match to rounding.
        visible = (out[:, 3] > out[:, 1]) & (out[:, 4] > out[:, 2])
        assert_boxes_on_colours(canvas, out[visible], tol=1e-3)


def test_mosaic4_centre_range_and_fill() -> None:
    imgsz = 64
    # Image k is filled with k + 1 so each quadrant can be told apart.
    images = [np.full((64, 48 + 8 * k, 3), k + 1, np.uint8) for k in range(4)]
    labels = [np.zeros((0, 5), np.float32)] * 4
    centres = set()
    for seed in range(20):
        canvas, out = mosaic4(images, labels, imgsz, np.random.default_rng(seed))
        assert out.shape == (0, 5)
        # Image 3 (bottom-right) has its top-left corner on the centre; image 0 ends there.
        ys, xs = np.nonzero(canvas[..., 0] == 4)
        xc, yc = xs.min(), ys.min()
        assert 32 <= xc <= 96 and 32 <= yc <= 96
        assert canvas[yc - 1, xc - 1, 0] == 1 and canvas[yc - 1, xc, 0] == 2 and canvas[yc, xc - 1, 0] == 3
        for k, (h, w) in enumerate(img.shape[:2] for img in images):
            left, top = (xc - w if k in (0, 2) else xc), (yc - h if k in (0, 1) else yc)
            visible = (min(left + w, 128) - max(left, 0)) * (min(top + h, 128) - max(top, 0))
            assert (canvas[..., 0] == k + 1).sum() == visible
        assert (canvas[..., 0] > 4).sum() == (canvas == 114).all(axis=2).sum()
        centres.add((xc, yc))
    assert len(centres) > 15


def mosaic_then_perspective(seed: int, imgsz: int, **kwargs: float) -> tuple[np.ndarray, np.ndarray]:
    images, labels = make_mosaic_inputs(seed, imgsz)
    rng = np.random.default_rng([seed, 1])
    canvas, boxes = mosaic4(images, labels, imgsz, rng)
    return random_perspective(canvas, boxes, rng, border=(-imgsz // 2, -imgsz // 2), **kwargs)


@pytest.mark.parametrize(
    "params",
    [
        {"degrees": 0, "translate": 0.1, "scale": 0.5, "shear": 0, "perspective": 0},
        {"degrees": 20, "translate": 0.1, "scale": 0.3, "shear": 5, "perspective": 0.0005},
        {"degrees": 45, "translate": 0.3, "scale": 0.9, "shear": 10, "perspective": 0.001},
    ],
)
def test_warped_mosaic_equals_mosaic_then_perspective_and_skips_hidden_tiles(params: dict) -> None:
    skipped = 0
    for seed in range(60):
        imgsz = (64, 96, 128)[seed % 3]
        images, labels = make_mosaic_inputs(seed, imgsz)
        expected_img, expected_labels = mosaic_then_perspective(seed, imgsz, **params)
        loaded: list[int] = []

        def load(k: int, region: tuple[int, int, int, int], out: np.ndarray) -> None:
            loaded.append(k)
            paste_region(images[k], region, out)

        img, out = warped_mosaic4(
            load, [im.shape[:2] for im in images], labels, imgsz, np.random.default_rng([seed, 1]), Warp(**params)
        )
        assert np.array_equal(out, expected_labels)
        # Same warp from a crop of the canvas: only fixed-point rounding of a few interpolated values differs.
        diff = np.abs(img.astype(np.int16) - expected_img)
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        assert len(set(loaded)) == len(loaded)
        for k in set(range(4)) - set(loaded):  # a tile not loaded must not show: no pixel of its colours
            for cls in labels[k][:, 0].astype(int):
                assert colour_bbox(img, cls) is None
        skipped += 4 - len(loaded)
    assert skipped > 0


def test_warped_mosaic_rejects_a_tile_smaller_than_its_shape() -> None:
    images, labels = make_mosaic_inputs(0, 64)
    shapes = [im.shape[:2] for im in images]

    def load_short_tile(k: int, region: tuple[int, int, int, int], out: np.ndarray) -> None:
        paste_region(images[k][:-20], region, out)  # 20 rows fewer than announced

    with pytest.raises(ValueError, match="tile"):
        warped_mosaic4(
            load_short_tile,
            shapes,
            labels,
            64,
            np.random.default_rng(0),
            Warp(degrees=0, translate=0, scale=0, shear=0),
        )


def test_mosaic_perspective_keeps_boxes_on_pixels_without_rotation() -> None:
    imgsz, survivors = 128, 0
    for seed in range(12):
        img, out = mosaic_then_perspective(seed, imgsz, degrees=0, translate=0.1, scale=0.5, shear=0)
        assert img.shape == (imgsz, imgsz, 3)
        assert out[:, 1:].min() >= 0 and out[:, 1:].max() <= imgsz
        assert_boxes_on_colours(img, out, tol=1.5)
        for cls, x1, y1, x2, y2 in out:
            # Away from the blurred edges the inside of each box is exactly its colour.
            inner = img[int(y1) + 2 : int(np.ceil(y2)) - 2, int(x1) + 2 : int(np.ceil(x2)) - 2]
            if inner.size:
                np.testing.assert_allclose(inner.reshape(-1, 3).mean(0), PALETTE[int(cls)], atol=3)
        survivors += len(out)
    assert survivors >= 20  # the check above must not be vacuous


def test_mosaic_perspective_keeps_boxes_on_pixels_with_rotation_shear_perspective() -> None:
    imgsz, survivors = 128, 0
    for seed in range(24):
        img, out = mosaic_then_perspective(
            seed, imgsz, degrees=20, translate=0.1, scale=0.3, shear=5, perspective=0.0005
        )
        # The enclosing box of a warped rectangle is still the bounding box of its pixels (only the
        # blurred tips of sharp corners may fall under the colour threshold) unless the border cut
        # a corner off: then the box is clipped corners, larger than the visible part, but covers it.
        inside = (out[:, 1:3] > 0).all(1) & (out[:, 3] < imgsz) & (out[:, 4] < imgsz)
        assert_boxes_on_colours(img, out[inside], tol=2.5)
        for cls, *box in out[~inside]:
            region = colour_bbox(img, int(cls))
            assert region is not None
            box = np.array(box)
            assert (region[:2] >= box[:2] - 2.5).all() and (region[2:] <= box[2:] + 2.5).all()
        survivors += inside.sum()
    assert survivors >= 15


def test_random_perspective_image_and_boxes_share_geometry_to_subpixel() -> None:
    # Bilinear warps reproduce a linear ramp exactly, so a float image whose value is 4 * (pixel
    # index) reveals where every output pixel was sampled from. The affine map read off the
    # returned box must predict those positions (edge coordinates: pixel i spans [i, i + 1)).
    h, w = 64, 96
    ramp = np.zeros((h, w, 3), np.float32)
    ramp[..., 0] = 4 * np.arange(w)[None, :]
    ramp[..., 1] = 4 * np.arange(h)[:, None]
    box = np.array([[0, 30, 20, 60, 44]], np.float32)
    for seed in range(10):
        out, labels = random_perspective(
            ramp, box, np.random.default_rng(seed), degrees=0, translate=0.1, scale=0.4, shear=0
        )
        assert len(labels) == 1
        _, x1, y1, x2, y2 = labels[0]
        for axis, (a1, a2, b1, b2, size) in enumerate([(x1, x2, 30, 60, w), (y1, y2, 20, 44, h)]):
            gain = (a2 - a1) / (b2 - b1)
            offset = a1 - gain * b1
            centres = np.arange(out.shape[1 - axis]) + 0.5
            source = (centres - offset) / gain - 0.5  # source pixel-centre coordinate
            valid = (source > 0.5) & (source < size - 1.5)
            line = out[h // 2, :, 0] if axis == 0 else out[:, w // 2, 1]
            np.testing.assert_allclose(line[valid], 4 * source[valid], atol=0.02)


def test_random_perspective_zoom_does_not_drop_shrunk_boxes() -> None:
    # A box well inside the image shrinks with the zoom but keeps all of its (scaled) area.
    img = np.zeros((200, 200, 3), np.uint8)
    box = np.array([[0, 70, 70, 130, 130]], np.float32)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        _, out = random_perspective(img, box, rng, degrees=0, translate=0, scale=0.8, shear=0)
        assert len(out) == 1


def test_random_perspective_identity_and_empty_labels() -> None:
    rng = np.random.default_rng(3)
    img = noise_image(rng, 50, 70)
    labels = np.array([[1, 5, 6, 30, 40]], dtype=np.float32)
    out, out_labels = random_perspective(img, labels, rng, degrees=0, translate=0, scale=0, shear=0)
    assert np.array_equal(out, img) and np.array_equal(out_labels, labels)

    out, out_labels = random_perspective(img, np.zeros((0, 5), np.float32), rng, border=(-10, 5))
    assert out.shape == (30, 80, 3) and out_labels.shape == (0, 5)


def test_random_perspective_drops_boxes_pushed_out() -> None:
    # A big translation pushes the small box in the corner out of the output; the big one survives.
    img = np.zeros((100, 100, 3), dtype=np.uint8)
    labels = np.array([[0, 0, 0, 10, 10], [1, 20, 20, 90, 90]], dtype=np.float32)
    _, out = random_perspective(
        img, labels, np.random.default_rng(0), degrees=0, translate=0.3, scale=0, shear=0, border=(-20, -20)
    )
    assert 1 in out[:, 0]
    for _cls, x1, y1, x2, y2 in out:
        assert x2 - x1 > 2 and y2 - y1 > 2


# ---------------------------------------------------------------- flips


@pytest.mark.parametrize("flipud,fliplr", [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_flips_keep_boxes_aligned(flipud: float, fliplr: float) -> None:
    rng = np.random.default_rng(5)
    img = noise_image(rng, 64, 90)
    px = draw_rects(img, [0, 5], rng)
    labels = px.copy()
    labels[:, 1:] = xyxy2xywhn(px[:, 1:], 90, 64)
    out, out_labels = random_flips(img, labels, rng, flipud=flipud, fliplr=fliplr)
    assert out.flags.c_contiguous and out.shape == img.shape
    assert not np.array_equal(out_labels, labels)
    boxes = out_labels.copy()
    boxes[:, 1:] = xywhn2xyxy(out_labels[:, 1:], 90, 64)
    assert_boxes_on_colours(out, boxes, tol=1e-3)


def test_flips_with_zero_probability_change_nothing() -> None:
    img = noise_image(np.random.default_rng(0), 20, 30)
    labels = np.array([[0, 0.2, 0.3, 0.1, 0.1]], dtype=np.float32)
    out, out_labels = random_flips(img, labels, np.random.default_rng(0), flipud=0.0, fliplr=0.0)
    assert out is img and np.array_equal(out_labels, labels) and out_labels is not labels


# ---------------------------------------------------------------- HSV


def test_hsv_zero_gains_is_identity() -> None:
    img = noise_image(np.random.default_rng(0), 32, 32) * 4
    before = img.copy()
    rng = np.random.default_rng(1)
    out = augment_hsv(img, rng, 0, 0, 0)
    assert np.array_equal(out, before)
    assert rng.random() == np.random.default_rng(1).random()  # nothing was drawn


def test_hsv_changes_colours_in_place_and_keeps_grey_grey() -> None:
    colourful = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    before = colourful.copy()
    out = augment_hsv(colourful, np.random.default_rng(2), 0.5, 0.7, 0.4)
    assert out is colourful and not np.array_equal(out, before)

    grey = np.repeat(np.arange(0, 256, 4, dtype=np.uint8)[:, None, None], 3, axis=2)
    out = augment_hsv(grey.copy(), np.random.default_rng(2), 0.5, 0.7, 0.4)
    # Zero saturation stays zero whatever the gains: only the brightness may move.
    assert (out.max(axis=2).astype(int) - out.min(axis=2) <= 1).all()
    assert not np.array_equal(out, grey)


# ---------------------------------------------------------------- box_candidates, mixup


def test_box_candidates() -> None:
    before = np.array([[0, 0, 100, 100], [0, 0, 2, 50], [0, 0, 500, 4], [0, 0, 100, 100], [0, 0, 100, 100]], np.float32)
    after = np.array(
        [[10, 10, 90, 90], [0, 0, 2, 50], [0, 0, 500, 4], [0, 0, 100, 9], [0, 0, 100, 11]], dtype=np.float32
    )
    # kept, too narrow (2 px), too thin (aspect 125), mostly cropped (9 %), enough left (11 %)
    assert box_candidates(before, after).tolist() == [True, False, False, False, True]
    assert box_candidates(before, after, area_thr=0.05).tolist() == [True, False, False, True, True]


def test_mixup_blends_and_concatenates() -> None:
    img1, img2 = np.full((8, 8, 3), 200, np.uint8), np.zeros((8, 8, 3), np.uint8)
    l1 = np.array([[0, 0.5, 0.5, 0.2, 0.2]], np.float32)
    l2 = np.array([[3, 0.1, 0.1, 0.1, 0.1]] * 2, np.float32)
    img, labels = mixup(img1, l1, img2, l2, np.random.default_rng(0))
    assert img.shape == img1.shape and img.dtype == np.uint8
    assert np.array_equal(labels, np.concatenate((l1, l2)))
    assert len(np.unique(img)) == 1 and 40 < img[0, 0, 0] < 160  # Beta(32, 32) stays near 0.5
    with pytest.raises(ValueError):
        mixup(img1, l1, img2[:4], l2, np.random.default_rng(0))


# ---------------------------------------------------------------- determinism


def full_pipeline(seed: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = make_mosaic_inputs(0, 96)  # same inputs; only the augmentation seed varies
    rng = np.random.default_rng([seed, 0, 7])
    img, boxes = mosaic4(images, labels, 96, rng)
    img, boxes = random_perspective(img, boxes, rng, degrees=5, translate=0.1, scale=0.5, shear=2, border=(-48, -48))
    augment_hsv(img, rng, 0.015, 0.7, 0.4)
    norm = boxes.copy()
    norm[:, 1:] = xyxy2xywhn(boxes[:, 1:], 96, 96)
    img, norm = random_flips(img, norm, rng, flipud=0.5, fliplr=0.5)
    if len(norm):
        img, norm = mixup(img, norm, img[::-1].copy(), norm, rng)
    return img, norm


def test_same_seed_same_output_different_seed_differs() -> None:
    img_a, lab_a = full_pipeline(1)
    img_b, lab_b = full_pipeline(1)
    img_c, lab_c = full_pipeline(2)
    assert np.array_equal(img_a, img_b) and np.array_equal(lab_a, lab_b)
    assert not np.array_equal(img_a, img_c)
    assert lab_a.shape != lab_c.shape or not np.allclose(lab_a, lab_c)


@pytest.mark.parametrize("n_src, n_dst", [(100, 64), (128, 64), (40, 64), (4000, 640), (641, 640), (333, 640)])
def test_linear_resize_reads_only_the_source_span(n_src: int, n_dst: int) -> None:
    rng = np.random.default_rng(n_src)
    img = rng.integers(0, 256, (n_src, 7, 3), dtype=np.uint8)
    whole = cv2.resize(img, (7, n_dst), interpolation=cv2.INTER_LINEAR)
    for _ in range(30):
        start, stop = sorted(int(v) for v in rng.choice(n_dst + 1, 2, replace=False))
        a, b = linear_resize_source_span(start, stop, n_src, n_dst)
        scrambled = rng.integers(0, 256, img.shape, dtype=np.uint8)
        scrambled[a:b] = img[a:b]  # only the span is the real image
        part = cv2.resize(scrambled, (7, n_dst), interpolation=cv2.INTER_LINEAR)[start:stop]
        assert np.array_equal(part, whole[start:stop]), (start, stop, a, b)
        assert b - a <= (stop - start) * max(1.0, n_src / n_dst) + 2 * max(2.0, n_src / n_dst) + 4  # not just all of it
