"""Run a detector on images, folders, globs, .txt lists, videos or a webcam, as YOLOv5's detect.py does.

Usage:
    python detect.py --weights yolov5s.pt --source data/images --imgsz 640
    python detect.py --weights best.onnx --source video.mp4 --save-txt --save-conf
    python detect.py --weights best.torchscript --source 0          # webcam 0
    python detect.py --weights yolo26n.pt --end2end --source data/images   # YOLO26 without NMS

Results go to runs/detect/exp (then exp2, ...): annotated images and videos, ``labels/*.txt`` in YOLO format
(``cls x y w h [conf]`` normalised; video frames as ``<stem>_<frame>.txt``), ``crops/<class>/`` with
--save-crop. Weights: a .pt (ours, YOLOv5's, or an Ultralytics detection checkpoint of a family here),
or any file or folder export.py wrote; every format runs through the same predictor (utils/evaluation/predictor.py).
Inputs that cannot be read are reported and skipped.
"""

from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from models.families import titles_by
from utils.cli import (
    INFERENCE_IMGSZ_HELP,
    add_device,
    add_end2end,
    add_half,
    add_imgsz,
    add_max_pixels,
    add_run_folder,
    apply_data_limits,
    make_parser,
    positive_int,
)
from utils.data.image_files import IMG_FORMATS
from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, colorstr, setup_logging
from utils.process import setup_process
from utils.run_dir import increment_path
from utils.safe_paths import PathParts, inside
from utils.storage import is_url, local_copy
from utils.torch_utils import select_device


@dataclass
class DetectResults:
    """What a detect run did: per input frame its detections (n, 6) in original pixels, and where files went."""

    save_dir: Path
    detections: dict[str, np.ndarray] = field(default_factory=dict)  # key: path, or path:frame for videos
    skipped: list[str] = field(default_factory=list)
    speed: tuple[float, float, float] = (0.0, 0.0, 0.0)  # pre-process, inference, NMS: ms per image


def draw_detection(img: np.ndarray, box: np.ndarray, label: str, colour: tuple[int, int, int]) -> None:
    """A box and its label on a BGR image, in place, with line width scaled to the image."""
    line = max(round(sum(img.shape[:2]) / 2 * 0.003), 1)
    p1, p2 = (int(box[0]), int(box[1])), (int(box[2]), int(box[3]))
    cv2.rectangle(img, p1, p2, colour, line, cv2.LINE_AA)
    if label:
        font = line / 3
        (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, font, max(line - 1, 1))
        above = p1[1] - th - 3 >= 0
        q2 = (p1[0] + tw, p1[1] - th - 3 if above else p1[1] + th + 3)
        cv2.rectangle(img, p1, q2, colour, -1, cv2.LINE_AA)
        cv2.putText(
            img,
            label,
            (p1[0], p1[1] - 2 if above else p1[1] + th + 2),
            cv2.FONT_HERSHEY_SIMPLEX,
            font,
            (255, 255, 255),
            max(line - 1, 1),
            cv2.LINE_AA,
        )


def save_crop(img: np.ndarray, box: np.ndarray, path: Path, gain: float = 1.02, pad: int = 10) -> None:
    """Save the region of ``box`` (slightly enlarged, as YOLOv5 crops) from the original image."""
    cx, cy, w, h = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, box[2] - box[0], box[3] - box[1]
    w, h = w * gain + pad, h * gain + pad
    x1, y1 = int(max(cx - w / 2, 0)), int(max(cy - h / 2, 0))
    x2, y2 = int(min(cx + w / 2, img.shape[1])), int(min(cy + h / 2, img.shape[0]))
    cv2.imwrite(str(increment_path(path)), img[y1:y2, x1:x2])


def _display_available() -> bool:
    return sys.platform in ("win32", "darwin") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


class _Writers:
    """Annotated outputs: images written at once, one video writer per video (opened at its first frame).

    Every file name made from an input's stem or a class name goes through ``utils/safe_paths.py`` and is checked
    to lie inside the run folder: a class name such as ``../../x`` comes from a file the user may not have written.
    """

    def __init__(self, save_dir: Path, names: list[str]):
        self.save_dir = save_dir
        self.videos: dict[str, cv2.VideoWriter] = {}
        self.stems = PathParts()
        classes = PathParts()
        self.class_parts = [classes.part(name) for name in names]

    def path(self, *parts: str) -> Path:
        """A file in the run folder, from safe parts; the folders above it made."""
        path = inside(self.save_dir, self.save_dir.joinpath(*parts))
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def stem(self, frame: Any) -> str:
        """The frame's output stem: its file's stem made safe, and the frame number of a video."""
        return self.stems.part(Path(frame.path).stem) + (f"_{frame.index}" if frame.kind != "image" else "")

    def write(self, frame: Any, img: np.ndarray) -> None:
        if frame.kind == "image":
            suffix = Path(frame.path).suffix.lower()
            suffix = suffix if suffix[1:] in IMG_FORMATS else ".jpg"
            cv2.imwrite(str(self.path(self.stem(frame) + suffix)), img)
            return
        if frame.path not in self.videos:
            for writer in self.videos.values():  # videos are read one after the other
                writer.release()
            out = self.path(f"{self.stems.part(Path(frame.path).stem)}.mp4")
            h, w = img.shape[:2]
            self.videos = {frame.path: cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"mp4v"), frame.fps, (w, h))}
        self.videos[frame.path].write(img)

    def close(self) -> None:
        for writer in self.videos.values():
            writer.release()
        self.videos = {}


def _frame_batches(
    frames: Iterator[Any], predictor: Any, imgsz: tuple[int, int], batch_size: int, skipped: list[str]
) -> Iterator[tuple[list[Any], torch.Tensor, list[Any]]]:
    """Batches of same-shape letterboxed frames: (frames, uint8 (b, 3, h, w), ratio_pads). Unreadable frames are
    reported and skipped. The letterbox time counts as pre-processing."""
    from utils.evaluation.predictor import to_batch

    pending: list[tuple[Any, np.ndarray, Any]] = []
    for frame in frames:
        if frame.image is None:
            LOGGER.warning(f"WARNING {frame.path}: skipped ({frame.error})")
            skipped.append(frame.path)
            continue
        t0 = time.perf_counter()
        boxed, ratio_pad = next(predictor.letterboxed([frame.image], imgsz))
        predictor.timer.seconds[0] += time.perf_counter() - t0
        if pending and pending[0][1].shape != boxed.shape:
            yield [p[0] for p in pending], to_batch([p[1] for p in pending]), [p[2] for p in pending]
            pending = []
        pending.append((frame, boxed, ratio_pad))
        if len(pending) == batch_size:
            yield [p[0] for p in pending], to_batch([p[1] for p in pending]), [p[2] for p in pending]
            pending = []
    if pending:
        yield [p[0] for p in pending], to_batch([p[1] for p in pending]), [p[2] for p in pending]


def _predictor(opt: argparse.Namespace, device: torch.device) -> tuple[Any, tuple[int, int]]:
    """The predictor at detect.py's thresholds, and the image size."""
    from models.families import family_of
    from utils.evaluation.predictor import PredictOptions, Predictor, open_for_prediction
    from utils.formats.metadata import inference_imgsz

    with local_copy(opt.weights) as weights:  # a URL (s3://, gs://) is downloaded through the storage seam
        runner = open_for_prediction(weights, device, end2end=opt.end2end, augment=opt.augment, half=opt.half)
    meta = runner.meta
    options = PredictOptions(
        conf_thres=opt.conf_thres,
        iou_thres=opt.iou_thres,
        max_det=opt.max_det,
        classes=opt.classes,
        agnostic=opt.agnostic_nms,
        augment=opt.augment,
    )
    predictor = Predictor(runner, family_of(meta.family), options, purpose="detect")
    imgsz = inference_imgsz(meta, opt.imgsz, opt.weights)
    if opt.classes and max(opt.classes) >= meta.nc:
        raise UserError(f"--classes {' '.join(map(str, opt.classes))}: the model has classes 0..{meta.nc - 1}")
    return predictor, imgsz


def run_options(opt: argparse.Namespace) -> DetectResults:
    from utils.evaluation.predictor import threads_for

    apply_data_limits(opt)
    device = select_device(opt.device)
    predictor, imgsz = _predictor(opt, device)
    batch_size = predictor.meta.batch or max(opt.batch_size, 1)
    view = opt.view_img and _display_available()
    if opt.view_img and not view:
        LOGGER.warning("WARNING --view-img: no display available, images are not shown")
    if is_url(opt.project):  # only train.py's run folder may be a URL
        raise UserError(f"--project {opt.project}: detect.py writes its outputs to a local folder")
    save_dir = increment_path(Path(opt.project) / opt.name, exist_ok=opt.exist_ok, mkdir=True)
    if opt.save_txt:
        (save_dir / "labels").mkdir(exist_ok=True)
    results = DetectResults(save_dir)
    writers = _Writers(save_dir, predictor.meta.names)
    try:
        with threads_for(predictor.runner):
            _detect_all(opt, predictor, (imgsz, batch_size), save_dir, writers, view, results)
    finally:
        writers.close()
        if view:
            cv2.destroyAllWindows()
    results.speed = predictor.timer.per_image_ms()
    print(
        f"Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image ({predictor.timer.images} images, "
        f"batch {batch_size})" % results.speed
    )
    if results.skipped:
        print(f"{len(results.skipped)} input(s) skipped: {', '.join(results.skipped)}")
    n_labels = len(list((save_dir / "labels").glob("*.txt"))) if opt.save_txt else 0
    print(
        f"Results saved to {colorstr(str(save_dir))}" + (f", {n_labels} label files in labels/" if opt.save_txt else "")
    )
    return results


def _detect_all(
    opt: argparse.Namespace,
    predictor: Any,
    size: tuple[int, int],
    save_dir: Path,
    writers: _Writers,
    view: bool,
    results: DetectResults,
) -> None:
    """Every frame of --source: predicted in batches of ``size`` = (image size, batch size), then handled."""
    from utils.data.sources import iter_source
    from utils.evaluation.predictor import to_original

    names = predictor.meta.names
    for frames, images, ratio_pads in _frame_batches(iter_source(opt.source), predictor, *size, results.skipped):
        t0 = time.perf_counter()
        pred = predictor.predict(images)
        per_image_ms = (time.perf_counter() - t0) * 1e3 / len(frames)
        input_hw = tuple(pred.images.shape[2:])
        for frame, ratio_pad, det in zip(frames, ratio_pads, pred.detections):
            det = to_original(det, input_hw, frame.image.shape[:2], ratio_pad).numpy()
            _handle_frame(frame, det, names, opt, save_dir, writers, view, results)
            print(
                f"{_where(frame)} {frame.path}: {input_hw[0]}x{input_hw[1]} {_found(det, names)}, {per_image_ms:.1f}ms"
            )


def _where(frame: Any) -> str:
    return f"video {frame.index + 1}/{frame.n_frames}" if frame.kind == "video" else frame.kind


def _found(det: np.ndarray, names: list[str]) -> str:
    counts = Counter(names[int(c)] for c in det[:, 5])
    return ", ".join(f"{n} {name}{'s' if n > 1 else ''}" for name, n in counts.items()) or "no detections"


def _handle_frame(
    frame: Any,
    det: np.ndarray,
    names: list[str],
    opt: argparse.Namespace,
    save_dir: Path,
    writers: _Writers,
    view: bool,
    results: DetectResults,
) -> None:
    """Labels, crops, annotated image and display for one frame's detections (n, 6) in original pixels."""
    from utils.plots import class_colour

    stem = writers.stem(frame)
    results.detections[frame.path if frame.kind == "image" else f"{frame.path}:{frame.index}"] = det
    if opt.save_txt and len(det):  # as in YOLOv5, a frame without detections gets no label file
        from utils.evaluation.outputs import label_lines

        lines = label_lines(det, frame.image.shape[:2], opt.save_conf)
        writers.path("labels", f"{stem}.txt").write_text("".join(f"{line}\n" for line in lines))
    original = frame.image.copy() if opt.save_crop else None
    annotated = frame.image
    for *box, conf, cls in det:
        name = names[int(cls)]
        if not opt.nosave or view:
            label = "" if opt.hide_labels else (name if opt.hide_conf else f"{name} {conf:.2f}")
            draw_detection(annotated, np.array(box), label, class_colour(int(cls), bgr=True))
        if opt.save_crop:
            save_crop(original, np.array(box), writers.path("crops", writers.class_parts[int(cls)], f"{stem}.jpg"))
    if not opt.nosave:
        writers.write(frame, annotated)
    if view:
        cv2.imshow(str(frame.path), annotated)
        cv2.waitKey(1)


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("Detect objects in images, videos or a webcam stream")
    data = parser.add_argument_group("data")
    data.add_argument(
        "--source", type=str, required=True, help="image, folder, glob, .txt list, video file or webcam index (0)"
    )
    add_imgsz(data, help=INFERENCE_IMGSZ_HELP)
    data.add_argument("--batch-size", type=positive_int, default=1, help="images per forward pass")
    add_max_pixels(data)
    model = parser.add_argument_group("model and inference")
    model.add_argument(
        "--weights",
        type=str,
        required=True,
        help=".pt (ours, YOLOv5's or Ultralytics' detection model), or a file or folder export.py wrote "
        "(.onnx, .torchscript, ...); a DETR's official .pth or Hugging Face folder",
    )
    model.add_argument("--conf-thres", type=float, default=0.25, help="confidence threshold")
    model.add_argument(
        "--iou-thres",
        type=float,
        default=None,
        help=f"NMS IoU threshold (default: the model family's, {titles_by(lambda f: f.detect_iou)})",
    )
    model.add_argument("--max-det", type=int, default=1000, help="detections kept per image")
    model.add_argument("--classes", nargs="+", type=int, help="keep only these classes: --classes 0 2 (default: all)")
    model.add_argument("--agnostic-nms", action="store_true", help="NMS across classes")
    model.add_argument("--augment", action="store_true", help="test-time augmentation (scales and flips)")
    add_end2end(model)
    add_half(model)
    add_device(model)
    output = parser.add_argument_group("output")
    add_run_folder(output, "detect")
    output.add_argument("--view-img", action="store_true", help="show results (needs a display)")
    output.add_argument("--save-txt", action="store_true", help="save labels in YOLO format")
    output.add_argument("--save-conf", action="store_true", help="with --save-txt: add the confidence")
    output.add_argument("--save-crop", action="store_true", help="save each detection's crop")
    output.add_argument("--nosave", action="store_true", help="do not save annotated images or videos")
    output.add_argument("--hide-labels", action="store_true", help="draw boxes without class names")
    output.add_argument("--hide-conf", action="store_true", help="draw boxes without confidences")
    return parser


def run(**options: Any) -> DetectResults:
    """``python detect.py`` from Python: the same option names and defaults."""
    defaults = vars(build_parser().parse_args(["--weights", "", "--source", ""]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"run() got unknown option(s): {', '.join(unknown)}")
    return run_options(argparse.Namespace(**{**defaults, **options}))


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    setup_logging()
    LOGGER.info(setup_process(opt.device))
    return run_reporting_errors(lambda: run_options(opt) and None)


if __name__ == "__main__":
    sys.exit(main())
