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

        self.writer.add_image("train/batch_mosaic", make_grid(images, nrow=4), step)
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
                self.writer.add_image(f"plots/{Path(path).stem}", image[..., ::-1].copy(), step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
