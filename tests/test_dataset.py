"""YoloDataset and create_dataloader: batch format, reproducibility across workers and ranks, caches, rect."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import utils.data.dataset as dataset_module
import utils.data.image_source as image_source_module
from models.families import YOLOV5
from utils.boxes import scale_boxes, xywh2xyxy
from utils.data.dataset import YoloDataset
from utils.data.image_io import read_image_region
from utils.data.jpeg_region import load_decoder
from utils.data.loader import create_dataloader
from utils.data.shapes import generate_shapes

IMGSZ = 64
HYP = YOLOV5.hyp_type(
    hsv_h=0.015,
    hsv_s=0.7,
    hsv_v=0.4,
    degrees=5.0,
    translate=0.1,
    scale=0.5,
    shear=2.0,
    perspective=0.0,
    flipud=0.2,
    fliplr=0.5,
    mosaic=0.7,
    mixup=0.5,
)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=12, n_val=10, imgsz=IMGSZ, seed=0)


def _train(root: Path, **kwargs):
    options = {"hyp": HYP, "augment": True, "shuffle": True, "seed": 5, "nc": 5, "workers": 0, **kwargs}
    return create_dataloader(str(root / "images" / "train"), IMGSZ, 4, 32, **options)


def _epochs(loader, epochs: tuple[int, ...]) -> list[tuple]:
    out = []
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        out += [(imgs.clone(), targets.clone(), paths) for imgs, targets, paths, _ in loader]
    return out


def test_batch_format(data_root: Path) -> None:
    loader, dataset = _train(data_root)
    imgs, targets, paths, shapes = next(iter(loader))
    assert imgs.dtype == torch.uint8 and imgs.shape == (4, 3, IMGSZ, IMGSZ)
    assert targets.dtype == torch.float32 and targets.shape[1] == 6
    assert set(targets[:, 0].long().tolist()) <= set(range(4))
    assert (targets[:, 2:] >= 0).all() and (targets[:, 2:] <= 1).all() and (targets[:, 4:] > 0).all()
    assert len(paths) == 4 and len(shapes) == 4
    assert dataset.n == 12 and len(dataset.labels) == 12 and dataset.shapes.shape == (12, 2)
    assert all(lb.dtype == np.float32 and lb.shape[1] == 5 for lb in dataset.labels)
    assert dataset.imgsz == IMGSZ and dataset.augment and not dataset.rect and dataset.hyp.mixup == 0.5
    assert torch.equal(dataset[3][0], dataset[(0, 3)][0])  # a plain index means epoch 0


@pytest.mark.slow
def test_same_batches_with_0_or_2_workers_across_epochs(data_root: Path) -> None:
    serial = _epochs(_train(data_root, workers=0)[0], (0, 1))
    parallel = _epochs(_train(data_root, workers=2)[0], (0, 1))  # persistent workers see the new epoch
    assert len(serial) == len(parallel) == 6
    for (i0, t0, p0), (i2, t2, p2) in zip(serial, parallel):
        assert p0 == p2 and torch.equal(i0, i2) and torch.equal(t0, t2)
    assert not torch.equal(serial[0][0], serial[3][0])  # a new epoch, new draws


def test_sample_depends_only_on_seed_epoch_index(data_root: Path) -> None:
    reference = _train(data_root)[1]
    for rank in range(2):
        loader, dataset = _train(data_root, world_size=2, global_rank=rank)
        loader.sampler.set_epoch(3)
        pairs = list(loader.sampler)
        assert len(pairs) == 6 and {e for e, _ in pairs} == {3}
        for pair in pairs[:3]:
            mine, ref = dataset[pair], reference[pair]
            assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])
    # resume: a fresh dataset gives the same sample for the same (epoch, index); other epochs differ
    again = _train(data_root)[1]
    assert torch.equal(again[(3, 4)][0], reference[(3, 4)][0])
    assert not torch.equal(reference[(2, 4)][0], reference[(3, 4)][0])


def test_close_mosaic_epoch_turns_mosaic_off(data_root: Path) -> None:
    _, dataset = _train(data_root, hyp=HYP.replace(mosaic=1.0), close_mosaic_epoch=2)
    assert all(dataset[(1, i)][3] is None for i in range(4))  # mosaic samples carry no letterbox info
    assert all(dataset[(2, i)][3] is not None for i in range(4))


def test_validation_rect_batches_sharded_over_ranks(data_root: Path) -> None:
    seen: list[str] = []
    for rank in range(2):
        loader, dataset = create_dataloader(
            str(data_root / "images" / "val"),
            IMGSZ,
            4,
            32,
            rect=True,
            pad=0.5,
            world_size=2,
            global_rank=rank,
            nc=5,
            workers=0,
        )
        assert dataset.rect and dataset.batch_shapes is not None and (dataset.batch_shapes % 32 == 0).all()
        for imgs, _, paths, _ in loader:
            assert imgs.shape[2] % 32 == 0 and imgs.shape[3] % 32 == 0
            seen += paths
    assert len(seen) == 10 and len(set(seen)) == 10  # every image once, on exactly one rank


def test_letterbox_shapes_map_boxes_back_to_the_original(data_root: Path) -> None:
    loader, dataset = create_dataloader(
        str(data_root / "images" / "val"), 96, 5, 32, rect=True, pad=0.5, nc=5, workers=0
    )
    checked = 0
    for imgs, targets, paths, shapes in loader:
        h, w = imgs.shape[2:]
        for i, path in enumerate(paths):
            t = targets[targets[:, 0] == i]
            boxes = xywh2xyxy(t[:, 2:] * torch.tensor([w, h, w, h]))
            (h0, w0), ratio_pad = shapes[i]
            restored = scale_boxes((h, w), boxes, (h0, w0), ratio_pad=ratio_pad)
            label = dataset.labels[dataset.im_files.index(path)]
            original = xywh2xyxy(torch.from_numpy(label[:, 1:].copy()) * torch.tensor([w0, h0, w0, h0]))
            assert torch.allclose(restored, original, atol=0.6)
            checked += len(t)
    assert checked > 10


def test_ram_and_disk_caches_give_identical_samples(data_root: Path) -> None:
    plain = _train(data_root)[1]
    ram = _train(data_root, cache="ram")[1]
    assert ram.cache == "ram" and all(im is not None for im in ram.ram_images)
    for index in range(6):
        first = ram[(1, index)][0]
        assert torch.equal(first, plain[(1, index)][0])
        assert torch.equal(ram[(1, index)][0], first)  # augmentation never alters the cached image
    disk = _train(data_root, cache="disk")[1]
    assert all(disk.npy_file(i).is_file() for i in range(disk.n))
    assert not list((data_root / "images" / "train").glob("*.tmp"))
    for index in range(3):
        assert torch.equal(disk[(1, index)][0], plain[(1, index)][0])
    for f in (disk.npy_file(i) for i in range(disk.n)):
        f.unlink()


@pytest.fixture(scope="module")
def mixed_sizes_root(tmp_path_factory) -> Path:
    """JPEGs at, above (2x and not) and below IMGSZ, with one labelled rectangle each."""
    root = tmp_path_factory.mktemp("mixed")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(64, 48), (100, 75), (128, 96), (40, 30), (200, 90), (57, 64)] * 2):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img = cv2.GaussianBlur(img, (5, 5), 0)  # texture a JPEG keeps: every pixel still differs
        cv2.imwrite(str(root / "images" / f"{i}.jpg"), img)
        (root / "labels" / f"{i}.txt").write_text("1 0.5 0.5 0.4 0.3\n")
    return root


@pytest.mark.parametrize("which", ["shapes", "mixed sizes"])
def test_mosaic_tiles_decoded_in_part_give_the_same_samples(
    which: str, data_root: Path, mixed_sizes_root: Path, monkeypatch
) -> None:
    images = str(data_root / "images" / "train") if which == "shapes" else str(mixed_sizes_root / "images")
    dataset = create_dataloader(images, IMGSZ, 4, 32, hyp=HYP, augment=True, shuffle=True, workers=0, nc=5)[1]
    decoded_parts = []

    def counting(path: str, shape_hw: tuple[int, int], region: tuple[int, int, int, int], out=None, decoder=None):
        part = read_image_region(path, shape_hw, region, out, decoder)
        decoded_parts.append(part is not None and part.shape[:2] != shape_hw)
        return part

    monkeypatch.setattr(image_source_module, "read_image_region", counting)
    pairs = [(epoch, index) for epoch in (1, 2, 3) for index in range(12)]
    partial = [dataset[pair][0] for pair in pairs]
    if load_decoder() is not None:
        assert sum(decoded_parts) > 24  # most tiles came from partial decodes
    monkeypatch.setattr(image_source_module, "read_image_region", lambda *args: None)
    for pair, img in zip(pairs, partial):
        assert torch.equal(dataset[pair][0], img), pair


def test_ram_cache_refused_when_memory_is_short(data_root: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(dataset_module, "available_memory_bytes", lambda: 1000)
    logger = logging.getLogger("yolo")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="yolo"):
        dataset = YoloDataset(str(data_root / "images" / "val"), IMGSZ, cache="ram", nc=5, workers=0)
    assert dataset.cache is None and all(im is None for im in dataset.ram_images)
    assert "--cache ram needs" in caplog.text
    assert dataset[0][0].shape == (3, IMGSZ, IMGSZ)


def test_dataset_builds_label_cache_once_per_split(data_root: Path) -> None:
    _, dataset = _train(data_root)
    assert dataset.cache_file == str(data_root / "labels" / "train.yolo-train.cache")
    assert dataset.label_counts["labelled"] + dataset.label_counts["empty"] + dataset.label_counts["background"] == 12


def test_disk_cache_on_read_only_folder_warns_once(data_root: Path, monkeypatch, caplog) -> None:
    def refuse(path: Path):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(dataset_module, "atomic_output", refuse)
    monkeypatch.setattr(logging.getLogger("yolo"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="yolo"):
        dataset = YoloDataset(str(data_root / "images" / "val"), IMGSZ, cache="disk", nc=5, workers=0)
    assert caplog.text.count("could not be written") == 1 and "10 of 10" in caplog.text
    assert dataset[0][0].shape == (3, IMGSZ, IMGSZ)


def test_rect_training_letterboxes_to_the_batch_shape_without_mosaic(data_root: Path) -> None:
    loader, dataset = create_dataloader(
        str(data_root / "images" / "train"), IMGSZ, 4, 32, hyp=HYP, augment=True, rect=True, pad=0.0, nc=5, workers=0
    )
    loader.sampler.set_epoch(0)
    for b, (imgs, _, _, shapes) in enumerate(loader):  # rect keeps the dataset order: batch b is batch_shapes[b]
        assert tuple(imgs.shape[2:]) == tuple(dataset.batch_shapes[b])
        assert all(s is not None for s in shapes)  # letterboxed samples, no mosaic


def test_rect_orders_equal_aspect_ratios_as_yolov5_does(tmp_path: Path) -> None:
    # YOLOv5 sorts by aspect ratio with numpy's default (unstable) sort; equal ratios must fall in the same
    # batches, or the same image gets another letterbox shape here than in YOLOv5's val.py.
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    sizes = [(48, 36), (36, 48), (48, 48), (40, 30)] * 12  # many images of each ratio
    for i, (w, h) in enumerate(sizes):
        cv2.imwrite(str(tmp_path / "images" / f"{i:03d}.png"), np.full((h, w, 3), i * 5 % 256, np.uint8))
        (tmp_path / "labels" / f"{i:03d}.txt").write_text("0 0.5 0.5 0.4 0.3\n")
    files = sorted(str(p) for p in (tmp_path / "images").iterdir())
    wh = np.array([cv2.imread(f).shape[1::-1] for f in files], dtype=np.float64)
    ratio = wh[:, 1] / wh[:, 0]
    yolov5_order = [files[i] for i in ratio.argsort()]
    assert yolov5_order != [files[i] for i in np.argsort(ratio, kind="stable")]  # the ties are ordered differently
    dataset = create_dataloader(str(tmp_path / "images"), 64, 4, 32, rect=True, pad=0.5, nc=1, workers=0)[1]
    assert dataset.im_files == yolov5_order
