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

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from utils.data.coco_reader import coco_class_names
from utils.data.image_files import IMG_FORMATS, img2label_path, is_image_file, list_image_files  # noqa: F401
from utils.data.shard_names import is_shard_entry, resolve_shard_split
from utils.data.splits import CocoSplit, FractionSplit, VocSplit
from utils.data.voc_reader import voc_class_names
from utils.errors import UserError, first_line

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
        raise UserError(f"{yaml_file}: cannot parse YAML ({first_line(e)})") from e
    if not isinstance(raw, dict):
        raise UserError(f"{yaml_file}: expected a mapping with keys path, train, val, names")

    for key in ("train", "val"):
        if raw.get(key) in (None, "", [], {}):
            raise UserError(f"{yaml_file}: missing key '{key}'")
    names = _names_list(raw["names"], yaml_file) if raw.get("names") not in (None, "", [], {}) else None

    root = _resolve_root(raw.get("path"), yaml_file)
    if raw.get("builtin"):
        _ensure_builtin(raw["builtin"], root, yaml_file)
    if not root.exists():
        hint = " (its 'download' section is never run: fetch the data yourself)" if raw.get("download") else ""
        raise UserError(f"{yaml_file}: 'path' {raw.get('path')!r} does not exist (tried {root}){hint}")

    splits = {
        key: _split_record(raw[key], root, yaml_file, key) for key in SPLITS if raw.get(key) not in (None, "", [])
    }
    if names is None:
        names = _names_from_annotations(splits, yaml_file)
    splits = {key: _with_names(value, names) for key, value in splits.items()}
    if "nc" in raw and raw["nc"] is not None:
        try:
            nc = int(raw["nc"])
        except (TypeError, ValueError) as e:
            raise UserError(f"{yaml_file}: 'nc' must be an integer, got {raw['nc']!r}") from e
        if nc != len(names):
            raise UserError(f"{yaml_file}: 'nc' is {nc} but 'names' lists {len(names)} classes")

    config: dict[str, Any] = {"path": root, "names": names, "nc": len(names), "yaml_file": str(yaml_file), **splits}
    if isinstance(splits["val"], FractionSplit):  # the rest of train trains; the two never overlap
        config["train"] = replace(splits["val"], base=splits["train"], part="train")
        config["val"] = replace(splits["val"], base=splits["train"])
    if isinstance(splits.get("test"), FractionSplit):
        raise UserError(f"{yaml_file}: 'test' as a fraction is not supported (only 'val: 0.1' takes part of train)")
    annotations = _annotations_file(raw.get("annotations"), root, yaml_file)
    if isinstance(config["val"], CocoSplit):  # --save-json scores against the val split's own JSON
        annotations = config["val"].annotations
    if annotations is not None:
        config["annotations"] = annotations
    return config


def _split_record(value: Any, root: Path, yaml_file: Path, key: str) -> Any:
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
            images = _resolve_split(value["images"], root, yaml_file, key) if value.get("images") else None
            return CocoSplit(_resolve_split(value["annotations"], root, yaml_file, key), images, source=where)
        if "voc" in value:
            unknown = set(value) - {"voc", "set"}
            if unknown or not value.get("set"):
                raise UserError(f"{where}: a VOC split is {{voc: <folder or list>, set: <ImageSets/Main name>}}")
            roots = _resolve_split(value["voc"], root, yaml_file, key)
            return VocSplit(tuple(roots if isinstance(roots, list) else [roots]), str(value["set"]), source=where)
        raise UserError(f"{where}: a mapping must be {{annotations, images}} (COCO JSON) or {{voc, set}} (Pascal VOC)")
    if isinstance(value, str) and value.lower().endswith(".json"):
        return CocoSplit(_resolve_split(value, root, yaml_file, key), None, source=where)
    entries = value if isinstance(value, (list, tuple)) else [value]
    if any(is_shard_entry(str(e), root) for e in entries):  # WebDataset tar shards (a ShardSet)
        return resolve_shard_split(value, root, yaml_file, key)
    return _resolve_split(value, root, yaml_file, key)


def _names_from_annotations(splits: dict[str, Any], yaml_file: Path) -> list[str]:
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
