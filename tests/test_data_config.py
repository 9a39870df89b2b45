"""Dataset YAML loading: path resolution, names, image lists, label paths and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest

from utils.data.config import img2label_path, is_image_file, list_image_files, load_data_config
from utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _dataset(root: Path, splits: tuple[str, ...] = ("train2017", "val2017")) -> None:
    for split in splits:
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        cv2.imwrite(str(root / "images" / split / "a.jpg"), np.zeros((16, 16, 3), np.uint8))
        cv2.imwrite(str(root / "images" / split / "b.PNG"), np.zeros((16, 16, 3), np.uint8))


def test_yolov5_style_yaml_resolves_against_its_folder(tmp_path: Path, monkeypatch) -> None:
    _dataset(tmp_path / "datasets" / "coco128")
    marker = tmp_path / "downloaded"
    yaml_file = tmp_path / "datasets" / "coco128.yaml"
    yaml_file.write_text(
        "path: coco128\ntrain: images/train2017\nval: images/val2017\ntest:  # optional\n"
        "names:\n  0: person\n  1: bicycle\n"
        f"download: |\n  import pathlib\n  pathlib.Path('{marker}').touch()\n"
    )
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    cfg = load_data_config(yaml_file)
    root = (tmp_path / "datasets" / "coco128").resolve()
    assert cfg["path"] == root
    assert cfg["train"] == str(root / "images" / "train2017") and cfg["val"] == str(root / "images" / "val2017")
    assert "test" not in cfg
    assert cfg["names"] == ["person", "bicycle"] and cfg["nc"] == 2
    assert cfg["yaml_file"] == str(yaml_file.resolve())
    assert not marker.exists()  # download is never executed
    assert [Path(f).name for f in list_image_files(cfg["train"])] == ["a.jpg", "b.PNG"]


def test_path_falls_back_to_current_directory_and_lists(tmp_path: Path, monkeypatch) -> None:
    _dataset(tmp_path / "data_root")
    (tmp_path / "cfg").mkdir()
    yaml_file = tmp_path / "cfg" / "d.yaml"
    yaml_file.write_text(
        "path: data_root\ntrain: [images/train2017, images/val2017]\nval: images/val2017\nnc: 3\nnames: [a, b, c]\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_data_config(yaml_file)
    assert cfg["path"] == (tmp_path / "data_root").resolve()
    assert isinstance(cfg["train"], list) and len(list_image_files(cfg["train"])) == 4


def test_txt_lists_resolve_relative_to_their_folder(tmp_path: Path, monkeypatch) -> None:
    _dataset(tmp_path / "ds")
    abs_entry = tmp_path / "ds" / "images" / "val2017" / "a.jpg"
    (tmp_path / "ds" / "train.txt").write_text(
        f"./images/train2017/a.jpg\nimages/train2017/b.PNG\n{abs_entry}\n\nnotes.md\n"
    )
    (tmp_path / "ds" / "d.yaml").write_text("path: .\ntrain: train.txt\nval: images/val2017\nnames: [x]\n")
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_data_config(tmp_path / "ds" / "d.yaml")
    files = list_image_files(cfg["train"])
    assert files == sorted(
        [
            str(tmp_path / "ds" / "images" / "train2017" / "a.jpg"),
            str(tmp_path / "ds" / "images" / "train2017" / "b.PNG"),
            str(abs_entry),
        ]
    )


@pytest.mark.parametrize(
    "body, words",
    [
        ("path: .\ntrain: images/train2017\nnames: [a]\n", ["'val'"]),
        ("path: .\nval: images/val2017\nnames: [a]\n", ["'train'"]),
        ("path: .\ntrain: images/train2017\nval: images/val2017\n", ["'names'"]),
        ("path: .\ntrain: images/train2017\nval: images/nope\nnames: [a]\n", ["'val'", "images/nope", "tried"]),
        ("path: missing_root\ntrain: images/train2017\nval: images/val2017\nnames: [a]\n", ["'path'", "missing_root"]),
        ("path: .\ntrain: images/train2017\nval: images/val2017\nnc: 2\nnames: [a]\n", ["'nc' is 2", "1 classes"]),
        ("path: .\ntrain: images/train2017\nval: images/val2017\nnames: {0: a, 2: b}\n", ["'names'"]),
        ("- just\n- a list\n", ["mapping"]),
        ("path: .\ntrain: [unclosed\n", ["cannot parse"]),
        ("!!python/object/apply:os.system ['echo hi']\n", ["cannot parse"]),
    ],
)
def test_yaml_errors_name_file_key_and_path(tmp_path: Path, body: str, words: list[str]) -> None:
    _dataset(tmp_path)
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text(body)
    with pytest.raises(UserError) as info:
        load_data_config(yaml_file)
    message = str(info.value)
    assert str(yaml_file) in message and "\n" not in message
    for word in words:
        assert word in message


def test_missing_yaml_and_empty_folder(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(UserError, match="not found"):
        load_data_config(tmp_path / "nope.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:  # says where it looked: here, and among the YAMLs shipped in data/
        load_data_config("coco128.yaml")
    assert str(e.value).endswith(f"(looked for {tmp_path / 'coco128.yaml'} and {ROOT / 'data' / 'coco128.yaml'})")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images"):
        list_image_files(str(tmp_path / "empty"))


def test_bundled_shapes_yaml_is_found_by_name() -> None:
    # Only the lookup: the data itself is generated by test_shapes on a small scale.
    import yaml

    from utils.data.config import _find_yaml

    path = _find_yaml("shapes.yaml")
    raw = yaml.safe_load(path.read_text())
    assert raw["builtin"]["name"] == "shapes" and len(raw["names"]) == 5


def test_label_paths_and_extensions() -> None:
    sep = os.sep
    image = sep.join(("", "d", "images", "x", "images", "a.b.JPG"))
    assert img2label_path(image) == sep.join(("", "d", "images", "x", "labels", "a.b.txt"))  # only the last one
    assert img2label_path(f"{sep}d{sep}imgs.v2{sep}a") == f"{sep}d{sep}imgs.v2{sep}a.txt"
    for name in ("a.jpg", "a.JPEG", "a.png", "a.bmp", "a.tif", "a.TIFF", "a.webp"):
        assert is_image_file(name)
    for name in ("a.gif", "a.txt", "jpg"):
        assert not is_image_file(name)


def test_folder_listing_recurses_keeps_linked_files_and_skips_linked_folders(tmp_path: Path) -> None:
    # The rules of Path.rglob("*") + is_file(), which the listing replaced (it stats no file it need not).
    images = tmp_path / "images"
    (images / "sub" / "deeper").mkdir(parents=True)
    (images / ".hidden").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (
        images / "z.jpg",
        images / "sub" / "a.png",
        images / "sub" / "deeper" / "b.JPG",
        images / ".hidden" / "c.jpg",
        outside / "d.jpg",
    ):
        f.write_bytes(b"x")
    (images / "notes.txt").write_text("not an image")
    (images / "folder.jpg").mkdir()  # a folder named like an image is not one
    (images / "linked.jpg").symlink_to(outside / "d.jpg")  # a linked file is listed
    (images / "broken.jpg").symlink_to(tmp_path / "missing.jpg")  # a dangling link is not
    (images / "linked_folder").symlink_to(outside, target_is_directory=True)  # a linked folder is not followed
    expected = sorted(
        str(images / p) for p in (".hidden/c.jpg", "linked.jpg", "sub/a.png", "sub/deeper/b.JPG", "z.jpg")
    )
    assert list_image_files(images) == expected
    assert list_image_files(str(images) + "/") == expected


LAUGHS = "".join(  # under 400 bytes that expand to 9**9 strings
    f"{k}: &{k} [{', '.join([f'*{p}' if p.strip() else 'lol'] * 9)}]\n" for p, k in zip(" abcdefgh", "abcdefghi")
)


@pytest.mark.parametrize(
    "body, words",
    [
        ("names: {'00': a}\n", ["'names' key '00' is not a class index"]),
        ("names: [a]\nnc: .inf\n", ["'nc' must be a whole number of classes, got inf"]),
        ("names: " + "[" * 3000 + "]" * 3000 + "\n", ["nested more than"]),
        ("names: [a]\nnc: " + "7" * 5000 + "\n", ["cannot parse YAML"]),
        ("names: [a]\ntest: ~nosuchuser/x\n", ["'test'", "~nosuchuser"]),
        ('names: [a]\ntest: "images/a\\0b"\n', ["'test'", "NUL byte"]),
        ("names: [a]\ntest: " + "x" * 256 + "\n", ["'test'", "longer than a path may be"]),
        ("names: [a]\nbuiltin: {name: shapes, n_train: x}\n", ["n_train must be an integer in [1, "]),
        ("names: [a]\nbuiltin: {name: shapes, imgsz: -5}\n", ["imgsz must be an integer in [32, "]),
        ("names: [a]\nbuiltin: {name: shapes, colour: 3}\n", ["unknown option 'colour'"]),
        (LAUGHS + "names: *i\n", ["aliases (*a) are not accepted"]),
        ("names: [a]\ntest: shard-{000000000..999999999}.tar\n", ["'test'", "names more than 1000000 shards"]),
        ("names: [a]\ntest: lists/self.txt\n", ["'test'", "self.txt: shard list lists itself"]),
        ('names: [a]\ntest: "shard-{a}}.tar"\n', ["'test'", "unbalanced braces"]),
        ('names: [a]\npath: "a\\n b"\n', ["'path'", "does not exist"]),
        ('names: [a]\ntest: "images/a\\n b"\n', ["'test'", "does not exist"]),
    ],
    ids=[
        "names-00",
        "nc-inf",
        "nested-3000",
        "digits-5000",
        "no-such-user",
        "nul",
        "name-256",
        "builtin-str",
        "builtin-negative",
        "builtin-unknown",
        "laughs",
        "braces",
        "cycle",
        "unbalanced",
        "path-line-break",
        "split-line-break",
    ],
)
def test_hostile_yaml_is_one_line_in_bounded_time(tmp_path: Path, body: str, words: list[str]) -> None:
    import time

    _dataset(tmp_path)
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "a-000000.tar").write_bytes(b"")
    (tmp_path / "lists" / "self.txt").write_text("a-000000.tar\nself.txt\n")
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("path: .\ntrain: images/train2017\nval: images/val2017\n" + body)
    assert len(LAUGHS) <= 400
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        load_data_config(yaml_file)
    assert time.monotonic() - start < 10  # unbounded, each of these ran for minutes or to a RecursionError
    message = str(info.value)
    assert str(yaml_file) in message and "\n" not in message
    for word in words:
        assert word in message
    assert not (tmp_path / "shapes.json").exists()  # bad builtin options are refused before anything is generated
