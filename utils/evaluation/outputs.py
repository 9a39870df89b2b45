"""What validation writes and prints: the metrics table, the speed line, plots, YOLO label files and COCO JSON (with
COCOeval). Only the main rank prints, plots and writes JSON; label files are written by the rank that saw the
image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from utils.boxes import xyxy2xywhn
from utils.errors import UserError
from utils.evaluation.evaluator import DetectionEvaluator, ImageTruth, ValResults
from utils.log import LOGGER
from utils.metrics import ClassMetrics
from utils.safe_paths import PathParts, inside

N_PLOTTED_BATCHES = 3


@dataclass
class OutputOptions:
    """What a validation pass writes and prints. ``plots`` is what the run asked for, the same on every rank (each
    rank then counts its images into the confusion matrix, which the gather sums); only the main rank plots."""

    save_dir: Path | None = None
    plots: bool = False
    verbose: bool = False
    save_json: bool = False
    save_txt: bool = False
    save_conf: bool = False
    annotations_json: str | Path | None = None  # the dataset's own COCO annotations, scored beside ours
    main: bool = True  # this rank prints, plots and writes JSON

    def __post_init__(self) -> None:
        wants_files = self.plots_here or (self.save_json and self.main) or self.save_txt
        if wants_files and self.save_dir is None:
            raise ValueError("validate: plots, save_json and save_txt need a save_dir")
        self.save_dir = Path(self.save_dir) if self.save_dir is not None else None
        if self.save_txt:
            assert self.save_dir is not None  # refused above
            (self.save_dir / "labels").mkdir(parents=True, exist_ok=True)

    @property
    def plots_here(self) -> bool:
        """Whether this rank draws the plots."""
        return self.plots and self.main


class ValOutputs:
    """Per batch: label files and the first batches' plots; at the end: table, speed, curves, COCO JSON."""

    def __init__(self, options: OutputOptions, names: list[str]):
        self.options, self.names = options, names
        self.stems = PathParts()  # an image's stem is someone else's string: made safe before it names a file

    def on_batch(
        self,
        batch_i: int,
        images: list[ImageTruth],
        inputs: torch.Tensor,
        targets: torch.Tensor,
        detections: list[torch.Tensor],
    ) -> None:
        o = self.options
        if o.save_txt:
            assert o.save_dir is not None  # OutputOptions refuses files without a folder
            for image in images:
                write_txt(
                    inside(o.save_dir, o.save_dir / "labels" / f"{self.stems.part(Path(image.path).stem)}.txt"),
                    image.detections,
                    image.original_hw,
                    o.save_conf,
                )
        if o.plots_here and batch_i < N_PLOTTED_BATCHES:  # rank 0 holds the split's first batches
            from utils.plots import output_to_target, plot_images

            assert o.save_dir is not None

            uint8_imgs = (inputs.float() * 255).round().byte().cpu()
            paths = [image.path for image in images]
            plot_images(uint8_imgs, targets.cpu(), paths, o.save_dir / f"val_batch{batch_i}_labels.jpg", self.names)
            plot_images(
                uint8_imgs,
                output_to_target(detections, max_det=15 * 16),
                paths,
                o.save_dir / f"val_batch{batch_i}_pred.jpg",
                self.names,
            )

    def finish(self, results: ValResults, evaluator: DetectionEvaluator) -> None:
        o = self.options
        results.save_dir = o.save_dir
        if o.main:
            log_table(self.names, results, evaluator.images_per_class, o.verbose)
            if results.n_images:
                LOGGER.info(
                    "Speed: {:.1f}ms pre-process, {:.1f}ms inference, {:.1f}ms NMS per image".format(*results.speed)
                )
        if o.plots_here:
            assert o.save_dir is not None and results.class_metrics is not None and evaluator.confusion is not None
            plot_metrics(results.class_metrics, evaluator.confusion, self.names, o.save_dir)
        if o.save_json and o.main:
            assert o.save_dir is not None and evaluator.json_ids is not None  # set with save_json
            class_map = evaluator.json_ids[0]
            results.coco_stats = coco_evaluation(
                evaluator.json_results,
                evaluator.json_images,
                self.names,
                o.save_dir,
                class_map,
                o.annotations_json,
                results.map,
            )
        if o.save_txt and o.main:
            assert o.save_dir is not None
            n_files = len(list((o.save_dir / "labels").glob("*.txt")))
            LOGGER.info(f"{n_files} label files saved to {o.save_dir / 'labels'}")


def write_txt(path: Path, det: np.ndarray, original_hw: tuple[int, int], save_conf: bool) -> None:
    """One line per detection: cls x y w h [conf], normalised to the original image."""
    path.write_text("".join(f"{line}\n" for line in label_lines(det, original_hw, save_conf)))


def label_lines(det: np.ndarray, original_hw: tuple[int, int], save_conf: bool) -> list[str]:
    """YOLO-format rows for detections (n, 6) in pixels of an image of shape (h, w)."""
    h0, w0 = original_hw
    lines = []
    for (cls, conf), box in zip(det[:, [5, 4]], xyxy2xywhn(det[:, :4], w0, h0)):
        values = (int(cls), *box, conf) if save_conf else (int(cls), *box)
        lines.append(("%g " * len(values)).rstrip() % values)
    return lines


def log_table(names: list[str], results: ValResults, images_per_class: np.ndarray, verbose: bool) -> None:
    LOGGER.info(("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95"))
    row = "%22s" + "%11i" * 2 + "%11.3g" * 4
    LOGGER.info(row % ("all", results.n_images, results.n_instances, results.p, results.r, results.map50, results.map))
    if results.n_instances == 0:
        LOGGER.warning("WARNING no labels found in this split: metrics cannot be computed without labels")
    nc, metrics = len(names), results.class_metrics
    if verbose and nc > 1:
        assert metrics is not None  # a summary always has them
        for i, c in enumerate(metrics.classes):
            name = names[c] if c < len(names) else str(c)
            images = images_per_class[c] if c < nc else 0
            LOGGER.info(
                row
                % (name, images, metrics.n_targets[i], metrics.p[i], metrics.r[i], metrics.ap50[i], metrics.ap50_95[i])
            )


def plot_metrics(metrics: ClassMetrics, confusion: np.ndarray, names: list[str], save_dir: Path) -> None:
    from utils.metrics import CONF_POINTS, RECALL_POINTS
    from utils.plots import plot_confusion_matrix, plot_metric_curve, plot_pr_curve

    class_names = [names[c] if c < len(names) else str(c) for c in metrics.classes]
    plot_confusion_matrix(confusion, names, save_dir / "confusion_matrix.png")
    plot_pr_curve(RECALL_POINTS, metrics.pr_curve, metrics.ap50, class_names, save_dir / "PR_curve.png")
    for curve, label, fname in (
        (metrics.f1_curve, "F1", "F1_curve.png"),
        (metrics.p_curve, "Precision", "P_curve.png"),
        (metrics.r_curve, "Recall", "R_curve.png"),
    ):
        plot_metric_curve(CONF_POINTS, curve, class_names, save_dir / fname, label)


def coco_evaluation(
    json_results: list[dict],
    json_images: list[tuple[np.ndarray, tuple[int, int], str, int | str]],
    names: list[str],
    save_dir: Path,
    class_map: list[int],
    annotations_json: str | Path | None,
    our_map: float,
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
        except UserError as e:  # malformed, or without these images (ids from the file names): ours stands
            LOGGER.warning(f"WARNING {e}; not scored against it")
            return stats
        LOGGER.info(f"COCOeval against {annotations_json}:\n{format_coco_stats(official)}")
        LOGGER.info(  # a result line, at the level of the table's "all" row
            f"mAP50-95: {our_map:.4f} (this project) | {official[0]:.4f} (pycocotools, {Path(annotations_json).name})"
            f"   mAP50: {official[1]:.4f} (pycocotools)"
        )
    return stats
