"""Dataset YAML: read it safely, resolve its paths, list its images and find their label files.

A YAML written for YOLOv5 works unchanged: ``path`` (dataset root), ``train``/``val``/``test`` (a folder
of images, a ``.txt`` list of image paths, or a list of those) and ``names`` (a list or an
``{index: name}`` mapping). ``download`` is accepted and ignored: it is never executed. Splits may also
name WebDataset tar shards (``utils.data.webshards``): they resolve to a ShardSet. ``builtin: shapes``
asks for the synthetic dataset of ``utils.data.shapes``, generated on first use.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from utils.errors import UserError

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")
REPO_ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "val", "test")


def is_image_file(path: str | Path) -> bool:
    """True when the file name ends in one of the supported image extensions (any case)."""
    return str(path).rsplit(".", 1)[-1].lower() in IMG_FORMATS if "." in str(path) else False


def img2label_path(im_file: str) -> str:
    """Label file of an image: the last ``/images/`` folder becomes ``/labels/``, the extension ``.txt``."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    head, sep, tail = im_file.rpartition(images)
    path = f"{head}{labels}{tail}" if sep else im_file
    return f"{os.path.splitext(path)[0]}.txt"


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


def list_image_files(source: str | Path | list[str | Path]) -> list[str]:
    """All image files of a folder (recursive), a ``.txt`` list or a list of those; sorted, no duplicates.

    Raises UserError when a source does not exist or holds no image.
    """
    sources = source if isinstance(source, (list, tuple)) else [source]
    files: list[str] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files += [str(f) for f in p.rglob("*") if is_image_file(f.name) and f.is_file()]
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


def data_yaml_path(path: str | Path) -> Path | None:
    """The data YAML that ``--data path`` names, resolved, or None when there is none."""
    p = Path(path)
    if p.is_file():
        return p.resolve()
    bundled = REPO_ROOT / "data" / p  # lets `--data shapes.yaml` find the YAMLs shipped in data/
    if not p.is_absolute() and bundled.is_file():
        return bundled.resolve()
    return None


def _find_yaml(path: str | Path) -> Path:
    found = data_yaml_path(path)
    if found is None:
        raise UserError(f"{path}: dataset YAML not found")
    return found


def _names_list(names: Any, yaml_file: Path) -> list[str]:
    if isinstance(names, dict):
        try:
            keys = sorted(int(k) for k in names)
        except (TypeError, ValueError) as e:
            raise UserError(f"{yaml_file}: 'names' keys must be integer class indices") from e
        if keys != list(range(len(keys))):
            raise UserError(f"{yaml_file}: 'names' indices must be 0..{len(keys) - 1}, got {keys}")
        return [str(names[k] if k in names else names[str(k)]) for k in keys]
    if isinstance(names, (list, tuple)):
        return [str(n) for n in names]
    raise UserError(f"{yaml_file}: 'names' must be a list or an {{index: name}} mapping")


def _resolve_root(raw: Any, yaml_file: Path) -> Path:
    """Dataset root: absolute, else relative to the YAML's folder when that exists, else to the current dir."""
    root = Path(str(raw)) if raw not in (None, "") else Path(".")
    root = root.expanduser()
    if root.is_absolute():
        return root
    beside_yaml = (yaml_file.parent / root).resolve()
    from_cwd = root.resolve()
    if beside_yaml.exists() or not from_cwd.exists():
        return beside_yaml
    return from_cwd


def _resolve_split(value: Any, root: Path, yaml_file: Path, key: str) -> str | list[str]:
    entries = value if isinstance(value, (list, tuple)) else [value]
    resolved = []
    for entry in entries:
        p = Path(str(entry)).expanduser()
        full = p if p.is_absolute() else (root / p).resolve()
        if not full.exists() and str(entry).startswith("../"):
            full = (root / str(entry)[3:]).resolve()  # YOLOv5 YAMLs sometimes write '../' meaning the root
        if not full.exists():
            raise UserError(f"{yaml_file}: '{key}' path {entry!r} does not exist (tried {full})")
        resolved.append(str(full))
    return resolved if isinstance(value, (list, tuple)) else resolved[0]


def _ensure_builtin(spec: Any, root: Path, yaml_file: Path) -> None:
    """Generate a built-in dataset into ``root`` if it is missing."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.pop("name", None)
    if name != "shapes":
        raise UserError(f"{yaml_file}: 'builtin' {name!r} is unknown (known: shapes)")
    from utils.data.shapes import ensure_shapes_dataset  # only needed by YAMLs that ask for it

    try:
        ensure_shapes_dataset(root, **options)
    except (TypeError, FileExistsError) as e:
        raise UserError(f"{yaml_file}: 'builtin' {name}: {e}") from e


def load_data_config(path: str | Path) -> dict[str, Any]:
    """Read a dataset YAML and return {'path', 'train', 'val', ['test'], 'names', 'nc', 'yaml_file'}.

    A built-in dataset is generated on first use: in a distributed run call this on local rank 0 first
    (``torch_distributed_zero_first``).

    Split paths are absolute strings (or lists of them). Every problem raises one UserError naming the
    YAML, the key and the path tried.
    """
    yaml_file = _find_yaml(path)
    try:
        with open(yaml_file, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"{yaml_file}: cannot parse YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(raw, dict):
        raise UserError(f"{yaml_file}: expected a mapping with keys path, train, val, names")

    for key in ("train", "val", "names"):
        if raw.get(key) in (None, "", [], {}):
            raise UserError(f"{yaml_file}: missing key '{key}'")
    names = _names_list(raw["names"], yaml_file)
    if "nc" in raw and raw["nc"] is not None:
        try:
            nc = int(raw["nc"])
        except (TypeError, ValueError) as e:
            raise UserError(f"{yaml_file}: 'nc' must be an integer, got {raw['nc']!r}") from e
        if nc != len(names):
            raise UserError(f"{yaml_file}: 'nc' is {nc} but 'names' lists {len(names)} classes")

    root = _resolve_root(raw.get("path"), yaml_file)
    if raw.get("builtin"):
        _ensure_builtin(raw["builtin"], root, yaml_file)
    if not root.exists():
        hint = " (its 'download' section is never run: fetch the data yourself)" if raw.get("download") else ""
        raise UserError(f"{yaml_file}: 'path' {raw.get('path')!r} does not exist (tried {root}){hint}")

    config: dict[str, Any] = {"path": root, "names": names, "nc": len(names), "yaml_file": str(yaml_file)}
    from utils.data.webshards import is_shard_entry, resolve_shard_split  # imports this module

    for key in SPLITS:
        if raw.get(key) in (None, "", []):
            continue
        entries = raw[key] if isinstance(raw[key], (list, tuple)) else [raw[key]]
        if any(is_shard_entry(str(e), root) for e in entries):  # WebDataset tar shards (a ShardSet)
            config[key] = resolve_shard_split(raw[key], root, yaml_file, key)
        else:
            config[key] = _resolve_split(raw[key], root, yaml_file, key)
    annotations = _annotations_file(raw.get("annotations"), root, yaml_file)
    if annotations is not None:
        config["annotations"] = annotations
    return config


def _annotations_file(value: Any, root: Path, yaml_file: Path) -> str | None:
    """COCO annotations of the val split: the YAML's 'annotations', else root/annotations/instances_val2017.json."""
    if value in (None, ""):
        default = root / "annotations" / "instances_val2017.json"
        return str(default) if default.is_file() else None
    path = Path(str(value))
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise UserError(f"{yaml_file}: 'annotations' {value!r} does not exist (tried {path})")
    return str(path)
