"""The evaluator: detections against ground truth, in torchvision's style (``update`` per batch, ``synchronize``
across ranks, ``summarize``). It measures; ``outputs.py`` writes the tables, plots, label files and COCO JSON.

Every figure is computed as COCOeval's bounding-box evaluation does (``utils/metrics.py``). Distributed, each rank
updates with its own disjoint, contiguous part of the split; ``synchronize`` gathers the per-image results from
every rank in rank order, which is the split's order, so every rank then summarizes exactly the figures of one
process over the whole split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from utils.boxes import scale_boxes, xywh2xyxy, xyxy2xywhn
from utils.metrics import ClassMetrics, ap_per_class, confusion_matrix, fitness, match_detections, mean_metrics


@dataclass
class ValResults:
    """What one validation pass measured. Per-class arrays cover the classes that have ground truth."""

    p: float
    r: float
    map50: float
    map: float
    losses: np.ndarray  # (loss_terms,) the loss's terms (its ``item_names``), mean per batch; empty without a loss
    maps: np.ndarray  # (nc,) mAP50-95 per class, the overall map for classes without ground truth
    speed: tuple[float, float, float]  # pre-process, inference, NMS: ms per image
    n_images: int = 0
    n_instances: int = 0
    n_detections: int = 0  # kept after NMS, all images
    class_metrics: ClassMetrics | None = None
    confusion: np.ndarray | None = None  # (nc + 1, nc + 1), rows predicted, columns true
    coco_stats: np.ndarray | None = None  # COCOeval's 12 figures with --save-json
    save_dir: Path | None = None
    names: list[str] = field(default_factory=list)
    plain: ValResults | None = None  # with --augment: the same data without test-time augmentation

    @property
    def fitness(self) -> float:
        return float(fitness(self))

    def as_row(self) -> tuple[float, ...]:
        """(P, R, mAP50, mAP50-95, then the loss's terms), the order of results.csv."""
        return (self.p, self.r, self.map50, self.map, *map(float, self.losses))


@dataclass
class EvalBatch:
    """What the evaluator needs of a loader batch besides the detections."""

    targets: torch.Tensor  # (n, 6) image index, class, x y w h normalised to the letterboxed input
    paths: Sequence[str]
    shapes: Sequence[Any]  # per image ((h0, w0), ratio_pad), or None: the input is the original
    input_hw: tuple[int, ...]  # (h, w)


@dataclass
class ImageTruth:
    """One image's ground truth and detections in original pixels, as update() found them."""

    path: str
    original_hw: tuple[int, int]
    gt_cls: np.ndarray
    gt_boxes: np.ndarray  # (m, 4) xyxy
    detections: np.ndarray  # (n, 6) xyxy conf cls, float64


class DetectionEvaluator:
    """Accumulates per-image matches; ``summarize`` gives P, R, mAP50, mAP50-95 per class, and the mean of each of
    ``loss_terms`` loss terms (the loss's ``item_names``, any number; none without a loss) over the batches."""

    def __init__(
        self,
        names: Sequence[str],
        single_cls: bool = False,
        confusion: bool = False,
        json_ids: tuple[list[int], dict[str, int | str]] | None = None,
        loss_terms: int = 0,
    ):
        names = list(names)
        self.names = (names if len(names) == 1 else ["item"]) if single_cls else names
        self.nc, self.single_cls = len(self.names), single_cls
        self.stats: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.images_per_class = np.zeros(self.nc, dtype=np.int64)
        self.confusion = np.zeros((self.nc + 1, self.nc + 1), dtype=np.int64) if confusion else None
        self.batch_losses: list[torch.Tensor] = []  # summed in batch order at the end, whichever rank ran a batch
        self.loss_terms = loss_terms
        self.n_batches = 0
        self.seconds, self.seen = np.zeros(3), 0  # the predictor's times, for the speed line
        self.json_ids = json_ids  # (category id per class, image id per file) with --save-json
        self.json_results: list[dict] = []
        self.json_images: list[tuple[np.ndarray, tuple[int, int], str, int | str]] = []

    def update(
        self, detections: list[torch.Tensor], batch: EvalBatch, losses: torch.Tensor | None = None
    ) -> list[ImageTruth]:
        """Match one batch's detections (input pixels) with its labels; returns each image in original pixels."""
        self.n_batches += 1
        if losses is not None:
            if len(losses) != self.loss_terms:
                raise ValueError(f"the evaluator sums {self.loss_terms} loss terms, a batch gave {len(losses)}")
            self.batch_losses.append(losses.detach().cpu())
        targets = batch.targets.cpu()
        images = []
        for si, det in enumerate(detections):
            image = self._image(si, det, targets, batch)
            correct = match_detections(
                image.detections[:, :4], image.detections[:, 4], image.detections[:, 5], image.gt_boxes, image.gt_cls
            )
            self.stats.append((correct, image.detections[:, 4], image.detections[:, 5], image.gt_cls))
            present = np.unique(image.gt_cls)
            self.images_per_class[present[present < self.nc]] += 1
            if self.confusion is not None:
                self.confusion += confusion_matrix(
                    image.detections, np.concatenate([image.gt_cls[:, None], image.gt_boxes], 1), self.nc
                )
            if self.json_ids is not None:
                self._add_json(image)
            images.append(image)
        return images

    def _image(self, si: int, det: torch.Tensor, targets: torch.Tensor, batch: EvalBatch) -> ImageTruth:
        height, width = batch.input_hw
        labels = targets[targets[:, 0] == si, 1:]
        original_shape, ratio_pad = batch.shapes[si] if batch.shapes[si] is not None else ((height, width), None)
        h0, w0 = int(original_shape[0]), int(original_shape[1])
        det_px = det.clone()
        if self.single_cls:
            det_px[:, 5] = 0
        scale_boxes((height, width), det_px[:, :4], (h0, w0), ratio_pad)
        gt_cls = np.zeros(len(labels), dtype=np.int64) if self.single_cls else labels[:, 0].numpy().astype(np.int64)
        gt_box = xywh2xyxy(labels[:, 1:5]) * torch.tensor([width, height, width, height])
        scale_boxes((height, width), gt_box, (h0, w0), ratio_pad)
        return ImageTruth(
            str(batch.paths[si]), (h0, w0), gt_cls, gt_box.numpy().astype(np.float64), det_px.numpy().astype(np.float64)
        )

    def _add_json(self, image: ImageTruth) -> None:
        from utils.coco_json import detections_to_results, image_ids_for

        assert self.json_ids is not None  # update() calls this only with them
        class_map, file_ids = self.json_ids
        image_id = file_ids.get(image.path)
        if image_id is None:  # a loader without the dataset's file list: ids from this file's name
            image_id = image_ids_for([image.path])[0]
        self.json_results.extend(detections_to_results(image.detections, image_id, class_map))
        h0, w0 = image.original_hw
        labels_n = (
            np.concatenate([image.gt_cls[:, None], xyxy2xywhn(image.gt_boxes, w0, h0)], 1)
            if len(image.gt_boxes)
            else np.zeros((0, 5))
        )
        self.json_images.append((labels_n, (h0, w0), image.path, image_id))

    def add_times(self, seconds: np.ndarray, images: int) -> None:
        self.seconds, self.seen = self.seconds + seconds, self.seen + images

    def _parts(self) -> tuple:
        return (
            self.seen,
            self.n_batches,
            self.stats,
            self.images_per_class,
            self.confusion,
            self.seconds,
            self.batch_losses,
            self.json_results,
            self.json_images,
        )

    def synchronize(self) -> None:
        """Every rank's results on every rank: counts summed, per-image lists concatenated in rank order."""
        import torch.distributed as dist

        from utils.distributed import collective

        parts: list = [None] * dist.get_world_size()
        with collective("all_gather"):
            dist.all_gather_object(parts, self._parts())  # pickled between our own processes only
        self.seen, self.n_batches = sum(p[0] for p in parts), sum(p[1] for p in parts)
        self.stats = [s for p in parts for s in p[2]]
        self.images_per_class = sum(p[3] for p in parts)
        # Every rank's matches count: the matrix is summed over the ranks that keep one (a caller may keep it on
        # rank 0 alone), and kept wherever any rank wanted it.
        matrices = [p[4] for p in parts if p[4] is not None]
        self.confusion = sum(matrices[1:], matrices[0].copy()) if matrices else None
        self.seconds = sum(p[5] for p in parts)
        self.batch_losses = [b for p in parts for b in p[6]]
        self.json_results = [j for p in parts for j in p[7]]
        self.json_images = [j for p in parts for j in p[8]]

    def summarize(self) -> ValResults:
        loss_sum = torch.zeros(self.loss_terms)
        for batch_loss in self.batch_losses:
            loss_sum += batch_loss
        correct, conf, pred_cls, target_cls = (
            np.concatenate([s[k] for s in self.stats]) if self.stats else np.zeros((0, 10) if k == 0 else 0)
            for k in range(4)
        )
        metrics = ap_per_class(correct.reshape(-1, 10), conf, pred_cls, target_cls)
        p, r, map50, map50_95 = mean_metrics(metrics)
        maps = np.full(self.nc, map50_95)
        in_range = metrics.classes < self.nc
        maps[metrics.classes[in_range]] = metrics.ap50_95[in_range]
        speed = cast("tuple[float, float, float]", tuple(float(t) for t in self.seconds / max(self.seen, 1) * 1e3))
        return ValResults(
            p=p,
            r=r,
            map50=map50,
            map=map50_95,
            losses=(loss_sum / max(self.n_batches, 1)).numpy(),
            maps=maps,
            speed=speed,
            n_images=len(self.stats),
            n_instances=int(len(target_cls)),
            n_detections=int(len(conf)),
            class_metrics=metrics,
            confusion=self.confusion,
            names=self.names,
        )
