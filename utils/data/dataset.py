"""The detection dataset: verified images and labels, optional image cache, reproducible augmentation.

Every random draw for a sample comes from ``np.random.default_rng([seed, epoch, index])``, so a sample
depends only on (seed, epoch, index): not on the worker, the rank, or what was loaded before.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from utils.boxes import xywhn2xyxy, xyxy2xywhn
from utils.data.augmentations import (
    Warp,
    ZoomCrop,
    augment_hsv,
    letterbox,
    linear_resize_source_span,
    long_side_shape,
    mixup,
    paste_region,
    photometric_distort,
    random_flips,
    random_perspective,
    resize_to_long_side,
    warped_mosaic4,
    zoom_out_crop,
)
from utils.data.batch_ring import BatchRing, RingSlot
from utils.data.image_source import ImageSource, open_source
from utils.data.jpeg_region import load_decoder
from utils.data.label_table import LabelRows, LabelTable, PathList
from utils.data.labels import load_labels
from utils.errors import UserError
from utils.files import atomic_output
from utils.hyp import AugmentationHyp, ZoomCropHyp
from utils.log import LOGGER

if TYPE_CHECKING:
    from utils.distributed import DistInfo

CACHE_MODES = (None, "ram", "disk", "auto")
MEMORY_HEADROOM = 1.5  # the RAM cache must fit this many times over in the available memory
# 'auto' caches in RAM only small datasets: decoding is a large share of a CPU training step, and caching a
# few hundred MiB costs little even when several ranks on one machine each hold a copy.
AUTO_CACHE_MAX_BYTES = 512 << 20
AUTO_CACHE_MAX_SHARE = 0.05  # of the available memory


def available_memory_bytes() -> int:
    """Memory available to new allocations (MemAvailable of /proc/meminfo, else free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def rect_batch_shapes(shapes_wh: np.ndarray, batch_size: int, imgsz: int, stride: int, pad: float) -> np.ndarray:
    """(h, w) letterbox shape per batch of aspect-sorted images: multiples of ``stride`` fitting each batch."""
    n = len(shapes_wh)
    n_batches = math.ceil(n / batch_size)
    aspect = shapes_wh[:, 1] / shapes_wh[:, 0]  # h / w
    out = np.ones((n_batches, 2))
    for b in range(n_batches):
        ar = aspect[b * batch_size : (b + 1) * batch_size]
        lo, hi = ar.min(), ar.max()
        if hi < 1:  # all wide: height shrinks
            out[b] = (hi, 1)
        elif lo > 1:  # all tall: width shrinks
            out[b] = (1, 1 / lo)
    return (np.ceil(out * imgsz / stride + pad) * stride).astype(int)


@dataclass(frozen=True)
class DatasetOptions:
    """How a split's samples are made: ``YoloDataset``'s options besides the image size and batch size."""

    augment: bool = False  # training samples: mosaic, warp, mixup, HSV, flips
    hyp: AugmentationHyp | None = None  # the augmentation rates (None: ``AugmentationHyp()``'s)
    rect: bool = False  # images in aspect order, letterboxed to per-batch rectangles
    cache: str | None = None  # decoded images kept: "ram", "disk", "auto" or None
    single_cls: bool = False  # every label one class
    stride: int = 32  # rectangle sides are multiples of it
    pad: float = 0.0  # rectangles padded by this many strides
    nc: int | None = None  # class count the labels are checked against
    seed: int = 0  # augmentation draws are functions of (seed, epoch, index)
    close_mosaic_epoch: int | None = None  # from this epoch on: no mosaic, no mixup (a ZoomCropHyp: no augmentation)
    mosaic_epochs: tuple[int, int] | None = None  # mosaic and mixup only in epochs [start, end) (None: any before)
    workers: int = 8  # threads that read labels and fill caches
    decode_threads: int = 1  # threads that decode a mosaic's tiles in this process
    prefix: str = ""  # before every log line
    verbose: bool = True  # progress bars


class YoloDataset(Dataset):
    """Images and labels of one split, returning ``(img uint8 3xHxW RGB, targets (n, 6), path, shapes)``.

    ``__getitem__`` takes an ``(epoch, index)`` pair (what ShardedSampler yields) or a plain index
    (epoch 0). Training (``augment``) uses mosaic with probability ``hyp.mosaic`` then
    random_perspective, mixup, HSV and flips; other training samples are letterboxed then warped, or with the
    DETR recipes' record (``ZoomCropHyp``) photometrically distorted, zoomed out and IoU-cropped
    (``augmentations.py: photometric_distort, zoom_out_crop``) before their letterbox. Without ``augment`` images
    are only letterboxed, to per-batch rectangles when ``rect``. From ``close_mosaic_epoch`` on, no mosaic and no
    mixup; with a ``ZoomCropHyp``, no augmentation at all (the recipes' no-augmentation stage). Where the family
    gives a window of epochs (``mosaic_epochs``: DEIM's), mosaic and mixup only inside it; with a ``ZoomCropHyp`` a
    sample there is a mosaic (photometrically distorted) with probability ``hyp.mosaic``, else the recipe's zoomed
    and cropped image, and either is mixed up with a partner made the same way with probability ``hyp.mixup``.

    Pixels come from ``source`` (image_source.py: the split's files or tar shards). ``cache='ram'`` keeps the
    decoded, resized images in memory; ``cache='disk'`` saves decoded images as ``.npy`` beside the originals.
    When the estimate does not fit (memory or disk), a warning is logged and the dataset runs without that
    cache: a speed option never stops a run.
    """

    def __init__(
        self,
        path: str | list[str] | None,
        imgsz: int = 640,
        batch_size: int = 16,
        options: DatasetOptions | None = None,
        *,
        label_set: LabelTable | None = None,
        **fields: Any,
    ):
        """The options are one :class:`DatasetOptions` (a loader's ``LoaderOptions`` is one), or its fields given as
        keywords; ``label_set`` (labels already read) replaces reading them from ``path``."""
        o = options if options is not None else DatasetOptions(**fields)
        cache, stride, pad, prefix = o.cache, o.stride, o.pad, o.prefix
        if cache not in CACHE_MODES:
            raise UserError(f"--cache {cache!r}: expected 'ram', 'disk', 'auto' or nothing")
        self.imgsz, self.augment, self.rect, self.stride, self.pad = imgsz, o.augment, o.rect, stride, pad
        self.hyp = o.hyp or AugmentationHyp()
        self.seed, self.close_mosaic_epoch, self.prefix = o.seed, o.close_mosaic_epoch, prefix
        self.mosaic_epochs = o.mosaic_epochs

        if label_set is None:
            assert path is not None, "a dataset needs a split or its labels"
            label_set = load_labels(path, nc=o.nc, workers=o.workers, prefix=prefix, verbose=o.verbose)
        if o.single_cls:
            label_set = label_set.with_single_class()
        self.batch_shapes: np.ndarray | None = None
        if o.rect:
            # numpy's default sort, as YOLOv5's: images of equal aspect ratio then fall into the same batches,
            # and so get the same letterbox shape, as in YOLOv5's val.py (a stable sort moved 6 of the shapes
            # set's 100 validation images into a neighbouring batch of another shape). The order of equal ratios is
            # numpy's: the same for both on one machine and numpy version.
            label_set = label_set.take(np.argsort(label_set.shapes[:, 1] / label_set.shapes[:, 0]))
            self.batch_shapes = rect_batch_shapes(label_set.shapes, batch_size, imgsz, stride, pad)
        # The split lives in a few flat arrays (label_table.py), shared by forked workers without copies.
        self.table = label_set
        # The region decoder is built (or found) and checked now, once, and logged: reads only use it.
        self.jpeg_decoder = load_decoder() if o.augment else None
        self.source: ImageSource = open_source(label_set, self.jpeg_decoder)
        self.label_counts = label_set.counts
        self.cache_file = label_set.cache_file
        self.im_files: PathList = label_set.im_files
        self.labels: LabelRows = label_set.labels  # read-only (n, 5) views per image
        self.shapes: np.ndarray = label_set.shapes  # (N, 2) original (w, h)
        self.n = len(self.im_files)
        self.batch_index = np.arange(self.n) // max(1, batch_size)

        # Loading in the main process (no workers) leaves cores idle: decode a mosaic's tiles in threads.
        self.decode_threads = max(1, o.decode_threads)
        self._decode_pool: ThreadPoolExecutor | None = None
        self._unreadable: set[int] = set()  # images that failed to decode in this process (warned once each)
        if cache == "disk" and not self.source.disk_cacheable:
            LOGGER.warning(f"{prefix}WARNING --cache disk does not apply to {self.source.kind}: not caching")
            cache = None
        self.cache = cache
        self.ram_images: list[np.ndarray | None] = [None] * self.n
        if cache:
            self._fill_cache(cache, o.workers)

    # ----- images ---------------------------------------------------------------------------------
    def _resized_bytes(self) -> int:
        ratio = self.imgsz / self.shapes.max(1)
        return int((np.round(self.shapes[:, 0] * ratio) * np.round(self.shapes[:, 1] * ratio) * 3).sum())

    def _ram_decision(self, mode: str) -> bool:
        """Whether the decoded images go to RAM for ``mode`` 'ram' or 'auto' (a warning says why not)."""
        gib = 1 << 30
        need, have = self._resized_bytes(), available_memory_bytes()
        if mode == "auto":
            return need <= min(AUTO_CACHE_MAX_BYTES, AUTO_CACHE_MAX_SHARE * have)
        if need * MEMORY_HEADROOM > have:
            LOGGER.warning(
                f"{self.prefix}WARNING --cache ram needs {need / gib:.1f} GiB (x{MEMORY_HEADROOM} "
                f"headroom) but {have / gib:.1f} GiB is available: not caching images"
            )
            return False
        return True

    def _fill_cache(self, mode: str, workers: int) -> None:
        gib = 1 << 30
        threads = max(1, min(8, workers, os.cpu_count() or 1))
        if mode in ("ram", "auto"):
            node = self._node_info()
            ok = self._ram_decision(mode) if node is None or node.local_rank == 0 else False
            if node is not None:  # local rank 0 decides for its node: every rank must take the same branch
                from utils.distributed import node_decides

                ok = node_decides(node, "ram-cache", "ram" if ok else "") == "ram"
            if not ok:
                self.cache = None
                return
            mode = self.cache = "ram"
            if node is not None and self._fill_node_cache(node, threads):
                return
            need = self._resized_bytes()
        else:
            need = int((self.shapes.prod(1) * 3 + 128).sum())
            have = shutil.disk_usage(Path(self.im_files[0]).parent).free
            if need > have:
                LOGGER.warning(
                    f"{self.prefix}WARNING --cache disk needs {need / gib:.1f} GiB but "
                    f"{have / gib:.1f} GiB is free: not caching images"
                )
                self.cache = None
                return
        fill = self._cache_one_ram if mode == "ram" else self._cache_one_disk
        with ThreadPoolExecutor(threads) as pool:  # cv2 decoding releases the GIL
            failures = [err for err in pool.map(fill, range(self.n)) if err]
        if failures:  # e.g. a read-only image folder: one warning, not one per image
            LOGGER.warning(
                f"{self.prefix}WARNING --cache disk: {len(failures)} of {self.n} .npy files could not "
                f"be written (first: {failures[0]}); those images are decoded each time"
            )
        LOGGER.info(f"{self.prefix}Cached {self.n - len(failures)} images ({need / gib:.2f} GiB, {mode})")

    @staticmethod
    def _node_info() -> DistInfo | None:
        """This rank's DistInfo when it shares its machine with other ranks of a process group, else None."""
        from utils.distributed import dist_info

        info = dist_info()
        shared = info.is_distributed and info.local_world_size > 1 and torch.distributed.is_initialized()
        return info if shared else None

    def _fill_node_cache(self, info: DistInfo, threads: int) -> bool:
        """Under DDP with several ranks on this machine: one shared-memory copy for all of them (shm_cache.py)."""
        from utils.data.shm_cache import build_node_cache

        shapes_hw = [long_side_shape(int(h), int(w), self.imgsz) for w, h in self.shapes]
        key = f"{self.prefix}|{self.imgsz}|{self.augment}|{self.n}|{self.im_files[0]}|{self.im_files[-1]}"

        def fill(i: int, out: np.ndarray) -> None:
            img = resize_to_long_side(self._decode(i), self.imgsz, self.augment)[0]
            if img.shape == out.shape:
                out[:] = img
            else:  # the file changed size since it was verified: keep boxes aligned with the verified size
                out[:] = cv2.resize(img, out.shape[1::-1], interpolation=cv2.INTER_LINEAR)

        cache = build_node_cache(info, key, shapes_hw, fill, threads, self.prefix)
        if cache is None:
            return False
        self.node_cache = cache
        self.ram_images = list(cache.views)
        LOGGER.info(
            f"{self.prefix}Cached {self.n} images ({cache.nbytes / (1 << 30):.2f} GiB, ram, one copy shared "
            f"by the {info.local_world_size} ranks of this node)"
        )
        return True

    def _cache_one_ram(self, i: int) -> str:
        img = self._decode(i)
        self.ram_images[i] = resize_to_long_side(img, self.imgsz, self.augment)[0]
        return ""

    def _cache_one_disk(self, i: int) -> str:
        """Write image i's .npy unless a current one exists; returns an error message or ''."""
        npy, src = self.npy_file(i), self.im_files[i]
        if npy.is_file() and npy.stat().st_mtime_ns >= os.stat(src).st_mtime_ns:
            return ""
        try:
            with atomic_output(npy) as tmp, open(tmp, "wb") as f:
                np.save(f, self._read_original(i), allow_pickle=False)
        except OSError as e:
            return f"{npy}: {e}"
        return ""

    def npy_file(self, i: int) -> Path:
        """Where --cache disk keeps image ``i`` decoded: beside it, as ``.npy``."""
        return Path(self.im_files[i]).with_suffix(".npy")

    def _read_original(self, i: int) -> np.ndarray:
        img = self.source.read(i)
        if img is None:
            # It decoded when probed (image_checks.py), so the file or shard changed since: keep training going
            # on a grey image at the training size, never one of the size its header claims; said once per image.
            if i not in self._unreadable:
                self._unreadable.add(i)
                LOGGER.warning(
                    f"{self.prefix}WARNING {self.im_files[i]}: cannot decode image (it decoded when the labels were "
                    "checked: the file changed since), using a grey image"
                )
            w, h = (int(v) for v in self.shapes[i])
            img = np.full((*long_side_shape(h, w, self.imgsz), 3), 114, np.uint8)
        return img

    def _decode(self, i: int) -> np.ndarray:
        if self.cache == "disk" and self.npy_file(i).is_file():
            try:
                return np.load(self.npy_file(i), allow_pickle=False)
            except (OSError, ValueError):
                pass  # a damaged .npy: fall back to the image itself
        return self._read_original(i)

    def _read_from_source(self, i: int) -> bool:
        """Image ``i`` comes from its source (no RAM copy, no .npy)."""
        return self.ram_images[i] is None and not (self.cache == "disk" and self.npy_file(i).is_file())

    def load_image(self, i: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        """Image ``i`` resized to long side imgsz (shared with the RAM cache: do not modify in place)."""
        cached = self.ram_images[i]
        if cached is not None:
            h0, w0 = int(self.shapes[i][1]), int(self.shapes[i][0])
            return cached, (h0, w0), cached.shape[:2]
        return resize_to_long_side(self._decode(i), self.imgsz, self.augment)

    # ----- samples --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def before_stage(self, epoch: int) -> bool:
        return self.close_mosaic_epoch is None or epoch < self.close_mosaic_epoch

    def mosaic_enabled(self, epoch: int) -> bool:
        """Whether samples of ``epoch`` may be mosaics and mixups: before the stage, inside the window if any."""
        window = self.mosaic_epochs
        return self.before_stage(epoch) and (window is None or window[0] <= epoch < window[1])

    def partners(self, epoch: int, index: int, k: int, rng: np.random.Generator) -> list[int]:
        """``k`` mosaic or mixup partners of sample ``index``: any sample here (shards draw from a window)."""
        return rng.integers(0, self.n, k).tolist()

    def _mosaic(self, index: int, rng: np.random.Generator, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A 4-image mosaic warped to imgsz x imgsz; labels [cls, x1, y1, x2, y2] in pixels."""
        indices = [index, *self.partners(epoch, index, 3, rng)]
        # Tile shapes come from the label cache, so tiles the warp never shows are not even decoded.
        shapes_hw = [long_side_shape(int(self.shapes[i][1]), int(self.shapes[i][0]), self.imgsz) for i in indices]

        def load(k: int, region: tuple[int, int, int, int], out: np.ndarray) -> None:
            self._load_tile(indices[k], shapes_hw[k], region, out)

        h = self.hyp
        warp = Warp(h.degrees, h.translate, h.scale, h.shear, h.perspective)
        return warped_mosaic4(
            load, shapes_hw, [self.labels[i] for i in indices], self.imgsz, rng, warp, map_fn=self._tile_map()
        )

    def _load_tile(self, i: int, shape_hw: tuple[int, int], region: tuple[int, int, int, int], out: np.ndarray) -> None:
        """Write ``region`` of image ``i`` (resized to ``shape_hw``) into ``out``, decoding only what it needs."""
        if self._read_from_source(i) and self._read_tile_region(i, shape_hw, region, out):
            return
        img = self.load_image(i)[0]
        if img.shape[:2] != shape_hw:  # the file changed size since it was verified: keep boxes aligned
            img = cv2.resize(img, shape_hw[::-1], interpolation=cv2.INTER_LINEAR)
        paste_region(img, region, out)

    def _read_tile_region(
        self, i: int, shape_hw: tuple[int, int], region: tuple[int, int, int, int], out: np.ndarray
    ) -> bool:
        """``_load_tile`` from a partial JPEG decode; False where that cannot be done (the caller decodes it whole)."""
        h0, w0 = int(self.shapes[i][1]), int(self.shapes[i][0])
        if (h0, w0) == shape_hw:
            return self.source.read_region(i, shape_hw, region, out)
        if not self.augment:  # load_image shrinks with INTER_AREA then, which reads wider than a linear resize
            return False
        # Decode the source pixels the region is interpolated from into a full-size frame, then resize it
        # as load_image does: the region's pixels never depend on the undecoded rest of the frame.
        x1, y1, x2, y2 = region
        sx1, sx2 = linear_resize_source_span(x1, x2, w0, shape_hw[1])
        sy1, sy2 = linear_resize_source_span(y1, y2, h0, shape_hw[0])
        frame = np.empty((h0, w0, 3), dtype=np.uint8)
        if not self.source.read_region(i, (h0, w0), (sx1, sy1, sx2, sy2), frame[sy1:sy2, sx1:sx2]):
            return False
        paste_region(resize_to_long_side(frame, self.imgsz, self.augment)[0], region, out)
        return True

    def _tile_map(self) -> Callable:
        """``map`` over mosaic tiles: a thread pool when ``decode_threads`` > 1 (cv2 decodes without the GIL)."""
        if self.decode_threads <= 1:
            return map
        if self._decode_pool is None:  # created where it is used: a pool does not survive a fork
            self._decode_pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="decode")
        return self._decode_pool.map

    def augments(self, epoch: int) -> bool:
        """Whether samples of ``epoch`` are augmented: training ones, except in the recipes' no-augmentation stage
        (a ``ZoomCropHyp`` record from ``close_mosaic_epoch`` on)."""
        return self.augment and (self.before_stage(epoch) or not isinstance(self.hyp, ZoomCropHyp))

    def _zoom_cropped(self, index: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The DETR recipes' sample: photometric distortion, zoom-out and IoU crop of the image at its training
        size, then letterboxed to imgsz x imgsz; labels [cls, x1, y1, x2, y2] in its pixels."""
        hy = cast(ZoomCropHyp, self.hyp)
        img, _, (h, w) = self.load_image(index)
        labels = self.labels[index].copy()
        if len(labels):
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], w, h)
        img = photometric_distort(img, rng, hy.photometric)
        rates = ZoomCrop(hy.zoom_out, hy.zoom_out_max, hy.iou_crop)
        img, labels = zoom_out_crop(img, labels, rng, rates, self.imgsz)
        img, (rw, rh), (pw, ph) = letterbox(img, (self.imgsz, self.imgsz), auto=False, scaleup=True)
        labels[:, [1, 3]] = labels[:, [1, 3]] * rw + pw
        labels[:, [2, 4]] = labels[:, [2, 4]] * rh + ph
        return img, labels

    def _recipe_sample(
        self, index: int, rng: np.random.Generator, epoch: int, mosaic_on: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """A DETR recipe's training sample: inside the mosaic window a photometrically distorted mosaic with
        probability ``mosaic`` (DEIM: no zoom-out or crop on a mosaic), else the zoomed and cropped image."""
        hy = cast(ZoomCropHyp, self.hyp)
        if mosaic_on and rng.random() < hy.mosaic:
            img, labels = self._mosaic(index, rng, epoch)
            return photometric_distort(img, rng, hy.photometric), labels
        return self._zoom_cropped(index, rng)

    def _letterboxed(
        self, index: int, rng: np.random.Generator, augment: bool = True
    ) -> tuple[np.ndarray, np.ndarray, tuple]:
        img, (h0, w0), (h, w) = self.load_image(index)
        shape = (
            tuple(cast(np.ndarray, self.batch_shapes)[self.batch_index[index]])
            if self.rect
            else (self.imgsz, self.imgsz)
        )
        img, (rw, rh), (pw, ph) = letterbox(img, shape, auto=False, scaleup=self.augment)
        labels = self.labels[index].copy()
        if len(labels):
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], rw * w, rh * h, pw, ph)
        if self.augment and augment:
            hy = self.hyp
            img, labels = random_perspective(
                img, labels, rng, hy.degrees, hy.translate, hy.scale, hy.shear, hy.perspective
            )
        shapes = ((h0, w0), ((rh * h / h0, rw * w / w0), (pw, ph)))
        return img, labels, shapes

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str, tuple | None]:
        epoch, index = item if isinstance(item, tuple) else (0, item)
        index = int(index)
        rng = np.random.default_rng([self.seed, int(epoch), index])
        hy = self.hyp
        augment = self.augments(epoch)
        mosaic_on = augment and not self.rect and self.mosaic_enabled(epoch)  # rect batches need letterboxes
        shapes: tuple | None = None
        if augment and not self.rect and isinstance(hy, ZoomCropHyp):
            img, labels = self._recipe_sample(index, rng, epoch, mosaic_on)
            # A draw only where mixup can happen: a recipe without it keeps the samples it had without a window.
            if mosaic_on and hy.mixup > 0 and rng.random() < hy.mixup:
                partner = self.partners(epoch, index, 1, rng)[0]
                img, labels = mixup(img, labels, *self._recipe_sample(partner, rng, epoch, mosaic_on), rng)
        elif mosaic_on and rng.random() < hy.mosaic:
            img, labels = self._mosaic(index, rng, epoch)
            if rng.random() < hy.mixup:
                img2, labels2 = self._mosaic(self.partners(epoch, index, 1, rng)[0], rng, epoch)
                img, labels = mixup(img, labels, img2, labels2, rng)
        else:
            img, labels, shapes = self._letterboxed(index, rng, augment)

        h, w = img.shape[:2]
        labels = labels.astype(np.float32).reshape(-1, 5)
        if len(labels):
            labels[:, 1:] = xyxy2xywhn(labels[:, 1:], w, h, clip=True, eps=1e-3)
            min_size = 1.0 if self.augment else 0.0  # a box under a pixel is not a learnable target
            labels = labels[(labels[:, 3] * w > min_size) & (labels[:, 4] * h > min_size)]
        if augment:
            if self.ram_images[index] is not None and np.shares_memory(img, self.ram_images[index]):
                img = img.copy()  # augment_hsv works in place: never touch the cached image
            img = augment_hsv(img, rng, hy.hsv_h, hy.hsv_s, hy.hsv_v)
            img, labels = random_flips(img, labels, rng, hy.flipud, hy.fliplr)

        targets = torch.zeros((len(labels), 6), dtype=torch.float32)
        if len(labels):
            targets[:, 1:] = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32))
        # A 3xHxW view of the HWC pixels: no transposing copy here, and the batch comes out channels-last,
        # the layout the model runs in.
        rgb = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        return torch.from_numpy(rgb).permute(2, 0, 1), targets, self.im_files[index], shapes

    @staticmethod
    def collate_fn(
        batch: list[tuple], ring: BatchRing | None = None
    ) -> tuple[torch.Tensor | RingSlot, torch.Tensor, tuple[str, ...], tuple]:
        """Stack images into a channels-last uint8 batch; targets gain the image's index in the batch as column 0.

        In a worker with a ``ring`` the images go into the worker's next ring slot and only that slot is
        returned (``BatchRing.take`` gets the batch); images the ring cannot hold are stacked as usual.
        """
        imgs, targets, paths, shapes = zip(*batch)
        for i, t in enumerate(targets):
            t[:, 0] = i
        hwc = [im.permute(1, 2, 0) for im in imgs]  # stacking the HWC views keeps it a plain memory copy
        where = ring.put(hwc) if ring is not None else None
        # default_collate stacks straight into shared memory inside a worker (no extra copy on the way to the
        # main process).
        images = where if where is not None else default_collate(hwc).permute(0, 3, 1, 2)
        return images, torch.cat(targets, 0), paths, shapes
