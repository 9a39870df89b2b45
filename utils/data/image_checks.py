"""What a probe checks beyond an image's header: that its pixels fit ``--max-pixels``, and that its body decodes.

A header is a claim: 23 bytes can say 65535x65535, and a file with an intact header and end marker can hold a
body no decoder reads. Nothing allocates from the claim: the pixel count is checked against the cap before any
decoding, and the body is verified in bounded memory (a JPEG decoded at 1/8 scale; a PNG's compressed stream
inflated piece by piece and thrown away), so an image that would fail at every read is dropped once, at probe
time, and counted with the other corrupt images.
"""

from __future__ import annotations

import os
import struct
import zlib

import cv2
import numpy as np

from utils.cli import MAX_PIXELS, MAX_PIXELS_ENV

_INFLATE_PIECE = 1 << 20  # bytes of raw scanlines held at once while a PNG is verified
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


class ImageError(ValueError):
    """The file is not a usable image (unreadable, over the pixel cap, undecodable); the message says why."""


def max_pixels() -> int:
    """The cap in force: ``--max-pixels`` as the script set it for this process and its children, else 2**28."""
    try:
        return int(os.environ.get(MAX_PIXELS_ENV, MAX_PIXELS))
    except ValueError:
        return MAX_PIXELS


def check_pixels(width: int, height: int) -> None:
    """An error when ``width`` x ``height`` is over the cap (checked before anything is decoded)."""
    cap = max_pixels()
    if width * height > cap:
        raise ImageError(f"image size {width}x{height} is over --max-pixels {cap}: skipped, not decoded")


def probe_key() -> str:
    """What a cache of probe results depends on besides the files: this check's version and the cap."""
    return f"probe=2 max_pixels={max_pixels()}"


def verify_body(kind: str, data: np.ndarray) -> None:
    """An error when a complete-looking JPEG or PNG (``kind``) does not decode; bounded memory either way."""
    if kind == "jpeg":
        try:
            ok = cv2.imdecode(data, cv2.IMREAD_REDUCED_COLOR_8) is not None  # libjpeg's 1/8-scale IDCT
        except cv2.error:
            ok = False
    else:
        ok = _png_inflates(data.tobytes())
    if not ok:
        raise ImageError("cannot decode image (intact header, undecodable body)")


def _png_raw_size(ihdr: bytes) -> int:
    """Bytes of filtered scanlines the IHDR promises (each row: a filter byte and its samples)."""
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", ihdr[:13])
    bits = depth * _PNG_CHANNELS.get(colour, 4)
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if w > 0 and h > 0:
            total += h * (1 + (w * bits + 7) // 8)
    return total


def _png_inflates(data: bytes) -> bool:
    """Whether a PNG's critical chunks are whole with good CRCs and its IDAT stream inflates to what IHDR promises."""
    pos, expected, inflated = 8, None, 0
    inflater = zlib.decompressobj()
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body, crc = data[pos + 8 : pos + 8 + length], data[pos + 8 + length : pos + 12 + length]
        critical = kind[:1].isupper()  # libpng rejects a critical chunk with a bad CRC, warns on others
        if len(body) < length or len(crc) < 4 or (critical and zlib.crc32(kind + body) != int.from_bytes(crc, "big")):
            return False
        if kind == b"IHDR" and length >= 13:
            expected = _png_raw_size(body)
        elif kind == b"IDAT":
            try:
                while body and inflated < (expected or 0) + 1:
                    inflated += len(inflater.decompress(body, _INFLATE_PIECE))
                    body = inflater.unconsumed_tail
            except zlib.error:
                return False
        elif kind == b"IEND":
            break
        pos += 12 + length
    return expected is not None and inflated >= expected
