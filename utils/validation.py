"""Validation's core: run a detector over a dataset split and measure it (P, R, mAP50, mAP50-95 per class, losses,
speed), with plots, label files and COCO JSON on request.

val.py (the command line) and train.py (each epoch, and the final validation) both call ``validate``.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch

from models.families import Family, family_of
from models.yolo import Model
from utils.boxes import scale_boxes, xywh2xyxy, xyxy2xywhn
from utils.log import LOGGER
from utils.metrics import ClassMetrics, ap_per_class, confusion_matrix, fitness, match_detections, mean_metrics
from utils.loss import DetectionLoss
from utils.torch_utils import time_synchronized

# The mAP sweep's thresholds: the defaults of both validate() (train.py's epochs) and the command line. The NMS
# IoU threshold is the model family's (models/families.py).
CONF_THRES, MAX_DET = 0.001, 300
N_PLOTTED_BATCHES = 3


@dataclass
class ValResults:
    """What one validation pass measured. Per-class arrays cover the classes that have ground truth."""

    p: float
    r: float
    map50: float
    map: float
    losses: np.ndarray  # (3,) the family's loss terms (YOLOv5: box, obj, cls), mean per batch; zeros without a loss
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
        """(P, R, mAP50, mAP50-95, val box, obj, cls loss), the order of results.csv."""
        return (self.p, self.r, self.map50, self.map, *map(float, self.losses))


# ---- the validation loop ---------------------------------------------------------------------------------

def without_cudnn_benchmark(fn: Callable[..., ValResults]) -> Callable[..., ValResults]:
    """Run ``fn`` with cuDNN's benchmark off, then restore the caller's setting.

    Training keeps the benchmark: one input shape, timed once, then every step runs the fastest kernels. Rectangular
    validation batches come in many shapes, and the benchmark times each new one again, at a higher cost than
    cuDNN's heuristic choice and for no faster inference (docs/benchmarks.md, "cuDNN benchmark on and off").
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> ValResults:
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = False
        try:
            return fn(*args, **kwargs)
        finally:
            torch.backends.cudnn.benchmark = before
    return wrapper


@without_cudnn_benchmark
@torch.no_grad()
def validate(
    model: torch.nn.Module,
    dataloader: Any,
    *,
    names: Sequence[str],
    device: torch.device | str,
    compute_loss: DetectionLoss | None = None,
    family: Family | None = None,
    conf_thres: float = CONF_THRES,
    iou_thres: float | None = None,
    max_det: int = MAX_DET,
    single_cls: bool = False,
    save_dir: str | Path | None = None,
    plots: bool = False,
    verbose: bool = False,
    save_json: bool = False,
    save_txt: bool = False,
    save_conf: bool = False,
    half: bool = False,
    autocast_dtype: torch.dtype | None = None,
    annotations_json: str | Path | None = None,
    augment: bool = False,
    gather: bool = False,
    main: bool = True,
) -> ValResults:
    """Run ``model`` over ``dataloader`` (letterboxed batches with shapes entries) and measure it.

    The model is put in eval mode and left there. ``half`` (CUDA only) runs an fp32 model under fp16
    autocast, so the caller's weights (such as training's EMA) are never converted; a model already in
    fp16 gets fp16 images. ``autocast_dtype`` (e.g. bf16 on a CPU, as training uses) runs inference under
    autocast of that type; NMS and metrics stay in fp32. Outputs (plots, labels/, JSON files) go to ``save_dir``.
    ``model`` may also be an exported file's runner (models/backends.py), which returns predictions only.
    With ``save_json``, ``annotations_json`` (COCO's instances_val2017.json) is scored too, beside our figures.
    ``augment``: test-time augmentation (utils/tta.py; PyTorch models only, no losses).
    ``family`` (models/families.py) decodes the predictions into detections (NMS, at its IoU threshold unless
    ``iou_thres`` is given); it is the model's own by default, and must be given for anything but a ``Model``.

    Distributed (``gather``): each rank passes a loader over its own disjoint, contiguous part of the split
    (``create_dataloader(..., world_size, global_rank)``); per-image results are gathered from every rank in
    rank order, which is the split's order, so every rank computes exactly the figures of one process over the
    whole split (with the same batch size). Only ``main`` logs, plots and writes JSON; ``save_txt`` files are
    written by the rank that saw the image.
    """
    device = torch.device(device)
    if family is None:
        if not isinstance(model, Model):
            raise ValueError(f"validate: {type(model).__name__} is not a Model of this project: pass its family")
        family = family_of(model)
    iou_thres = family.nms_iou if iou_thres is None else iou_thres
    plots = plots and main  # every rank gathers JSON results; only main writes them
    wants_files = plots or (save_json and main) or save_txt
    if wants_files and save_dir is None:
        raise ValueError("validate: plots, save_json and save_txt need a save_dir")
    save_dir = Path(save_dir) if save_dir is not None else None
    half = half and device.type == "cuda"
    model.eval()
    if isinstance(model, Model) and any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()):
        # A copy with each BatchNorm folded into its convolution, as val.py's loaded weights are: one op less
        # per layer. A copy, since the caller's model (training's EMA) trains on.
        model = copy.deepcopy(model).fuse()
    first_weight = next(model.parameters(), None)  # None for an ONNX runner
    fp16_weights = first_weight is not None and first_weight.dtype == torch.float16
    # Feed images in the layout the convolutions already use, so no conversion runs per layer.
    channels_last = first_weight is not None and first_weight.dim() == 4 and \
        first_weight.is_contiguous(memory_format=torch.channels_last)
    if half and not fp16_weights:
        autocast_dtype = torch.float16
    names = list(names)
    if single_cls:
        names = names if len(names) == 1 else ["item"]
    nc = len(names)
    if save_txt:
        (save_dir / "labels").mkdir(parents=True, exist_ok=True)

    seen = 0
    times = np.zeros(3)  # pre-process, inference, NMS (seconds)
    batch_losses: list[torch.Tensor] = []  # summed in batch order at the end, whichever rank ran a batch
    n_batches = 0
    stats: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    images_per_class = np.zeros(nc, dtype=np.int64)
    confusion = np.zeros((nc + 1, nc + 1), dtype=np.int64)
    json_results: list[dict] = []
    json_images: list[tuple[np.ndarray, tuple[int, int], str]] = []  # (labels, (h, w), file) per image
    if save_json:
        from utils.coco_json import image_ids_for, json_identities

        class_map, file_ids = json_identities(getattr(dataloader, "dataset", None), names)

    for batch_i, (imgs, targets, paths, shapes) in enumerate(dataloader):
        t0 = time_synchronized()
        imgs = imgs.to(device, non_blocking=True)
        imgs = imgs.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        imgs = imgs.half() if fp16_weights else imgs.float()
        imgs /= 255
        _, _, height, width = imgs.shape
        t1 = time_synchronized()

        with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            if augment:
                from utils.tta import tta_predict

                out = (tta_predict(model, imgs, int(model.stride.max())), None)
            else:
                out = model(imgs)
        pred, raw = out if isinstance(out, (tuple, list)) else (out, None)  # exported files give predictions only
        t2 = time_synchronized()
        if compute_loss is not None and raw is not None:
            batch_losses.append(compute_loss(raw, targets.to(device))[1].detach().cpu())
        n_batches += 1

        detections = family.detections(pred.float(), conf_thres, iou_thres, multi_label=True, agnostic=single_cls,
                                       max_det=max_det)
        detections = [d.cpu() for d in detections]
        t3 = time_synchronized()
        times += (t1 - t0, t2 - t1, t3 - t2)

        targets = targets.cpu()
        for si, det in enumerate(detections):
            labels = targets[targets[:, 0] == si, 1:]
            original_shape, ratio_pad = shapes[si] if shapes[si] is not None else ((height, width), None)
            h0, w0 = int(original_shape[0]), int(original_shape[1])
            seen += 1

            det_px = det.clone()
            if single_cls:
                det_px[:, 5] = 0
            scale_boxes((height, width), det_px[:, :4], (h0, w0), ratio_pad)
            gt_cls = np.zeros(len(labels), dtype=np.int64) if single_cls else labels[:, 0].numpy().astype(np.int64)
            gt_box = xywh2xyxy(labels[:, 1:5]) * torch.tensor([width, height, width, height])
            scale_boxes((height, width), gt_box, (h0, w0), ratio_pad)
            det_np, gt_np = det_px.numpy().astype(np.float64), gt_box.numpy().astype(np.float64)

            correct = match_detections(det_np[:, :4], det_np[:, 4], det_np[:, 5], gt_np, gt_cls)
            stats.append((correct, det_np[:, 4], det_np[:, 5], gt_cls))
            present = np.unique(gt_cls)
            images_per_class[present[present < nc]] += 1
            if plots:
                confusion += confusion_matrix(det_np, np.concatenate([gt_cls[:, None], gt_np], 1), nc)
            if save_txt:
                _write_txt(save_dir / "labels" / f"{Path(paths[si]).stem}.txt", det_np, (h0, w0), save_conf)
            if save_json:
                from utils.coco_json import detections_to_results

                image_id = file_ids.get(paths[si])
                if image_id is None:  # a loader without the dataset's file list: ids from this file's name
                    image_id = image_ids_for([paths[si]])[0]
                json_results.extend(detections_to_results(det_np, image_id, class_map))
                labels_n = np.concatenate([gt_cls[:, None], xyxy2xywhn(gt_np, w0, h0)], 1) if len(gt_np) else \
                    np.zeros((0, 5))
                json_images.append((labels_n, (h0, w0), str(paths[si]), image_id))

        if plots and batch_i < N_PLOTTED_BATCHES:  # rank 0 holds the split's first batches
            from utils.plots import output_to_target, plot_images

            uint8_imgs = (imgs.float() * 255).round().byte().cpu()
            plot_images(uint8_imgs, targets, paths, save_dir / f"val_batch{batch_i}_labels.jpg", names)
            plot_images(uint8_imgs, output_to_target(detections, max_det=15 * 16), paths,
                        save_dir / f"val_batch{batch_i}_pred.jpg", names)

    if gather:
        seen, n_batches, stats, images_per_class, confusion, times, batch_losses, json_results, json_images = \
            _gather_results(seen, n_batches, stats, images_per_class, confusion, times, batch_losses, json_results,
                            json_images)
    loss_sum = torch.zeros(3)
    for batch_loss in batch_losses:
        loss_sum += batch_loss
    correct, conf, pred_cls, target_cls = (
        np.concatenate([s[k] for s in stats]) if stats else np.zeros((0, 10) if k == 0 else 0) for k in range(4)
    )
    metrics = ap_per_class(correct.reshape(-1, 10), conf, pred_cls, target_cls)
    p, r, map50, map50_95 = mean_metrics(metrics)
    maps = np.full(nc, map50_95)
    in_range = metrics.classes < nc
    maps[metrics.classes[in_range]] = metrics.ap50_95[in_range]
    n_instances = int(len(target_cls))
    speed = tuple(float(t) for t in times / max(seen, 1) * 1e3)

    if main:
        _log_table(names, seen, n_instances, (p, r, map50, map50_95), metrics, images_per_class, verbose, nc)
    if seen and main:
        LOGGER.info("Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image" % speed)

    results = ValResults(
        p=p, r=r, map50=map50, map=map50_95, losses=(loss_sum / max(n_batches, 1)).cpu().numpy(), maps=maps,
        speed=speed, n_images=seen, n_instances=n_instances, n_detections=int(len(conf)), class_metrics=metrics,
        confusion=confusion if plots else None, save_dir=save_dir, names=names,
    )
    if plots:
        _plot_metrics(metrics, confusion, names, save_dir)
    if save_json and main:
        results.coco_stats = _coco_evaluation(json_results, json_images, names, save_dir, class_map, annotations_json,
                                              map50_95)
    if save_txt and main:
        n_files = len(list((save_dir / "labels").glob("*.txt")))
        LOGGER.info(f"{n_files} label files saved to {save_dir / 'labels'}")
    return results


def tta_comparison(plain: ValResults, augmented: ValResults) -> str:
    """One line: mAP and time per image of the --augment pass beside the plain one."""
    t_plain, t_aug = sum(plain.speed), sum(augmented.speed)
    factor = t_aug / t_plain if t_plain > 0 else float("nan")
    return (f"--augment: mAP50 {augmented.map50:.4f} (plain {plain.map50:.4f}, {augmented.map50 - plain.map50:+.4f}), "
            f"mAP50-95 {augmented.map:.4f} (plain {plain.map:.4f}, {augmented.map - plain.map:+.4f}); "
            f"{t_aug:.1f} ms per image (plain {t_plain:.1f} ms, x{factor:.2f})")


def _gather_results(seen: int, n_batches: int, stats: list, images_per_class: np.ndarray, confusion: np.ndarray,
                    times: np.ndarray, batch_losses: list, json_results: list, json_images: list) -> tuple:
    """Every rank's results on every rank: counts summed, per-image lists concatenated in rank order."""
    import torch.distributed as dist

    from utils.distributed import collective

    mine = (seen, n_batches, stats, images_per_class, confusion, times, batch_losses, json_results, json_images)
    parts: list = [None] * dist.get_world_size()
    with collective("all_gather"):
        dist.all_gather_object(parts, mine)  # pickled between our own processes only
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), [s for p in parts for s in p[2]],
            sum(p[3] for p in parts), sum(p[4] for p in parts), sum(p[5] for p in parts),
            [b for p in parts for b in p[6]], [j for p in parts for j in p[7]],
            [j for p in parts for j in p[8]])


def _write_txt(path: Path, det: np.ndarray, original_hw: tuple[int, int], save_conf: bool) -> None:
    """One line per detection: cls x y w h [conf], normalised to the original image."""
    h0, w0 = original_hw
    xywhn = xyxy2xywhn(det[:, :4], w0, h0)
    lines = []
    for (cls, conf), box in zip(det[:, [5, 4]], xywhn):
        values = (int(cls), *box, conf) if save_conf else (int(cls), *box)
        lines.append(("%g " * len(values)).rstrip() % values)
    path.write_text("".join(f"{line}\n" for line in lines))


def _log_table(
    names: list[str], seen: int, n_instances: int, means: tuple[float, float, float, float], metrics: ClassMetrics,
    images_per_class: np.ndarray, verbose: bool, nc: int,
) -> None:
    LOGGER.info(("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95"))
    row = "%22s" + "%11i" * 2 + "%11.3g" * 4
    LOGGER.info(row % ("all", seen, n_instances, *means))
    if n_instances == 0:
        LOGGER.warning("WARNING no labels found in this split: metrics cannot be computed without labels")
    if verbose and nc > 1:
        for i, c in enumerate(metrics.classes):
            name = names[c] if c < len(names) else str(c)
            images = images_per_class[c] if c < nc else 0
            LOGGER.info(row % (name, images, metrics.n_targets[i], metrics.p[i], metrics.r[i],
                               metrics.ap50[i], metrics.ap50_95[i]))


def _plot_metrics(metrics: ClassMetrics, confusion: np.ndarray, names: list[str], save_dir: Path) -> None:
    from utils.metrics import CONF_POINTS, RECALL_POINTS
    from utils.plots import plot_confusion_matrix, plot_metric_curve, plot_pr_curve

    class_names = [names[c] if c < len(names) else str(c) for c in metrics.classes]
    plot_confusion_matrix(confusion, names, save_dir / "confusion_matrix.png")
    plot_pr_curve(RECALL_POINTS, metrics.pr_curve, metrics.ap50, class_names, save_dir / "PR_curve.png")
    for curve, label, fname in ((metrics.f1_curve, "F1", "F1_curve.png"), (metrics.p_curve, "Precision", "P_curve.png"),
                                (metrics.r_curve, "Recall", "R_curve.png")):
        plot_metric_curve(CONF_POINTS, curve, class_names, save_dir / fname, label)


def _coco_evaluation(
    json_results: list[dict], json_images: list[tuple[np.ndarray, tuple[int, int], str, int | str]],
    names: list[str], save_dir: Path, class_map: list[int], annotations_json: str | Path | None, our_map: float,
) -> np.ndarray | None:
    """Write predictions.json and a ground truth made from the labels, then run COCOeval when available.

    With ``annotations_json`` (the dataset's own COCO annotations) the predictions are scored against it too,
    on the images evaluated, as YOLOv5 does; its mAP50-95 is printed beside ours.
    """
    from utils.coco_json import coco_eval, format_coco_stats, ground_truth_dict, write_json

    pred_json = write_json(json_results, save_dir / "predictions.json")
    labels, shapes, files, ids = zip(*json_images) if json_images else ((), (), (), ())
    gt = ground_truth_dict(labels, shapes, ids, files, names, class_map)
    gt_json = write_json(gt, save_dir / "ground_truth.json")
    LOGGER.info(f"COCO results saved to {pred_json} (ground truth from the labels: {gt_json})")
    try:
        import pycocotools  # noqa: F401
    except ImportError:
        LOGGER.warning("pycocotools not installed: COCO evaluation skipped")
        return None
    if not gt["annotations"] or not json_results:
        LOGGER.warning(f"COCO evaluation skipped: no {'ground-truth boxes' if json_results else 'detections'}")
        return None
    stats, _ = coco_eval(gt_json, json_results, image_ids=ids)
    LOGGER.info(f"COCOeval (bbox, maxDets=100 per image and class):\n{format_coco_stats(stats)}")
    if annotations_json is not None:
        try:
            official, _ = coco_eval(annotations_json, json_results, image_ids=ids)
        except AssertionError:  # pycocotools' loadRes asserts that every result's image is in the file
            LOGGER.warning(f"WARNING {annotations_json}: does not hold these images (ids from the file names); "
                           "not scored against it")
            return stats
        LOGGER.info(f"COCOeval against {annotations_json}:\n{format_coco_stats(official)}")
        print(f"mAP50-95: {our_map:.4f} (this project) | {official[0]:.4f} (pycocotools, {Path(annotations_json).name})"
              f"   mAP50: {official[1]:.4f} (pycocotools)")
    return stats


