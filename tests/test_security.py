"""Hostile input (issue 49, "Security"): names that are paths, pipe: sources, image bombs, undecodable images."""

from __future__ import annotations

import argparse
import struct
import tracemalloc
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest

import check_data
import detect
from utils.cli import apply_data_limits
from utils.data.config import load_data_config
from utils.data.image_io import PNG_SIGNATURE as PNG
from utils.data.labels import load_labels
from utils.data.loader import create_dataloader
from utils.data.sources import Frame, iter_source
from utils.errors import UserError
from utils.safe_paths import MAX_BYTES, PathParts, safe_part


def test_safe_part_and_collisions() -> None:
    assert safe_part("../../../../outside") == "_._.._.._.._outside"
    assert safe_part("/srv/outside") == "_srv_outside"
    assert safe_part(".hidden") == "_hidden" and safe_part("") == "_" and safe_part("traffic light") == "traffic_light"
    assert len(safe_part("é" * 300).encode()) == MAX_BYTES
    parts = PathParts(["a/b", "a_b", "A_B", "a/b"])
    assert [parts.part(t) for t in ("a/b", "a_b", "A_B")] == ["a_b", "a_b_2", "A_B_3"]
    assert parts.part("x" * 300) == "x" * MAX_BYTES and parts.part("x" * 301) == "x" * (MAX_BYTES - 2) + "_2"


def _frame_outputs(save_dir: Path, names: list[str], path: str, kind: str = "image") -> None:
    """detect.py's outputs of one frame with two detections, one of each class, without running a model."""
    frame = Frame(path=path, image=np.full((64, 64, 3), 120, np.uint8), kind=kind, index=3, n_frames=5)
    det = np.array([[4, 4, 30, 30, 0.9, 0], [20, 20, 60, 60, 0.8, 1]], np.float32)
    opt = argparse.Namespace(
        save_txt=True, save_conf=True, save_crop=True, nosave=False, hide_labels=False, hide_conf=False
    )
    writers = detect._Writers(save_dir, names)
    try:
        detect._handle_frame(frame, det, names, opt, save_dir, writers, False, detect.DetectResults(save_dir))
    finally:
        writers.close()


def test_hostile_class_names_write_nothing_outside_the_run_folder(tmp_path) -> None:
    """Class names (from a data YAML or a checkpoint) climbing out with ../ or absolute, as detect.py's crop
    folders; a hostile stem too: nothing is written outside the run folder."""
    outside = tmp_path / "abs_outside"
    names = ["../../../../outside", str(outside)]
    save_dir = tmp_path / "a" / "b" / "runs" / "exp"
    save_dir.mkdir(parents=True)
    (save_dir / "labels").mkdir()
    before = set(tmp_path.rglob("*"))
    _frame_outputs(save_dir, names, str(tmp_path / "..jpg"))
    _frame_outputs(save_dir, names, str(tmp_path / "clip.mp4"), kind="video")
    new = set(tmp_path.rglob("*")) - before
    assert [p for p in new if save_dir.resolve() not in p.resolve().parents] == [] and not outside.exists()
    crops = {p.relative_to(save_dir).parts[1] for p in save_dir.glob("crops/*/*.jpg")}
    assert crops == {"_._.._.._.._outside", safe_part(str(outside))}
    assert {p.name for p in save_dir.glob("labels/*.txt")} == {"_.txt", "clip_3.txt"}


def _pipe_yaml(tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """A data YAML whose train entry is a pipe: command, and one whose shard list holds one."""
    command = f"pipe:touch {marker}; exit 1"
    direct = tmp_path / "direct.yaml"
    direct.write_text(f'path: {tmp_path}\ntrain: "{command}"\nval: "{command}"\nnames: [a]\n')
    (tmp_path / "shards.txt").write_text(f"{command}\n")
    listed = tmp_path / "listed.yaml"
    listed.write_text(f"path: {tmp_path}\ntrain: shards.txt\nval: shards.txt\nnames: [a]\n")
    return direct, listed


def test_pipe_sources_run_nothing_without_the_opt_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    for data in _pipe_yaml(tmp_path, marker):
        with pytest.raises(UserError, match="pipe: URL, which runs a shell command.*--allow-pipe"):
            load_labels(load_data_config(data)["train"], nc=1)
        assert check_data.main(["--data", str(data), "--workers", "0", "--noplots"]) == 1
        assert not marker.exists()


def test_pipe_sources_run_with_the_opt_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    direct, listed = _pipe_yaml(tmp_path, marker)
    assert check_data.main(["--data", str(direct), "--workers", "0", "--noplots", "--allow-pipe"]) == 1  # exit 1
    assert marker.is_file()
    marker.unlink()
    monkeypatch.setenv("YOLO_ALLOW_PIPE", "1")
    with pytest.raises(UserError, match="cannot fetch shard"):  # the command ran, and failed as it was written to
        load_labels(load_data_config(listed)["train"], nc=1)
    assert marker.is_file()


def _bomb_jpeg() -> bytes:
    """23 bytes: SOI, a baseline frame header claiming 65535x65535 (three components), EOI; no pixels at all."""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, 65535, 65535, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    data = b"\xff\xd8" + sof + b"\xff\xd9"
    assert len(data) == 23
    return data


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _large_png(side: int) -> bytes:
    """A valid black 1-bit PNG of side x side, compressed a row at a time (never held raw in memory)."""
    row, packer = b"\x00" * (1 + (side + 7) // 8), zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return PNG + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _undecodable_jpeg() -> bytes:
    """A JPEG whose header (64x64) and end marker are intact, but whose scan names a component the frame does not
    have: libjpeg gives up on the body."""
    _, good = cv2.imencode(".jpg", np.full((64, 64, 3), 90, np.uint8))
    data = bytearray(good.tobytes())
    data[data.index(b"\xff\xda") + 5] = 9  # the scan's first component id: the frame's are 1, 2, 3
    return bytes(data)


def _hostile_images(root: Path) -> Path:
    """A data YAML over two good images and three hostile ones, each with a box."""
    images, labels = root / "images", root / "labels"
    images.mkdir(parents=True)
    labels.mkdir()
    for i in range(2):
        cv2.imwrite(str(images / f"good{i}.jpg"), np.full((48, 64, 3), 100 + 40 * i, np.uint8))
    (images / "bomb.jpg").write_bytes(_bomb_jpeg())
    (images / "large.png").write_bytes(_large_png(17000))  # 2.9e8 pixels, over the default 2**28
    (images / "body.jpg").write_bytes(_undecodable_jpeg())
    for p in images.iterdir():
        (labels / f"{p.stem}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    yaml_file = root / "data.yaml"
    yaml_file.write_text(f"path: {root}\ntrain: images\nval: images\nnames: [a]\n")
    return yaml_file


def test_image_bombs_and_undecodable_bodies_are_skipped_counted_and_never_allocated(tmp_path, caplog) -> None:
    yaml_file = _hostile_images(tmp_path)
    assert cv2.imdecode(np.frombuffer(_undecodable_jpeg(), np.uint8), cv2.IMREAD_COLOR) is None
    tracemalloc.start()
    try:
        table = load_labels(load_data_config(yaml_file)["train"], nc=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(Path(f).name for f in table.im_files) == ["good0.jpg", "good1.jpg"]
    assert table.counts["corrupt"] == 3 and table.counts["labelled"] == 2, table.counts
    assert peak < 64 << 20, peak  # the large PNG is 870 MB of pixels as a 3-channel image
    said = " ".join(table.messages)
    assert "65535x65535 is over --max-pixels" in said and "17000x17000 is over --max-pixels" in said
    assert said.count("body.jpg") == 1 and "undecodable body" in said
    _, dataset = create_dataloader(load_data_config(yaml_file)["train"], 64, 2, 32, workers=0, nc=1)
    assert sorted(Path(f).name for f in dataset.im_files) == ["good0.jpg", "good1.jpg"]  # nothing trained grey
    caplog.clear()
    for _ in range(2):  # every read of the training set, an epoch each: no warning about any image
        for i in range(len(dataset)):
            dataset[(0, i)]
    assert "grey" not in caplog.text and "cannot decode" not in caplog.text


def test_check_data_counts_each_skip_once_and_max_pixels_sets_the_cap(tmp_path, capsys) -> None:
    yaml_file = _hostile_images(tmp_path)
    assert check_data.main(["--data", str(yaml_file), "--workers", "0", "--noplots"]) == 0
    out = capsys.readouterr().out
    assert out.count("train: 2 images (0 backgrounds), 2 instances; 3 corrupt images") == 1, out
    assert out.count("body.jpg: corrupt image, skipped (cannot decode image (intact header, undecodable body))") == 2
    # A cap of 4000 pixels: the good 64x48 images (3072) stay, the 64x64 one is skipped before it is decoded; the
    # label cache written under the default cap is not reused.
    assert check_data.main(["--data", str(yaml_file), "--workers", "0", "--noplots", "--max-pixels", "4000"]) == 0
    out = capsys.readouterr().out
    assert (
        "train: 2 images" in out
        and "body.jpg: corrupt image, skipped (image size 64x64 is over --max-pixels 4000" in out
    )


def test_detect_reads_no_image_over_max_pixels(tmp_path, monkeypatch) -> None:
    """detect.py's sources: an image over --max-pixels by its header is reported and never decoded."""
    (tmp_path / "bomb.jpg").write_bytes(_bomb_jpeg())
    (tmp_path / "bomb.bmp").write_bytes(b"BM" + bytes(12) + struct.pack("<Iii", 40, 60000, -60000) + bytes(28))
    cv2.imwrite(str(tmp_path / "small.png"), np.full((48, 64, 3), 90, np.uint8))
    apply_data_limits(argparse.Namespace(max_pixels=3000))  # as detect.py --max-pixels 3000 sets it
    frames = {Path(f.path).name: f for f in iter_source(str(tmp_path))}
    assert frames["bomb.jpg"].image is None and "65535x65535 is over --max-pixels 3000" in frames["bomb.jpg"].error
    assert frames["bomb.bmp"].image is None and "60000x60000 is over --max-pixels 3000" in frames["bomb.bmp"].error
    assert frames["small.png"].image is None and "64x48 is over --max-pixels 3000" in frames["small.png"].error
    monkeypatch.setenv("YOLO_MAX_PIXELS", "4000")
    assert next(iter_source(str(tmp_path / "small.png"))).image.shape == (48, 64, 3)


def test_an_image_broken_after_its_check_is_grey_at_the_training_size_and_warned_once(tmp_path, caplog) -> None:
    yaml_file = _hostile_images(tmp_path)
    _, dataset = create_dataloader(load_data_config(yaml_file)["train"], 32, 2, 32, workers=0, nc=1)
    broken = dataset.im_files.index(str(tmp_path / "images" / "good0.jpg"))
    (tmp_path / "images" / "good0.jpg").write_bytes(_undecodable_jpeg())  # changed after the labels were read
    caplog.clear()
    # What is allocated for it: an image at the training size (long side 32), not at the 64x48 its header claimed.
    assert [dataset._read_original(broken).shape for _ in range(3)] == [(24, 32, 3)] * 3
    assert caplog.text.count("good0.jpg: cannot decode image") == 1


def _tiff(width: int, height: int, big: bool = False, endian: str = "<", tile: int = 0) -> bytes:
    """A TIFF (classic or BigTIFF) whose only data is its first IFD, placed after 64 bytes of padding as writers
    that put the IFD after the pixels do: ImageWidth and ImageLength as LONG, and square tiles when ``tile``."""
    tags = [(256, width), (257, height)] + ([(322, tile), (323, tile)] if tile else [])
    order = b"II" if endian == "<" else b"MM"
    if big:
        head = order + struct.pack(endian + "HHHQ", 43, 8, 0, 80)
        entries = b"".join(struct.pack(endian + "HHQQ", t, 16, 1, v) for t, v in tags)
        ifd = struct.pack(endian + "Q", len(tags)) + entries + bytes(8)
    else:
        head = order + struct.pack(endian + "HI", 42, 72)
        entries = b"".join(struct.pack(endian + "HHII", t, 4, 1, v) for t, v in tags)
        ifd = struct.pack(endian + "H", len(tags)) + entries + bytes(4)
    return head + bytes(72 + 8 * big - len(head)) + ifd


def _webp_canvas(width: int, height: int) -> bytes:
    """An extended WebP's header (VP8X) claiming a canvas of width x height, and nothing after it."""
    vp8x = bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(vp8x)) + b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x


def test_every_format_read_has_its_size_read_from_its_header_before_decoding(tmp_path, monkeypatch) -> None:
    """WebP and TIFF (with BMP, JPEG and PNG) give their size from the header before anything is decoded; a claim
    over --max-pixels is refused undecoded, at probe time and at every decode; any other format is not decoded."""
    from utils.data import image_io

    image = np.random.default_rng(0).integers(0, 255, (24, 32, 3), np.uint8)
    encoded = {
        "webp lossless": cv2.imencode(".webp", image)[1].tobytes(),
        "webp lossy": cv2.imencode(".webp", image, [cv2.IMWRITE_WEBP_QUALITY, 80])[1].tobytes(),
        "tiff": cv2.imencode(".tiff", image)[1].tobytes(),
        "bmp": cv2.imencode(".bmp", image)[1].tobytes(),
    }
    assert encoded["webp lossy"][12:16] == b"VP8 " and encoded["webp lossless"][12:16] == b"VP8L"
    for kind, data in encoded.items():
        assert image_io.header_size(data) == (32, 24), kind
        assert image_io.probe_image_bytes(data) == ((32, 24), ""), kind
    assert image_io.header_size(_tiff(30, 20, big=True, endian=">")) == (30, 20)
    assert image_io.header_size(_webp_canvas(3000, 2000)) == (3000, 2000)

    def no_decoding(*args: object) -> None:
        raise AssertionError("decoded")

    monkeypatch.setattr(image_io.cv2, "imdecode", no_decoding)
    hostile = {
        "tiff.tif": (_tiff(65535, 65535), "image size 65535x65535 is over --max-pixels"),
        "bigtiff.tif": (_tiff(100000, 100000, big=True, endian=">"), "image size 100000x100000 is over --max-pixels"),
        "tiles.tif": (_tiff(16, 16, tile=65536), "TIFF tiles of 65536x65536 are over --max-pixels"),
        "canvas.webp": (_webp_canvas(1 << 24, 1 << 24), "image size 16777216x16777216 is over --max-pixels"),
        "cut.tif": (_tiff(16, 16)[:80], "TIFF's first IFD is cut short"),
        "pnm.jpg": (b"P5 60000 60000 255\n" + bytes(64), "not a JPEG, PNG, BMP, TIFF or WebP image"),
        "gif.png": (b"GIF89a" + struct.pack("<HH", 60000, 60000) + bytes(64), "not a JPEG, PNG, BMP, TIFF or WebP"),
    }
    for name, (data, why) in hostile.items():
        with pytest.raises(image_io.ImageError, match=why):
            image_io.probe_image_bytes(data)
        (tmp_path / name).write_bytes(data)
        with pytest.raises(image_io.ImageError, match=why):
            image_io.check_image_size(str(tmp_path / name))  # detect.py's check before it reads a file
        assert image_io.decode_image(np.frombuffer(data, np.uint8)) is None, name  # at every read: nothing decoded


def test_a_png_chunk_claiming_gigabytes_is_refused_without_decoding(monkeypatch) -> None:
    """The fuzzer's slow PNG: a chunk length field claiming 3 GB in a 98-byte file, which OpenCV's reader allocates
    and zeroes (seconds and gigabytes at every read) before finding the bytes missing. Refused from the lengths."""
    from utils.data import image_io

    good = cv2.imencode(".png", np.full((24, 32, 3), 90, np.uint8))[1].tobytes()
    at = good.index(b"IDAT") - 4
    data = good[:at] + struct.pack(">I", 0xBE000048) + good[at + 4 : at + 60]
    assert len(data) < 120

    def no_decoding(*args: object) -> None:
        raise AssertionError("decoded")

    monkeypatch.setattr(image_io.cv2, "imdecode", no_decoding)
    with pytest.raises(image_io.ImageError, match="PNG chunk 'IDAT' claims 3,187,671,112 bytes, past the end"):
        image_io.probe_image_bytes(data)
    assert image_io.decode_image(np.frombuffer(data, np.uint8)) is None
    assert image_io.header_size(good) == (32, 24)  # a whole file's chunks all fit
