"""Dataset YAML: read it safely, resolve its paths, list its images and find their label files.

A YAML written for YOLOv5 works unchanged: ``path`` (dataset root), ``train``/``val``/``test`` (a folder
of images, a ``.txt`` list of image paths, or a list of those) and ``names`` (a list or an
``{index: name}`` mapping). ``download`` is accepted and ignored: it is never executed. Splits may also
name WebDataset tar shards (a ShardSet, shard_names.py), a COCO JSON (``{annotations: a.json, images: dir}``
or just ``a.json``: a CocoSplit), Pascal VOC folders (``{voc: VOC2007, set: trainval}``: a VocSplit), and
``val`` may be a fraction of train (``val: 0.1``: FractionSplit records for both, splits.py). Without
``names`` the classes are a COCO train JSON's categories or the VOC object names. ``builtin: shapes`` asks for
the synthetic dataset of ``utils.data.shapes``, generated on first use. Reading labels is labels.py's: this
module only says what each split names.
"""

from __future__ import annotations

import posixpath
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import yaml

from utils.data.coco_reader import coco_class_names
from utils.data.image_files import IMG_FORMATS, img2label_path, is_image_file, list_image_files  # noqa: F401
from utils.data.remote_data import copy_to_node, is_object_store, local_data, local_path_of, read_text
from utils.data.shard_names import is_shard_entry, resolve_shard_split
from utils.data.splits import CocoSplit, FractionSplit, VocSplit, user_path
from utils.data.voc_reader import voc_class_names
from utils.errors import UserError, excerpt, first_line, shown
from utils.storage import is_url
from utils.yaml_reader import load_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "val", "test")


def data_yaml_path(path: str | Path) -> Path | None:
    """The data YAML that ``--data path`` names, resolved, or None when there is none."""
    p = Path(path)
    if p.is_file():
        return p.resolve()
    bundled = REPO_ROOT / "data" / p  # lets `--data shapes.yaml` find the YAMLs shipped in data/
    if not p.is_absolute() and bundled.is_file():
        return bundled.resolve()
    return None


def _find_yaml(path: str | Path) -> Path | str:
    """The data YAML's resolved path, or its URL (a YAML in a bucket)."""
    if is_object_store(str(path)):
        return str(path)
    found = data_yaml_path(path)
    if found is None:
        places = [Path(path).absolute()] + ([REPO_ROOT / "data" / path] if not Path(path).is_absolute() else [])
        raise UserError(f"{path}: dataset YAML not found (looked for {' and '.join(map(str, places))})")
    return found


def _class_index(key: Any) -> int | None:
    """A ``names`` mapping's key as a class index: an integer, or its decimal digits ('3'; not '03', not True)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdecimal() and key.isascii() and str(int(key)) == key:
        return int(key)
    return None


def _names_list(names: Any, yaml_file: Path | str) -> list[str]:
    if isinstance(names, dict):
        by_index = {_class_index(k): v for k, v in names.items()}
        if None in by_index or len(by_index) != len(names):
            bad = next((k for k in names if _class_index(k) is None), None)
            why = f"key {str(bad)[:40]!r} is not" if bad is not None else "keys repeat"
            raise UserError(f"{yaml_file}: 'names' {why} a class index (0, 1, 2, ...)")
        keys = sorted(k for k in by_index if k is not None)  # None was refused above
        if keys != list(range(len(keys))):
            raise UserError(f"{yaml_file}: 'names' indices must be 0..{len(keys) - 1}, got {excerpt(keys, 80)}")
        names = [by_index[k] for k in keys]
    if isinstance(names, (list, tuple)):
        if not all(isinstance(n, (str, int, float)) for n in names):
            raise UserError(f"{yaml_file}: 'names' must name each class with a string")
        return [str(n) for n in names]
    raise UserError(f"{yaml_file}: 'names' must be a list or an {{index: name}} mapping")


def _class_count(value: Any, yaml_file: Path | str) -> int:
    """``nc``: a whole number (2 or 2.0; not .inf, not true)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"{yaml_file}: 'nc' must be a whole number of classes, got {excerpt(value, 40)}")
    return value


def _remote_root(raw: Any, yaml_file: Path | str) -> str | None:
    """The dataset root's URL where it is in a bucket: ``path`` as a URL, or a YAML in a bucket whose ``path`` is
    relative (or absent); None for a local root."""
    text = "" if raw in (None, "") else str(raw)
    if is_object_store(text):
        return text.rstrip("/")
    if isinstance(yaml_file, str) and not text.startswith(("/", "~")):
        folder = yaml_file.rpartition("/")[0]
        return _url_join(folder, text) if text else folder
    return None


def _url_join(base: str, relative: str) -> str:
    """``relative`` (a path a YAML wrote) under the URL ``base``, ``.`` and ``..`` folded."""
    scheme, _, rest = base.partition("://")
    bucket, _, key = rest.partition("/")
    joined = posixpath.normpath(posixpath.join("/", key, relative)).lstrip("/")
    return f"{scheme}://{bucket}/{joined}" if joined else f"{scheme}://{bucket}"


def _as_url(entry: Any, root_url: str | None) -> Any:
    """A split entry as a URL where the dataset root is in a bucket and the entry is relative; else unchanged."""
    text = str(entry)
    if root_url is None or is_url(text) or text.startswith(("/", "~")) or not isinstance(entry, str):
        return entry
    return _url_join(root_url, text)


def _resolve_root(raw: Any, yaml_file: Path | str, root_url: str | None) -> Path:
    """Dataset root: absolute, else relative to the YAML's folder when that exists, else to the current dir; a root
    in a bucket: its place in the node's copy (utils/data/remote_data.py)."""
    if root_url is not None:
        return local_path_of(root_url)
    assert isinstance(yaml_file, Path)  # a YAML in a bucket has a root in the bucket unless it names a local one
    root = user_path(str(raw), f"{yaml_file} 'path'") if raw not in (None, "") else Path(".")
    if root.is_absolute():
        return root
    beside_yaml = (yaml_file.parent / root).resolve()
    from_cwd = root.resolve()
    if beside_yaml.exists() or not from_cwd.exists():
        return beside_yaml
    return from_cwd


def _resolve_split(
    value: Any, root: Path, yaml_file: Path | str, key: str, in_buckets: list[tuple[str, str]]
) -> str | list[str]:
    """The split's paths; an entry in a bucket is the place of the node's copy, which is made once every split is
    resolved (its (url, where) appended to ``in_buckets``: ``copy_to_node`` checks the room for them all)."""
    entries = value if isinstance(value, (list, tuple)) else [value]
    resolved = []
    for entry in entries:
        if is_object_store(str(entry)):  # loose files in a bucket: read from the node's copy
            in_buckets.append((str(entry), f"{yaml_file} '{key}'"))
            resolved.append(str(local_path_of(str(entry))))
            continue
        p = user_path(str(entry), f"{yaml_file} '{key}'")
        full = p if p.is_absolute() else (root / p).resolve()
        if not full.exists() and str(entry).startswith("../"):
            full = (root / str(entry)[3:]).resolve()  # YOLOv5 YAMLs sometimes write '../' meaning the root
        if not full.exists():
            raise UserError(f"{yaml_file}: '{key}' path {entry!r} does not exist (tried {shown(full)})")
        resolved.append(str(full))
    return resolved if isinstance(value, (list, tuple)) else resolved[0]


def _ensure_builtin(spec: Any, root: Path, yaml_file: Path | str) -> None:
    """Generate a built-in dataset into ``root`` if it is missing; its options are checked first, in one line."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.pop("name", None)
    if name != "shapes":
        raise UserError(f"{yaml_file}: 'builtin' {str(name)[:40]!r} is unknown (known: shapes)")
    from utils.data.shapes import OPTION_RANGES, ensure_shapes_dataset  # only needed by YAMLs that ask for it

    for key, value in options.items():
        bounds = OPTION_RANGES.get(key)
        if bounds is None:
            raise UserError(
                f"{yaml_file}: 'builtin' {name}: unknown option {str(key)[:40]!r} (known: {sorted(OPTION_RANGES)})"
            )
        low, high = bounds
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UserError(
                f"{yaml_file}: 'builtin' {name}: {key} must be an integer in [{low}, {high}], got {excerpt(value, 40)}"
            )
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
        text = read_text(yaml_file) if isinstance(yaml_file, str) else yaml_file.read_text(encoding="utf-8")
        raw = load_yaml(text, "a data YAML")
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: UnicodeDecodeError, a 5000-digit integer
        raise UserError(f"{yaml_file}: cannot parse YAML ({first_line(e)})") from e
    if not isinstance(raw, dict):
        raise UserError(f"{yaml_file}: expected a mapping with keys path, train, val, names")

    for key in ("train", "val"):
        if raw.get(key) in (None, "", [], {}):
            raise UserError(f"{yaml_file}: missing key '{key}'")
    names = _names_list(raw["names"], yaml_file) if raw.get("names") not in (None, "", [], {}) else None

    root_url = _remote_root(raw.get("path"), yaml_file)
    root = _resolve_root(raw.get("path"), yaml_file, root_url)
    if raw.get("builtin") and root_url is None:
        _ensure_builtin(raw["builtin"], root, yaml_file)
    if root_url is None and not root.exists():
        hint = " (its 'download' section is never run: fetch the data yourself)" if raw.get("download") else ""
        raise UserError(f"{yaml_file}: 'path' {raw.get('path')!r} does not exist (tried {shown(root)}){hint}")

    in_buckets: list[tuple[str, str]] = []
    splits = {
        key: _split_record(_urls_under(raw[key], root_url), root, yaml_file, key, in_buckets)
        for key in SPLITS
        if raw.get(key) not in (None, "", [])
    }
    if in_buckets:  # every split's room checked before any is copied
        copy_to_node(in_buckets, str(yaml_file))
    if names is None:
        names = _names_from_annotations(splits, yaml_file)
    splits = {key: _with_names(value, names) for key, value in splits.items()}
    if "nc" in raw and raw["nc"] is not None:
        nc = _class_count(raw["nc"], yaml_file)
        if nc != len(names):
            raise UserError(f"{yaml_file}: 'nc' is {nc} but 'names' lists {len(names)} classes")

    config: dict[str, Any] = {"path": root, "names": names, "nc": len(names), "yaml_file": str(yaml_file), **splits}
    if isinstance(splits["val"], FractionSplit):  # the rest of train trains; the two never overlap
        config["train"] = replace(splits["val"], base=splits["train"], part="train")
        config["val"] = replace(splits["val"], base=splits["train"])
    if isinstance(splits.get("test"), FractionSplit):
        raise UserError(f"{yaml_file}: 'test' as a fraction is not supported (only 'val: 0.1' takes part of train)")
    annotations = _annotations_file(_urls_under(raw.get("annotations"), root_url), root, yaml_file)
    if isinstance(config["val"], CocoSplit):  # --save-json scores against the val split's own JSON
        annotations = config["val"].annotations
    if annotations is not None:
        config["annotations"] = annotations
    return config


def _urls_under(value: Any, root_url: str | None) -> Any:
    """A split's value with every relative path in it made a URL under ``root_url`` (a root in a bucket)."""
    if isinstance(value, (list, tuple)):
        return [_urls_under(v, root_url) for v in value]
    if isinstance(value, dict):
        return {k: v if k == "set" else _urls_under(v, root_url) for k, v in value.items()}
    return _as_url(value, root_url)


def _split_record(value: Any, root: Path, yaml_file: Path | str, key: str, in_buckets: list[tuple[str, str]]) -> Any:
    """What a split entry names: image files (str or list), shards, a COCO JSON, VOC folders or a fraction."""
    where = f"{yaml_file} '{key}'"
    if isinstance(value, float) and not isinstance(value, bool):
        if key != "val" or not 0 < value < 1:
            raise UserError(f"{yaml_file}: '{key}' {value!r}: a fraction is only allowed for 'val', in (0, 1)")
        return FractionSplit(base=None, root=str(root), fraction=float(value), part="val")
    if isinstance(value, dict):
        if "annotations" in value:
            unknown = set(value) - {"annotations", "images"}
            if unknown:
                raise UserError(f"{where}: unknown key(s) {sorted(unknown)} (a COCO split takes annotations, images)")
            images = _resolve_split(value["images"], root, yaml_file, key, in_buckets) if value.get("images") else None
            annotations = cast(str, _resolve_split(value["annotations"], root, yaml_file, key, in_buckets))
            return CocoSplit(annotations, cast("str | None", images), source=where)
        if "voc" in value:
            unknown = set(value) - {"voc", "set"}
            if unknown or not value.get("set"):
                raise UserError(f"{where}: a VOC split is {{voc: <folder or list>, set: <ImageSets/Main name>}}")
            image_set = str(value["set"])
            if not image_set or image_set.startswith(".") or any(c in image_set for c in "/\\\0"):
                # a file name in ImageSets/Main, where the split's label cache is written too
                raise UserError(f"{where}: VOC set {image_set[:80]!r} is not a file name in ImageSets/Main")
            roots = _resolve_split(value["voc"], root, yaml_file, key, in_buckets)
            return VocSplit(tuple(roots if isinstance(roots, list) else [roots]), image_set, source=where)
        raise UserError(f"{where}: a mapping must be {{annotations, images}} (COCO JSON) or {{voc, set}} (Pascal VOC)")
    if isinstance(value, str) and value.lower().endswith(".json"):
        return CocoSplit(cast(str, _resolve_split(value, root, yaml_file, key, in_buckets)), None, source=where)
    entries = value if isinstance(value, (list, tuple)) else [value]
    for entry in entries:  # before anything stats it: a path that cannot exist is one line naming the YAML
        user_path(str(entry), where)
    if any(is_shard_entry(str(e), root) for e in entries):  # WebDataset tar shards (a ShardSet)
        return resolve_shard_split(value, root, yaml_file, key)
    return _resolve_split(value, root, yaml_file, key, in_buckets)


def _names_from_annotations(splits: dict[str, Any], yaml_file: Path | str) -> list[str]:
    """Class names when the YAML gives none: the train COCO JSON's categories, or the VOC object names."""
    train = splits["train"]
    if isinstance(train, CocoSplit):
        return coco_class_names(train.annotations)
    vocs = [s for s in splits.values() if isinstance(s, VocSplit)]
    if isinstance(train, VocSplit):
        return sorted({n for s in vocs for n in voc_class_names(s)})
    raise UserError(f"{yaml_file}: missing key 'names' (only COCO JSON and VOC splits bring their own)")


def _with_names(value: Any, names: list[str]) -> Any:
    if isinstance(value, (CocoSplit, VocSplit)):
        return replace(value, names=tuple(names))
    return value


def _annotations_file(value: Any, root: Path, yaml_file: Path | str) -> str | None:
    """COCO annotations of the val split: the YAML's 'annotations', else root/annotations/instances_val2017.json."""
    if isinstance(value, str) and is_object_store(value):
        return local_data(value, f"{yaml_file} 'annotations'")
    if value in (None, ""):
        default = root / "annotations" / "instances_val2017.json"
        return str(default) if default.is_file() else None
    path = user_path(str(value), f"{yaml_file} 'annotations'")
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise UserError(f"{yaml_file}: 'annotations' {value!r} does not exist (tried {shown(path)})")
    return str(path)
