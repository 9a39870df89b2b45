"""Decoding images (cv2: EXIF orientation honoured, 8-bit BGR out), parts of JPEGs, and fast header probing.

Decoding works on the encoded bytes, wherever they come from (a file, a tar shard); ``read_image`` and
``read_image_region`` are the file versions. ``probe_image`` gets an image's displayed size from its header
(JPEG, PNG, BMP, TIFF, WebP: the formats the readers take; any other is refused undecoded), checks it against
``--max-pixels`` before any decoding, and then checks that the body decodes in bounded memory (image_checks.py);
files without an end marker (BMP, TIFF, WebP, a cut JPEG or PNG) are decoded whole, within the cap. Every decode
reads the header first in the same way. The JPEG header parser here (frame size and EXIF orientation) is the
project's only one.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import BinaryIO, cast

import cv2
import numpy as np

from utils.data.image_checks import ImageError, check_pixels, max_pixels, verify_body
from utils.data.jpeg_region import JpegRegionDecoder

__all__ = ["ImageError"]  # defined beside the checks that raise it, used by every caller of the probes here

JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_EXIF_ORIENTATION_TAG = 0x0112
_TAIL_BYTES = 64  # how far from the end of file an end marker may sit (some writers pad with zeros)
_TIFF_SIGNATURES = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, either byte order
_TIFF_SIZE_TAGS = (256, 257, 322, 323)  # ImageWidth, ImageLength, TileWidth, TileLength
_TIFF_INTEGER_TYPES = {3: "H", 4: "I", 16: "Q"}  # SHORT, LONG, LONG8: a value held in the entry itself
_TIFF_MAX_ENTRIES = 4096  # a real first IFD has a few dozen


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

    The header is read first, at every decode: bytes of no format the readers take, or whose header says more
    pixels than ``--max-pixels``, are None without decoding (a file changed since it was probed allocates
    nothing either). A truncated JPEG is repaired in memory by appending the missing end-of-image marker (the
    missing part decodes as grey).
    """
    try:
        check_pixels(*header_size(data))
    except ImageError:
        return None
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


def _check_png_chunk_lengths(f: BinaryIO) -> None:
    """An ImageError when a PNG chunk's length field runs past the end of the file.

    OpenCV's PNG reader allocates and zeroes a buffer of the size a chunk claims before reading it, so a 98-byte
    file claiming a 3 GB chunk costs 3 GB of memory and seconds at every decode; such a file never decodes (its
    data is not there), so it is refused from the lengths alone, 8 bytes read per chunk."""
    size = f.seek(0, 2)
    pos = len(PNG_SIGNATURE)
    while pos + 8 <= size:
        f.seek(pos)
        length, kind = struct.unpack(">I4s", f.read(8))
        if pos + 12 + length > size:
            raise ImageError(
                f"PNG chunk {kind.decode('latin-1')!r} claims {length:,} bytes, past the end of the file "
                f"({size:,} bytes): not decoded"
            )
        if kind == b"IEND":
            return
        pos += 12 + length


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


def _webp_size(head: bytes) -> tuple[int, int]:
    """(width, height) of a WebP from its first chunk: the canvas of an extended file (``VP8X``, which an animation
    or alpha needs), the frame of a simple lossy (``VP8 ``) or lossless (``VP8L``) one."""
    if len(head) < 30:
        raise ImageError("WebP header cut short")
    chunk = head[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L":
        if head[20] != 0x2F:
            raise ImageError("broken WebP lossless header")
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 ":
        if head[23:26] != b"\x9d\x01\x2a":
            raise ImageError("broken WebP lossy header")
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF  # the top two bits of each are a scale, not the size
    raise ImageError("WebP whose first chunk is not VP8, VP8L or VP8X")


def _tiff_size(f: BinaryIO, head: bytes) -> tuple[int, int]:
    """(width, height) of a TIFF's first image (the one a decoder reads), from its first IFD wherever it lies
    in the file; its tiles, when it has them, are held to the pixel cap too (a decoder allocates one whole)."""
    endian = "<" if head[:2] == b"II" else ">"
    if head[2:4] == struct.pack(endian + "H", 42):  # classic TIFF: 32-bit offsets, 12-byte entries
        (ifd,) = struct.unpack(endian + "I", head[4:8])
        count_format, entry_size, value_at = "H", 12, 8
    else:  # BigTIFF: 64-bit offsets, 20-byte entries
        (ifd,) = struct.unpack(endian + "Q", head[8:16])
        count_format, entry_size, value_at = "Q", 20, 12
    f.seek(ifd)
    count_bytes = f.read(struct.calcsize(count_format))
    if len(count_bytes) < struct.calcsize(count_format):
        raise ImageError("TIFF's first IFD lies past the end of the file")
    (count,) = struct.unpack(endian + count_format, count_bytes)
    if count > _TIFF_MAX_ENTRIES:
        raise ImageError(f"TIFF's first IFD claims {count} entries")
    entries = f.read(count * entry_size)
    if len(entries) < count * entry_size:
        raise ImageError("TIFF's first IFD is cut short")
    tags: dict[int, int] = {}
    for k in range(0, len(entries), entry_size):
        tag, kind = struct.unpack(endian + "HH", entries[k : k + 4])
        if tag in _TIFF_SIZE_TAGS and kind in _TIFF_INTEGER_TYPES:
            value_format = _TIFF_INTEGER_TYPES[kind]
            (tags[tag],) = struct.unpack_from(endian + value_format, entries, k + value_at)
    if 256 not in tags or 257 not in tags:
        raise ImageError("TIFF without ImageWidth and ImageLength")
    tile = tags.get(322, 0) * tags.get(323, 0)
    if tile > max_pixels():
        raise ImageError(f"TIFF tiles of {tags[322]}x{tags[323]} are over --max-pixels {max_pixels()}: not decoded")
    return tags[256], tags[257]


def _header_size(f: BinaryIO, head: bytes) -> tuple[str, int, int, bool]:
    """(kind, displayed width, height, end marker present) from the header of every format the readers take
    (JPEG, PNG, BMP, TIFF, WebP; TIFF, WebP and BMP have no end marker). Anything else is an ImageError: a format
    whose size cannot be read before decoding is not decoded (OpenCV would decode PNM, GIF, JPEG 2000, ...)."""
    if not head:
        raise ImageError("empty file")
    if head[:2] == JPEG_SOI:
        f.seek(0)
        width, height, orientation = _jpeg_header(_Reader(f))
        if orientation in (5, 6, 7, 8):  # rotated by 90 degrees on display
            width, height = height, width
        return "jpeg", width, height, JPEG_EOI in _tail(f)
    if head[:8] == PNG_SIGNATURE:
        width, height = _png_header_size(head)
        _check_png_chunk_lengths(f)
        return "png", width, height, b"IEND" in _tail(f)
    if head[:2] == b"BM" and len(head) >= 26:
        (info_size,) = struct.unpack("<I", head[14:18])
        # the old OS/2 header keeps 16-bit sizes; every later one 32-bit signed (negative height: top-down rows)
        width, height = struct.unpack(
            "<HH" if info_size == 12 else "<ii", head[18:22] if info_size == 12 else head[18:26]
        )
        return "bmp", abs(width), abs(height), False
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp", *_webp_size(head), False
    if head[:4] in _TIFF_SIGNATURES:
        return "tiff", *_tiff_size(f, head), False
    raise ImageError("not a JPEG, PNG, BMP, TIFF or WebP image: not decoded")


def header_size(data: np.ndarray | bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes as their header says (displayed for a JPEG); an ImageError when
    there is no header of a format the readers take."""
    try:
        _, width, height, _ = _header_size(io.BytesIO(bytes(data)), bytes(data[:32]))
    except struct.error as e:
        raise ImageError(f"broken image header ({e})") from e
    return width, height


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
