"""Decoding images (cv2: EXIF orientation honoured, 8-bit BGR out), parts of JPEGs, and fast header probing.

Decoding works on the encoded bytes, wherever they come from (a file, a tar shard); ``read_image`` and
``read_image_region`` are the file versions. ``probe_image`` gets an image's displayed size from its header
(JPEG, PNG, BMP), checks it against ``--max-pixels`` before any decoding, and then checks that the body decodes
in bounded memory (image_checks.py); files that look damaged or are in a rarer format are decoded whole. The
JPEG header parser here (frame size and EXIF orientation) is the project's only one.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import BinaryIO, cast

import cv2
import numpy as np

from utils.data.image_checks import ImageError, check_pixels, verify_body
from utils.data.jpeg_region import JpegRegionDecoder

__all__ = ["ImageError"]  # defined beside the checks that raise it, used by every caller of the probes here

JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_EXIF_ORIENTATION_TAG = 0x0112
_TAIL_BYTES = 64  # how far from the end of file an end marker may sit (some writers pad with zeros)


def _imdecode(data: np.ndarray) -> np.ndarray | None:
    if data.size == 0:
        return None
    try:
        # IMREAD_COLOR applies the EXIF orientation, drops alpha, expands grey and scales 16-bit to 8-bit.
        return cv2.imdecode(data, cv2.IMREAD_COLOR)
    except cv2.error:
        return None


def decode_image(data: np.ndarray) -> np.ndarray | None:
    """Decode encoded image bytes (uint8 array) to BGR uint8 HxWx3, or None when they cannot be decoded.

    A truncated JPEG is repaired in memory by appending the missing end-of-image marker (the missing
    part decodes as grey).
    """
    img = _imdecode(data)
    if img is None and data[:2].tobytes() == JPEG_SOI:
        img = _imdecode(np.concatenate((data, np.frombuffer(JPEG_EOI, np.uint8))))
    return img


def read_bytes(path: str) -> np.ndarray | None:
    """A file's bytes as a uint8 array (np.fromfile copes with non-ASCII paths), None when unreadable."""
    try:
        return np.fromfile(path, dtype=np.uint8)
    except OSError:
        return None


def read_image(path: str) -> np.ndarray | None:
    """``decode_image`` of a file; None when it cannot be read or decoded (the file is never modified)."""
    data = read_bytes(path)
    return None if data is None else decode_image(data)


def decode_image_region(
    data: np.ndarray,
    shape_hw: tuple[int, int],
    region: tuple[int, int, int, int],
    out: np.ndarray | None,
    decoder: JpegRegionDecoder | None,
) -> np.ndarray | None:
    """Pixels ``region`` (x1, y1, x2, y2) of an image of displayed size ``shape_hw``, as ``decode_image`` would
    give them, decoding only that part (into ``out`` when given); None where that cannot be done (no decoder,
    not a JPEG, an EXIF rotation, see ``JpegRegionDecoder.decode``): then decode the whole image."""
    if decoder is None or data[:2].tobytes() != JPEG_SOI:
        return None
    try:
        if jpeg_info(data)[2] != 1:  # the stored pixels are not the displayed ones
            return None
    except (ImageError, struct.error):
        return None
    return decoder.decode(data, shape_hw, region, out)


def read_image_region(
    path: str,
    shape_hw: tuple[int, int],
    region: tuple[int, int, int, int],
    out: np.ndarray | None = None,
    decoder: JpegRegionDecoder | None = None,
) -> np.ndarray | None:
    """``decode_image_region`` of a file."""
    data = read_bytes(path)
    return None if data is None else decode_image_region(data, shape_hw, region, out, decoder)


class _Reader:
    """Reads from the head of a file with a growing buffer (headers are usually < 64 KiB), or from bytes."""

    def __init__(self, f: BinaryIO | None = None, data: bytes = b""):
        self.f = f
        self.buf = f.read(8192) if f is not None else data

    def get(self, start: int, n: int) -> bytes:
        while len(self.buf) < start + n:
            more = self.f.read(max(65536, start + n - len(self.buf))) if self.f is not None else b""
            if not more:
                raise ImageError("unexpected end of file in header")
            self.buf += more
        return self.buf[start : start + n]


def _exif_orientation(tiff: bytes) -> int:
    """Orientation tag (1-8) from a TIFF-structured EXIF block; 1 when absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    endian = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(endian + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(endian + "H", tiff, ifd)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            break
        tag, kind = struct.unpack_from(endian + "HH", tiff, entry)
        if tag == _EXIF_ORIENTATION_TAG and kind == 3:  # SHORT
            (value,) = struct.unpack_from(endian + "H", tiff, entry + 8)
            return value if 1 <= value <= 8 else 1
    return 1


def _jpeg_header(r: _Reader) -> tuple[int, int, int]:
    """(width, height, EXIF orientation) of the stored pixels, from the JPEG markers before the first scan."""
    pos, orientation = 2, 1
    while True:
        marker = r.get(pos, 2)
        if marker[0] != 0xFF:
            raise ImageError("broken JPEG marker structure")
        kind = marker[1]
        if kind == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if kind in (0x01, *range(0xD0, 0xD8)):  # markers without a length field
            pos += 2
            continue
        if kind in (0xD9, 0xDA):
            raise ImageError("JPEG has no frame header")
        (length,) = struct.unpack(">H", r.get(pos + 2, 2))
        if length < 2:
            raise ImageError("broken JPEG segment length")
        if kind == 0xE1 and orientation == 1:
            segment = r.get(pos + 4, length - 2)
            if segment[:6] == b"Exif\x00\x00":
                orientation = _exif_orientation(segment[6:])
        elif kind in _JPEG_SOF:
            height, width = struct.unpack(">HH", r.get(pos + 5, 4))
            return width, height, orientation
        pos += 2 + length


def jpeg_info(data: np.ndarray | bytes) -> tuple[int, int, int]:
    """(stored width, stored height, EXIF orientation 1-8) of JPEG bytes; ImageError when the header is broken."""
    return _jpeg_header(_Reader(data=bytes(memoryview(cast(bytes, data))[:65536])))  # an array is a buffer too


def _png_header_size(head: bytes) -> tuple[int, int]:
    if len(head) < 24 or head[12:16] != b"IHDR":
        raise ImageError("PNG without IHDR header")
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _tail(f: BinaryIO) -> bytes:
    f.seek(0, 2)
    size = f.tell()
    f.seek(max(0, size - _TAIL_BYTES))
    return f.read()


def probe_image(path: str) -> tuple[tuple[int, int], str]:
    """Displayed (width, height) of an image and a warning ('' if none); raises ImageError if unusable.

    JPEG and PNG sizes come from the header (EXIF orientation applied); a file whose end marker is missing
    is decoded to decide: a truncated JPEG that decodes once repaired is kept with a warning.
    """
    try:
        with open(path, "rb") as f:
            return _probe(f, lambda: read_bytes(path))
    except OSError as e:
        raise ImageError(f"cannot read ({e})") from e


def probe_image_bytes(data: bytes) -> tuple[tuple[int, int], str]:
    """``probe_image`` of encoded bytes (a tar member, say)."""
    return _probe(io.BytesIO(data), lambda: np.frombuffer(data, np.uint8))


def _header_size(f: BinaryIO, head: bytes) -> tuple[str, int, int, bool]:
    """(kind, displayed width, height, end marker present) from the header; 0x0 where the format has no parser
    here. A BMP's size is read too, so that the pixel cap holds before it is decoded."""
    if head[:2] == JPEG_SOI:
        f.seek(0)
        width, height, orientation = _jpeg_header(_Reader(f))
        if orientation in (5, 6, 7, 8):  # rotated by 90 degrees on display
            width, height = height, width
        return "jpeg", width, height, JPEG_EOI in _tail(f)
    if head[:8] == PNG_SIGNATURE:
        width, height = _png_header_size(head)
        return "png", width, height, b"IEND" in _tail(f)
    if head[:2] == b"BM" and len(head) >= 26:
        (info_size,) = struct.unpack("<I", head[14:18])
        # the old OS/2 header keeps 16-bit sizes; every later one 32-bit signed (negative height: top-down rows)
        width, height = struct.unpack(
            "<HH" if info_size == 12 else "<ii", head[18:22] if info_size == 12 else head[18:26]
        )
        return "bmp", abs(width), abs(height), False
    return "", 0, 0, False


def check_image_size(path: str) -> None:
    """An ImageError when the file's header says it has more pixels than ``--max-pixels`` (nothing is decoded);
    detect.py asks before it reads an image whole."""
    try:
        with open(path, "rb") as f:
            _, width, height, _ = _header_size(f, f.read(32))
    except (OSError, struct.error) as e:
        raise ImageError(f"cannot read ({e})") from e
    check_pixels(width, height)


def _probe(f: BinaryIO, read_all: Callable[[], np.ndarray | None]) -> tuple[tuple[int, int], str]:
    try:
        head = f.read(32)
        kind, width, height, complete = _header_size(f, head)
    except (OSError, struct.error) as e:
        raise ImageError(f"cannot read ({e})") from e
    check_pixels(width, height)  # before a byte of pixels is decoded: the header's claim allocates nothing

    warning = ""
    data = read_all()
    if data is None:
        raise ImageError("cannot read")
    if data.size == 0:
        raise ImageError("empty file")
    if complete:  # an intact header and end marker: the body may still not decode (checked in bounded memory)
        verify_body(kind, data)
    else:  # unknown format or a missing end marker: decode to be sure
        img = _imdecode(data)
        if img is None and kind == "jpeg":
            img = decode_image(data)
            if img is not None:
                warning = "truncated JPEG, repaired in memory when read"
        if img is None:
            raise ImageError("cannot decode image")
        height, width = img.shape[:2]
        check_pixels(width, height)  # a format whose header is not parsed here (cv2 caps its own decoding)
    if width < 10 or height < 10:
        raise ImageError(f"image size {width}x{height} is below 10 pixels")
    return (width, height), warning
