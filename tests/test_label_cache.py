"""Verification of image/label pairs and the label cache, on a generated dataset full of bad inputs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import utils.data.label_cache as label_cache
import utils.data.yolo_labels as yolo_labels
from utils.data.config import list_image_files
from utils.data.dataset import YoloDataset
from utils.data.image_io import ImageError, probe_image, read_image
from utils.data.label_cache import read_cache, write_cache
from utils.data.yolo_labels import LabelError, load_label_set, parse_label_text
from utils.errors import UserError

NC = 3
GOOD_ROW = "0 0.5 0.5 0.25 0.25\n"


def _jpeg_bytes(img: np.ndarray) -> bytes:
    ok, enc = cv2.imencode(".jpg", img)
    assert ok
    return enc.tobytes()


def _pattern(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), channels), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_NEAREST).reshape(h, w, channels)


def make_broken_dataset(root: Path) -> dict[str, int]:
    """Write a split with one file per kind of problem; returns the exact expected counts."""
    images, labels = root / "images" / "train", root / "labels" / "train"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)

    def label(name: str, text: str | bytes) -> None:
        path = labels / f"{name}.txt"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    # Labelled (10)
    cv2.imwrite(str(images / "good_a.jpg"), _pattern(32, 32))
    label("good_a", GOOD_ROW)
    cv2.imwrite(str(images / "good_b.png"), _pattern(40, 48, seed=1))
    label("good_b", "1 0.3 0.3 0.2 0.2\n2 0.7 0.7 0.3 0.3\n")
    whole = _jpeg_bytes(_pattern(64, 64, seed=2))
    (images / "truncated.jpg").write_bytes(whole[: len(whole) * 2 // 3])
    label("truncated", GOOD_ROW)
    cv2.imwrite(str(images / "rgba.png"), np.dstack([_pattern(32, 32, seed=3), np.full((32, 32), 7, np.uint8)]))
    label("rgba", GOOD_ROW)
    cv2.imwrite(str(images / "deep.png"), np.full((24, 24), 40000, np.uint16))
    label("deep", GOOD_ROW)
    cv2.imwrite(str(images / "gray.jpg"), _pattern(32, 32, channels=1, seed=4))
    label("gray", GOOD_ROW)
    stored = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide, 20 tall; displayed 20 wide, 40 tall
    stored[:, :10] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    Image.fromarray(stored).save(images / "exif.jpg", exif=exif.tobytes())
    label("exif", GOOD_ROW)
    cv2.imwrite(str(images / "dup.jpg"), _pattern(32, 32, seed=5))
    label("dup", GOOD_ROW + "1 0.2 0.2 0.1 0.1\n" + GOOD_ROW)
    cv2.imwrite(str(images / "excess.jpg"), _pattern(32, 32, seed=6))
    label("excess", "0 0.5 0.5 1.0005 0.25\n")
    cv2.imwrite(str(images / "bitmap.BMP"), _pattern(32, 32, seed=7))
    label("bitmap", GOOD_ROW)
    # Background (1) and empty (1)
    cv2.imwrite(str(images / "nolabel.jpg"), _pattern(32, 32, seed=8))
    cv2.imwrite(str(images / "empty.jpg"), _pattern(32, 32, seed=9))
    label("empty", "")
    # Corrupt (10)
    (images / "garbage.jpg").write_bytes(os.urandom(500))
    (images / "broken_markers.jpg").write_bytes(b"\xff\xd8" + bytes(range(256)) * 2)
    (images / "zero.jpg").write_bytes(b"")
    cv2.imwrite(str(images / "tiny.jpg"), _pattern(5, 5))
    for name, text in (
        ("six_col", "0 0.5 0.5 0.2 0.2 0.1\n"),
        ("neg_cls", "-1 0.5 0.5 0.2 0.2\n"),
        ("big_cls", f"{NC} 0.5 0.5 0.2 0.2\n"),
        ("coord", "0 1.5 0.5 0.2 0.2\n"),
        ("nan", "0 nan 0.5 0.2 0.2\n"),
        ("nonutf8", b"\xff\xfe0 0.5 0.5 0.2 0.2\n"),
    ):
        cv2.imwrite(str(images / f"{name}.jpg"), _pattern(32, 32, seed=10))
        label(name, text)
    label("tiny", GOOD_ROW)
    label("garbage", GOOD_ROW)
    label("orphan", GOOD_ROW)  # a label without an image is never looked at
    return {"labelled": 10, "background": 1, "empty": 1, "corrupt": 10, "duplicates": 1}


@pytest.fixture()
def broken(tmp_path: Path) -> Path:
    make_broken_dataset(tmp_path)
    return tmp_path / "images" / "train"


def _scan_counter(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = yolo_labels.scan

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(yolo_labels, "scan", counting)
    return calls


def test_broken_dataset_counts_exact_and_good_samples_intact(broken: Path) -> None:
    label_set = load_label_set(list_image_files(str(broken)), nc=NC, source=str(broken))
    assert label_set.counts == {
        "labelled": 10,
        "background": 1,
        "empty": 1,
        "corrupt": 10,
        "duplicates": 1,
        "label_files_unusable": 6,
    }
    names = {Path(f).stem for f in label_set.im_files}
    assert names == {
        "good_a",
        "good_b",
        "truncated",
        "rgba",
        "deep",
        "gray",
        "exif",
        "dup",
        "excess",
        "bitmap",
        "nolabel",
        "empty",
    }
    # one warning per problem, each naming its file
    for stem in (
        "garbage",
        "broken_markers",
        "zero",
        "tiny",
        "six_col",
        "neg_cls",
        "big_cls",
        "coord",
        "nan",
        "nonutf8",
        "truncated",
        "dup",
    ):
        assert any(f"{stem}." in m for m in label_set.messages), stem
    by_name = {Path(f).stem: i for i, f in enumerate(label_set.im_files)}
    assert label_set.labels[by_name["dup"]].shape == (2, 5)
    np.testing.assert_allclose(
        label_set.labels[by_name["good_b"]], [[1, 0.3, 0.3, 0.2, 0.2], [2, 0.7, 0.7, 0.3, 0.3]], atol=1e-6
    )
    assert label_set.labels[by_name["excess"]][0, 3] == pytest.approx(1.0)  # clipped, not rejected
    assert label_set.labels[by_name["nolabel"]].shape == (0, 5)
    assert tuple(label_set.shapes[by_name["exif"]]) == (20, 40)  # (w, h) after the EXIF rotation

    dataset = YoloDataset(str(broken), imgsz=32, nc=NC, workers=0)
    samples = {Path(dataset[i][2]).stem: dataset[i] for i in range(dataset.n)}
    assert len(samples) == 12
    img, targets, _, shapes = samples["good_a"]
    expected_img = cv2.imread(str(broken / "good_a.jpg"))[:, :, ::-1].transpose(2, 0, 1)
    np.testing.assert_array_equal(img.numpy(), expected_img)
    np.testing.assert_allclose(targets[:, 1:].numpy(), [[0, 0.5, 0.5, 0.25, 0.25]], atol=1e-6)
    assert shapes == ((32, 32), ((1.0, 1.0), (0.0, 0.0)))
    for stem in ("rgba", "deep", "gray", "bitmap", "truncated"):
        assert samples[stem][0].shape[0] == 3
    assert int(samples["deep"][0][0, 12, 12]) == 40000 // 256  # 16-bit scaled to 8-bit
    exif_img = read_image(str(broken / "exif.jpg"))
    assert exif_img.shape[:2] == (40, 20)
    assert exif_img[2, :].mean() > 200 and exif_img[-3, :].mean() < 50  # the bright band rotated to the top


def test_probe_image_reads_sizes_without_decoding(tmp_path: Path) -> None:
    cv2.imwrite(str(tmp_path / "a.jpg"), _pattern(30, 50))
    cv2.imwrite(str(tmp_path / "a.png"), _pattern(30, 50))
    assert probe_image(str(tmp_path / "a.jpg")) == ((50, 30), "")
    assert probe_image(str(tmp_path / "a.png")) == ((50, 30), "")
    data = _jpeg_bytes(_pattern(30, 50))
    (tmp_path / "cut.jpg").write_bytes(data[:120])  # header gone: unusable
    with pytest.raises(ImageError):
        probe_image(str(tmp_path / "cut.jpg"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("0 0.5 0.5 0.2\n", "4 columns"),
        ("0 0.5 0.5 0.2 0.2 0.3\n", "6 columns"),
        ("0.5 0.5 0.5 0.2 0.2\n", "class"),
        ("0 0.5 0.5 0 0.2\n", "positive"),
        ("0 inf 0.5 0.2 0.2\n", "row 1: 'inf' is not a finite number"),
        ("0 0.5 nan 0.2 0.2\n", "row 1: 'nan' is not a finite number"),
        ("0 0.5 0.5 1e400 0.2\n", "row 1: '1e400' is not a finite number"),
        ("0 a 0.5 0.2 0.2\n", "row 1: 'a' is not a number"),
        ("0 0.5 -0.01 0.2 0.2\n", "outside"),
    ],
)
def test_parse_label_text_rejects(text: str, message: str) -> None:
    with pytest.raises(LabelError, match=message):
        parse_label_text(text, NC)


def test_parse_label_text_accepts_segments_clips_and_dedups() -> None:
    labels, dups = parse_label_text("2 0.1 0.1 0.5 0.1 0.5 0.7\n\n0 0.9 0.5 0.4 0.2\n0 0.9 0.5 0.4 0.2\n", NC)
    assert dups == 1
    np.testing.assert_allclose(labels[0], [2, 0.3, 0.4, 0.4, 0.6], atol=1e-6)  # polygon -> enclosing box
    np.testing.assert_allclose(labels[1], [0, 0.85, 0.5, 0.3, 0.2], atol=1e-6)  # right edge clipped at 1
    assert parse_label_text("  \n", NC)[0].shape == (0, 5)


def _small_dataset(root: Path, n: int = 4) -> Path:
    images, labels = root / "images" / "val", root / "labels" / "val"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)
    for i in range(n):
        cv2.imwrite(str(images / f"{i}.jpg"), _pattern(32, 32, seed=i))
        (labels / f"{i}.txt").write_text(GOOD_ROW)
    return images


def test_cache_reused_then_rebuilt_when_stale(tmp_path: Path, monkeypatch) -> None:
    images = _small_dataset(tmp_path)
    files = list_image_files(str(images))
    calls = _scan_counter(monkeypatch)
    first = load_label_set(files, nc=NC, source=str(images))
    assert first.cache_file == str(tmp_path / "labels" / "val.yolo-train.cache") and len(calls) == 1
    second = load_label_set(files, nc=NC, source=str(images))
    assert len(calls) == 1 and second.counts == first.counts
    label = tmp_path / "labels" / "val" / "0.txt"
    label.write_text("1 0.5 0.5 0.5 0.5\n")
    os.utime(label, ns=(1, 1))  # a different mtime even on coarse file systems
    third = load_label_set(files, nc=NC, source=str(images))
    assert len(calls) == 2 and third.labels[0][0, 0] == 1
    load_label_set(files, nc=NC + 1, source=str(images))  # nc decides validity: part of the key
    assert len(calls) == 3
    assert not [p for p in (tmp_path / "labels").iterdir() if p.name.endswith(".tmp")]  # no temp files left


def test_truncated_and_other_version_caches_rebuilt(tmp_path: Path, monkeypatch) -> None:
    images = _small_dataset(tmp_path)
    files = list_image_files(str(images))
    calls = _scan_counter(monkeypatch)
    cache = Path(load_label_set(files, nc=NC, source=str(images)).cache_file)
    data = cache.read_bytes()
    cache.write_bytes(data[: len(data) // 2])
    assert load_label_set(files, nc=NC, source=str(images)).counts["labelled"] == 4
    assert len(calls) == 2
    with np.load(cache, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["version"] = np.array(999)
    write_cache(cache, arrays)
    load_label_set(files, nc=NC, source=str(images))
    assert len(calls) == 3
    with np.load(cache, allow_pickle=False) as z:
        assert int(z["version"]) == label_cache.CACHE_VERSION


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_foreign_pickle_cache_is_never_executed(tmp_path: Path, monkeypatch) -> None:
    images = _small_dataset(tmp_path)
    marker = tmp_path / "pwned"
    cache = tmp_path / "labels" / "val.yolo-train.cache"
    cache.write_bytes(pickle.dumps({"hash": _Exploit(marker)}))
    assert read_cache(cache, "anything") is None
    np.save(tmp_path / "obj.npy", np.array([_Exploit(marker)], dtype=object), allow_pickle=True)
    os.replace(tmp_path / "obj.npy", cache)  # YOLOv5-style cache: an object array in .npy format
    calls = _scan_counter(monkeypatch)
    label_set = load_label_set(list_image_files(str(images)), nc=NC, source=str(images))
    assert len(calls) == 1 and label_set.counts["labelled"] == 4
    assert not marker.exists()


def test_read_only_labels_fall_back_to_user_cache(tmp_path: Path, monkeypatch) -> None:
    images = _small_dataset(tmp_path)
    primary = tmp_path / "labels" / "val.yolo-train.cache"
    real_write = label_cache.write_cache

    def refuse_primary(path: Path, arrays) -> None:
        if path == primary:
            raise PermissionError("read-only file system")
        real_write(path, arrays)

    monkeypatch.setattr(label_cache, "write_cache", refuse_primary)
    monkeypatch.setattr(label_cache, "FALLBACK_CACHE_DIR", tmp_path / "user_cache")
    calls = _scan_counter(monkeypatch)
    files = list_image_files(str(images))
    first = load_label_set(files, nc=NC, source=str(images))
    assert Path(first.cache_file).parent == tmp_path / "user_cache" and not primary.exists()
    load_label_set(files, nc=NC, source=str(images))
    assert len(calls) == 1  # the fallback cache is found again


def test_process_pool_matches_in_process(tmp_path: Path, monkeypatch) -> None:
    images = _small_dataset(tmp_path, n=40)
    files = list_image_files(str(images))
    lbs = [f.replace("/images/", "/labels/").replace(".jpg", ".txt") for f in files]
    serial = yolo_labels.scan(files, lbs, NC, workers=1, show_progress=False)
    monkeypatch.setattr(yolo_labels, "MIN_POOL_SIZE", 1)
    pooled = yolo_labels.scan(files, lbs, NC, workers=2, show_progress=False)
    assert sum(len(c[1][0]) for c in pooled) == 40
    assert [x for c in serial for x in c[1][0]] == [x for c in pooled for x in c[1][0]]
    assert np.array_equal(np.concatenate([c[1][3] for c in serial]), np.concatenate([c[1][3] for c in pooled]))
    assert [s for c in serial for s in c[1][1]] == [s for c in pooled for s in c[1][1]]


def test_no_usable_image_is_a_user_error(tmp_path: Path) -> None:
    images = tmp_path / "images" / "train"
    images.mkdir(parents=True)
    (images / "a.jpg").write_bytes(b"not an image")
    with pytest.raises(UserError, match="no usable images"):
        load_label_set(list_image_files(str(images)), nc=NC, source=str(images))


def test_our_cache_has_its_own_name_beside_yolov5s(tmp_path: Path) -> None:
    images = _small_dataset(tmp_path)
    yolov5_cache = tmp_path / "labels" / "val.cache"  # where YOLOv5 keeps its own, differently formatted cache
    yolov5_cache.write_bytes(b"YOLOv5's cache, not ours")
    before = yolov5_cache.stat().st_mtime_ns
    label_set = load_label_set(list_image_files(str(images)), nc=NC, source=str(images))
    assert Path(label_set.cache_file).name == "val.yolo-train.cache" and Path(label_set.cache_file).is_file()
    assert yolov5_cache.read_bytes() == b"YOLOv5's cache, not ours" and yolov5_cache.stat().st_mtime_ns == before
