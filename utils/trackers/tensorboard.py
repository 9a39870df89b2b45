"""TensorBoard event files in the run folder (``tensorboard --logdir runs/train``).

A process that starts on a run folder hides the events of earlier processes there (TensorBoard's purge at step
0) and writes results.csv's rows again from the reconciliation: after a resume the folder shows every epoch
once, with the values results.csv kept, whatever the earlier processes wrote before they were stopped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from utils.log import LOGGER
from utils.trackers.base import Tracker, TrackerRun

# TensorBoard stores every image as a PNG, encoded in the tracker's thread and waited for when the run ends: the
# run folder's large photo mosaics made most of the run's end (docs/benchmarks.md, "TensorBoard's images at a run's
# end"), for a dashboard that shows them smaller than this anyway. The files in the run folder keep full size.
MAX_IMAGE_SIDE = 800


def fitted(image: np.ndarray) -> np.ndarray:
    """An HWC uint8 image scaled down (never up) so that its longer side is at most ``MAX_IMAGE_SIDE``."""
    import cv2

    h, w = image.shape[:2]
    scale = MAX_IMAGE_SIDE / max(h, w)
    if scale >= 1:
        return np.ascontiguousarray(image)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return cv2.resize(np.ascontiguousarray(image), size, interpolation=cv2.INTER_AREA)


class TensorBoardTracker(Tracker):
    name, title, package = "tensorboard", "TensorBoard", "tensorboard"

    def __init__(self) -> None:
        self.writer: Any = None  # a SummaryWriter once open() ran: tensorboard is imported there
        self.batch_logged = False

    def open(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

        self.writer = SummaryWriter(log_dir=str(run.run_dir), purge_step=0)
        LOGGER.info(f"TensorBoard: `tensorboard --logdir {Path(run.run_dir).parent}` to view at http://localhost:6006/")
        return {}  # nothing to find again: the event files are the run folder's

    def log_params(self, params: Mapping[str, Any]) -> None:
        rows = "".join(f"| {k} | {v} |\n" for k, v in params.items())
        self.writer.add_text("params", "| parameter | value |\n| --- | --- |\n" + rows, 0)

    def log_metrics(self, epoch: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), epoch)
        self.writer.flush()  # a live dashboard sees each epoch as it ends

    def log_batch(self, images: Any, step: int) -> None:
        if self.batch_logged:  # one mosaic per process is what a user looks at; more only grows the file
            return
        from torchvision.utils import make_grid

        grid = make_grid(images[:16], nrow=4)  # C, H, W, uint8 or float in [0, 1]; 16 images as the plots show
        hwc = grid.permute(1, 2, 0).contiguous().cpu().numpy()
        if hwc.dtype != np.uint8:
            hwc = (hwc.clip(0, 1) * 255).round().astype(np.uint8)
        self.writer.add_image("train/batch_mosaic", fitted(hwc), step, dataformats="HWC")
        self.batch_logged = True

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        # The PR plugin reads its points in threshold order (recall falling); the counts are not known here.
        p, r = precision[::-1], recall[::-1]
        zeros = np.zeros(len(p))
        self.writer.add_pr_curve_raw("val/PR_curve", zeros, zeros, zeros, zeros, p, r, step, num_thresholds=len(p))
        self.writer.flush()

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        import cv2

        for path in paths:
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if image is not None:
                self.writer.add_image(f"plots/{Path(path).stem}", fitted(image[..., ::-1]), step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
