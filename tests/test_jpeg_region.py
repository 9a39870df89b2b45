"""Partial JPEG decoding: the pixels of a region equal that crop of a whole OpenCV decode, or None (fall back)."""

from __future__ import annotations

import io
import logging
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import utils.data.jpeg_region as jpeg_region
from utils.data.image_io import decode_image_region, read_image, read_image_region
from utils.data.jpeg_region import JpegRegionDecoder, load_decoder


@pytest.fixture(scope="module")
def decoder() -> JpegRegionDecoder:
    """The compiled decoder; only the tests that take it are skipped where it cannot be built."""
    built = load_decoder()
    if built is None:
        pytest.skip("the partial JPEG decoder cannot be built here (no C compiler or libjpeg headers)")
    return built


@pytest.fixture
def fresh_state(monkeypatch):
    """A process that has not loaded the decoder yet."""
    monkeypatch.setattr(jpeg_region, "_state", {})


def textured(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth colour gradients plus noise: every 8x8 block and chroma sample differs."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    return np.clip(img + rng.integers(-40, 40, img.shape), 0, 255).astype(np.uint8)


def encode(img: np.ndarray, *params: int) -> np.ndarray:
    ok, buf = cv2.imencode(".jpg", img, list(params))
    assert ok
    return buf.reshape(-1)


def random_regions(h: int, w: int, rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    regions = [(0, 0, w, h), (w - 1, h - 1, w, h), (0, 0, 1, 1), (w // 2, 0, w, h // 3)]
    for _ in range(n):
        x1, x2 = sorted(int(v) for v in rng.choice(w + 1, 2, replace=False))
        y1, y2 = sorted(int(v) for v in rng.choice(h + 1, 2, replace=False))
        regions.append((x1, y1, x2, y2))
    return regions


ENCODINGS = {
    "4:2:0": (cv2.IMWRITE_JPEG_QUALITY, 95),
    "4:4:4": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444),
    "4:2:2": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422),
    "4:1:1": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411),
    "progressive": (cv2.IMWRITE_JPEG_PROGRESSIVE, 1),
    "restart markers": (cv2.IMWRITE_JPEG_RST_INTERVAL, 3),
    "optimized": (cv2.IMWRITE_JPEG_OPTIMIZE, 1, cv2.IMWRITE_JPEG_QUALITY, 60),
}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.parametrize("h, w", [(48, 64), (37, 53), (121, 17), (480, 640)])
def test_region_equals_crop_of_whole_decode(decoder, encoding: str, h: int, w: int) -> None:
    data = encode(textured(h, w, seed=h * w), *ENCODINGS[encoding])
    whole = cv2.imdecode(data, cv2.IMREAD_COLOR)
    rng = np.random.default_rng(h + w)
    for x1, y1, x2, y2 in random_regions(h, w, rng, 20):
        part = decode_image_region(data, (h, w), (x1, y1, x2, y2), None, decoder)
        assert part is not None and part.shape == (y2 - y1, x2 - x1, 3)
        assert np.array_equal(part, whole[y1:y2, x1:x2]), (encoding, (x1, y1, x2, y2))


def test_greyscale_jpeg_comes_out_as_three_equal_channels(decoder) -> None:
    grey = textured(40, 56, 1)[..., 0]
    data = encode(grey)
    part = decode_image_region(data, (40, 56), (5, 7, 50, 33), None, decoder)
    assert part is not None and np.array_equal(part, cv2.imdecode(data, cv2.IMREAD_COLOR)[7:33, 5:50])


def with_exif_orientation(data: np.ndarray, orientation: int) -> np.ndarray:
    """The JPEG with an EXIF APP1 segment (one IFD entry: Orientation) right after SOI."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    payload = b"Exif\x00\x00" + tiff
    app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    raw = data.tobytes()
    return np.frombuffer(raw[:2] + app1 + raw[2:], np.uint8)


def test_exif_orientation_other_than_1_falls_back(decoder) -> None:
    data = encode(textured(32, 32, 2))  # square: a rotation keeps the size, only the EXIF tag tells
    upright = with_exif_orientation(data, 1)
    part = decode_image_region(upright, (32, 32), (0, 0, 32, 32), None, decoder)
    assert part is not None and np.array_equal(part, cv2.imdecode(upright, cv2.IMREAD_COLOR))
    for orientation in (3, 6, 8):
        rotated = with_exif_orientation(data, orientation)
        assert not np.array_equal(cv2.imdecode(rotated, cv2.IMREAD_COLOR), cv2.imdecode(data, cv2.IMREAD_COLOR))
        assert decode_image_region(rotated, (32, 32), (0, 0, 32, 32), None, decoder) is None


def test_unsupported_or_damaged_input_falls_back(decoder) -> None:
    img = textured(64, 80, 3)
    data = encode(img)

    def region(d: np.ndarray, shape_hw: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray | None:
        return decode_image_region(d, shape_hw, box, None, decoder)

    assert region(data, (64, 81), (0, 0, 10, 10)) is None  # not the size it was verified at
    assert region(data, (64, 80), (0, 0, 81, 10)) is None  # region outside the image
    assert region(data, (64, 80), (5, 5, 5, 10)) is None  # empty region
    png = np.frombuffer(cv2.imencode(".png", img)[1].tobytes(), np.uint8)
    assert region(png, (64, 80), (0, 0, 10, 10)) is None
    cmyk = io.BytesIO()
    Image.fromarray(img).convert("CMYK").save(cmyk, "JPEG")
    cmyk_data = np.frombuffer(cmyk.getvalue(), np.uint8)
    assert cv2.imdecode(cmyk_data, cv2.IMREAD_COLOR) is not None  # OpenCV reads it: the caller falls back to it
    assert region(cmyk_data, (64, 80), (0, 0, 10, 10)) is None
    truncated = data[: len(data) // 2]
    assert region(truncated, (64, 80), (0, 50, 80, 64)) is None  # the rows asked for are missing
    garbage = data.copy()
    garbage[len(data) // 3 : len(data) // 3 + 64] = 0xFF  # not a valid marker sequence inside the scan
    assert region(garbage, (64, 80), (0, 0, 80, 64)) is None


def test_read_image_region_matches_read_image(decoder, tmp_path) -> None:
    path = tmp_path / "a.jpg"
    cv2.imwrite(str(path), textured(50, 70, 4))
    part = read_image_region(str(path), (50, 70), (10, 20, 60, 45), None, decoder)
    assert part is not None and np.array_equal(part, read_image(str(path))[20:45, 10:60])
    png = tmp_path / "b.png"
    cv2.imwrite(str(png), textured(50, 70, 4))
    assert read_image_region(str(png), (50, 70), (0, 0, 5, 5), None, decoder) is None
    assert read_image_region(str(tmp_path / "missing.jpg"), (50, 70), (0, 0, 5, 5), None, decoder) is None


def test_without_a_decoder_every_region_read_falls_back(tmp_path) -> None:
    path = tmp_path / "a.jpg"  # needs no compiler: callers must get None and decode the whole image
    cv2.imwrite(str(path), textured(50, 70, 4))
    assert read_image_region(str(path), (50, 70), (10, 20, 60, 45)) is None
    assert decode_image_region(encode(textured(16, 16, 1)), (16, 16), (0, 0, 16, 16), None, None) is None


def test_threads_decode_at_once(decoder) -> None:
    files = [encode(textured(96, 128, s)) for s in range(8)]
    expected = [cv2.imdecode(d, cv2.IMREAD_COLOR)[10:90, 3:120] for d in files]
    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(lambda d: decoder.decode(d, (96, 128), (3, 10, 120, 90)), files * 4))
    assert all(np.array_equal(p, e) for p, e in zip(parts, expected * 4))


def test_without_a_compiler_it_falls_back_and_says_so_once(fresh_state, monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(jpeg_region, "BUILD_DIR", tmp_path / "build")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(logging.getLogger("yolo"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="yolo"):
        assert load_decoder() is None
        assert load_decoder() is None
    assert sum("partial JPEG decoding unavailable" in r.getMessage() for r in caplog.records) == 1


def test_build_is_atomic_reused_and_logged(decoder, fresh_state, monkeypatch, tmp_path, caplog) -> None:
    first, compiled = jpeg_region._build(jpeg_region.SOURCE, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert compiled and jpeg_region._build(jpeg_region.SOURCE, tmp_path) == (first, False)
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind
    monkeypatch.setattr(jpeg_region, "BUILD_DIR", tmp_path / "fresh")
    monkeypatch.setattr(logging.getLogger("yolo"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="yolo"):
        assert load_decoder() is not None  # compiled now, and says so
    assert any("partial JPEG decoding: compiled" in r.getMessage() for r in caplog.records)


def test_a_decoder_that_disagrees_with_opencv_is_not_used(fresh_state, monkeypatch, caplog) -> None:
    monkeypatch.setattr(jpeg_region, "agrees_with_opencv", lambda decoder: False)
    monkeypatch.setattr(jpeg_region, "_build", lambda source, build_dir: (tmp_library(build_dir), False))
    monkeypatch.setattr(jpeg_region, "JpegRegionDecoder", lambda library: object())
    monkeypatch.setattr(logging.getLogger("yolo"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="yolo"):
        assert load_decoder() is None
    assert any("other than OpenCV's" in r.getMessage() for r in caplog.records)


def tmp_library(build_dir: Path) -> Path:
    return Path(build_dir) / "jpeg_region-test.so"


def test_self_check_passes_with_the_real_decoder(decoder) -> None:
    assert jpeg_region.agrees_with_opencv(decoder)


def test_the_decoder_pickles_as_its_library(decoder) -> None:
    clone = pickle.loads(pickle.dumps(decoder))  # spawned DataLoader workers get it this way
    data = encode(textured(24, 24, 7))
    assert np.array_equal(clone.decode(data, (24, 24), (2, 3, 20, 21)), decoder.decode(data, (24, 24), (2, 3, 20, 21)))


def test_malformed_exif_is_never_read_past_its_end(decoder) -> None:
    data = encode(textured(24, 24, 6))
    whole = cv2.imdecode(data, cv2.IMREAD_COLOR)
    raw = data.tobytes()
    payloads = [
        b"Exif\x00\x00MM\x00\x2a",  # header cut short
        b"Exif\x00\x00MM\x00\x2a\xff\xff\xff\xfe",  # IFD offset near 2**32
        b"Exif\x00\x00II\x2a\x00\x08\x00\x00\x00\x05\x00",  # 5 entries announced, none there
        b"Exif\x00\x00XX\x00\x2a\x00\x00\x00\x08",  # unknown byte order
    ]
    for payload in payloads:
        app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
        damaged = np.frombuffer(raw[:2] + app1 + raw[2:], np.uint8)
        part = decode_image_region(damaged, (24, 24), (0, 0, 24, 24), None, decoder)
        assert part is None or np.array_equal(part, whole)  # falls back, or the orientation was clearly absent
