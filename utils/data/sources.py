"""What detect.py reads: images, folders, globs, ``.txt`` lists, video files and webcams, frame by frame.

A source yields :class:`Frame` objects in order. An input that cannot be read (a broken image, a video that does
not open) yields one frame with ``image`` None and ``error`` set, so the caller reports it and goes on.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from utils.data.image_files import IMG_FORMATS, is_image_file
from utils.data.image_io import ImageError, check_image_size, read_image
from utils.errors import UserError

VID_FORMATS = ("asf", "avi", "gif", "m4v", "mkv", "mov", "mp4", "mpeg", "mpg", "ts", "wmv", "webm")


@dataclass
class Frame:
    """One image to run on: a still image, or frame ``index`` (0-based) of ``n_frames`` of a video or stream."""

    path: str
    image: np.ndarray | None  # BGR uint8, None when unreadable
    kind: str  # "image", "video" or "webcam"
    index: int = 0
    n_frames: int = 0  # 0 for a webcam (unbounded)
    fps: float = 30.0
    error: str = ""


def is_video_file(path: str | Path) -> bool:
    return Path(path).suffix[1:].lower() in VID_FORMATS


def _expand(source: str) -> list[str]:
    """The files a --source names (a webcam index is handled by the caller)."""
    if any(c in source for c in "*?["):
        files = sorted(glob.glob(source, recursive=True))
        if not files:
            raise UserError(f"{source}: the pattern matches no file")
        return [f for f in files if Path(f).is_file()]
    p = Path(source)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and (is_image_file(f) or is_video_file(f)))
        if not files:
            raise UserError(f"{p}: no images or videos in this folder ({', '.join(IMG_FORMATS + VID_FORMATS)})")
        return files
    if p.is_file() and p.suffix.lower() == ".txt":
        root = p.parent
        lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [str(root / line) if not Path(line).is_absolute() and (root / line).exists() else line for line in lines]
    if p.is_file():
        return [str(p)]
    raise UserError(
        f"{source}: source not found (expected an image, a video, a folder, a glob, a .txt list or a webcam index)"
    )


def _video_frames(path: str, capture: cv2.VideoCapture, kind: str) -> Iterator[Frame]:
    n_frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) if kind == "video" else 0
    fps = capture.get(cv2.CAP_PROP_FPS) or 30.0
    index = 0
    try:
        while True:
            ok, image = capture.read()
            if not ok:
                break
            yield Frame(path, image, kind, index, max(n_frames, index + 1) if kind == "video" else 0, fps)
            index += 1
    finally:
        capture.release()
    if index == 0:
        yield Frame(path, None, kind, error="no frame could be read")


def _image_frame(path: str) -> Frame:
    """A still image, or why it is skipped: missing, over --max-pixels by its header (then never decoded),
    or undecodable."""
    if not Path(path).is_file():
        return Frame(path, None, "image", error="file not found")
    try:
        check_image_size(path)
    except ImageError as e:
        return Frame(path, None, "image", error=str(e))
    image = read_image(path)
    return Frame(path, image, "image", error="" if image is not None else "image cannot be decoded")


def iter_source(source: str | int) -> Iterator[Frame]:
    """Frames of ``source`` in order: each file of a folder/glob/list, each frame of each video."""
    source = str(source)
    if source.isdigit():  # a webcam index, as YOLOv5 takes it
        capture = cv2.VideoCapture(int(source))
        if not capture.isOpened():
            raise UserError(f"webcam {source}: cannot be opened")
        yield from _video_frames(f"webcam{source}", capture, "webcam")
        return
    for path in _expand(source):
        if is_video_file(path):
            capture = cv2.VideoCapture(path)
            if not capture.isOpened():
                yield Frame(path, None, "video", error="video cannot be opened")
                continue
            yield from _video_frames(path, capture, "video")
        elif is_image_file(path):
            yield _image_frame(path)
        else:
            yield Frame(path, None, "image", error="not an image or video format this reads")
