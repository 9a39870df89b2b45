"""Image files of a split: which names are images, listing a folder or a ``.txt`` list, and where labels live."""

from __future__ import annotations

import os
from pathlib import Path

from utils.errors import UserError

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")


def is_image_file(path: str | Path) -> bool:
    """True when the file name ends in one of the supported image extensions (any case)."""
    return str(path).rsplit(".", 1)[-1].lower() in IMG_FORMATS if "." in str(path) else False


def img2label_path(im_file: str) -> str:
    """Label file of an image: the last ``/images/`` folder becomes ``/labels/``, the extension ``.txt``."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    head, sep, tail = im_file.rpartition(images)
    path = f"{head}{labels}{tail}" if sep else im_file
    return f"{os.path.splitext(path)[0]}.txt"


def orphan_label_files(im_files: list[str]) -> list[str]:
    """Label files in the label folders of these images that belong to none of them (a label whose image was
    removed or renamed: its boxes are never trained). Only folders apart from the images' own are searched, where
    every ``.txt`` is a label file."""
    wanted = {img2label_path(f) for f in im_files}
    folders = {os.path.dirname(p) for p in wanted} - {os.path.dirname(f) for f in im_files}
    found = []
    for folder in sorted(folders):
        try:
            names = os.listdir(folder)
        except OSError:  # no label folder: every image is a background one
            continue
        found += [
            os.path.join(folder, n) for n in names if n.endswith(".txt") and os.path.join(folder, n) not in wanted
        ]
    return sorted(found)


def _read_list_file(txt: Path) -> list[str]:
    """Image paths listed in a ``.txt`` file; relative entries (``./x`` or ``x``) are relative to its folder."""
    try:
        lines = txt.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{txt}: cannot read image list ({e})") from e
    parent = txt.parent
    out = []
    for line in lines:
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        p = Path(entry)
        out.append(str(p if p.is_absolute() else (parent / p).resolve()))
    return out


def _walk_images(folder: str) -> list[str]:
    """Image files under ``folder``, recursively, symlinked folders not followed (as Path.rglob does).

    os.scandir's entries know their type from the directory listing, so a million files cost no stat call each
    (rglob plus is_file stats every one, which made listing most of a large cache's reload time)."""
    found: list[str] = []
    pending = [folder]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif is_image_file(entry.name) and entry.is_file():
                        found.append(entry.path)
        except OSError:  # a subfolder unreadable or gone since it was listed is skipped, as rglob skips it
            continue
    return found


def list_image_files(source: str | Path | list[str] | list[str | Path]) -> list[str]:
    """All image files of a folder (recursive), a ``.txt`` list or a list of those; sorted, no duplicates.

    Raises UserError when a source does not exist or holds no image.
    """
    sources = source if isinstance(source, (list, tuple)) else [source]
    files: list[str] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files += _walk_images(str(p))
        elif p.is_file() and p.suffix.lower() == ".txt":
            files += [f for f in _read_list_file(p) if is_image_file(f)]
        elif p.is_file() and is_image_file(p):
            files.append(str(p))
        else:
            raise UserError(f"{p}: image source does not exist (expected a folder, a .txt list or an image)")
    files = sorted(set(files))
    if not files:
        raise UserError(f"{', '.join(str(s) for s in sources)}: no images found ({', '.join(IMG_FORMATS)})")
    return files
