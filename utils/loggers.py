"""Training loggers: one small seam (``RunLogger``) with TensorBoard as the one implementation.

results.csv stays the run's primary record; loggers only mirror it. ``make_logger`` gives global rank 0 a
TensorBoard writer into the run folder when the optional ``tensorboard`` package is installed, and everyone
else (other ranks, no tensorboard) a logger that does nothing, so the training loop never checks.
Another logger implements the four methods of ``RunLogger`` and is added in ``make_logger``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from utils.log import LOGGER


class RunLogger(Protocol):
    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        """Scalars of one epoch (the results.csv columns: losses, metrics, learning rates)."""

    def log_batch(self, images: torch.Tensor, step: int) -> None:
        """A training batch (uint8, b x 3 x h x w) as one mosaic image."""

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        """The mean precision-recall curve (IoU 0.5) of a validation."""

    def close(self) -> None:
        ...


class NullLogger:
    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        pass

    def log_batch(self, images: torch.Tensor, step: int) -> None:
        pass

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Event files in the run folder (``tensorboard --logdir runs/train``)."""

    MAX_BATCH_IMAGES = 16

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.batch_logged = False

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), epoch)
        self.writer.flush()  # a live dashboard sees each epoch as it ends

    def log_batch(self, images: torch.Tensor, step: int) -> None:
        if self.batch_logged:  # one mosaic per run is what a user looks at; more only grows the file
            return
        from torchvision.utils import make_grid

        grid = make_grid(images[: self.MAX_BATCH_IMAGES].detach().cpu(), nrow=4)
        self.writer.add_image("train/batch_mosaic", grid, step)
        self.batch_logged = True

    def log_pr_curve(self, precision: np.ndarray, recall: np.ndarray, step: int) -> None:
        # The PR plugin reads its points in threshold order (recall falling); the counts are not known here.
        p, r = np.asarray(precision, dtype=np.float64)[::-1], np.asarray(recall, dtype=np.float64)[::-1]
        zeros = np.zeros(len(p))
        self.writer.add_pr_curve_raw("val/PR_curve", zeros, zeros, zeros, zeros, p, r, step, num_thresholds=len(p))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_logger(save_dir: Path, is_main: bool) -> RunLogger:
    """TensorBoard for global rank 0 when the package is there, otherwise a no-op logger."""
    if not is_main:
        return NullLogger()
    try:
        logger = TensorBoardLogger(save_dir)
    except ImportError:
        LOGGER.info("TensorBoard: not installed (pip install tensorboard); results.csv only")
        return NullLogger()
    LOGGER.info(f"TensorBoard: `tensorboard --logdir {save_dir.parent}` to view at http://localhost:6006/")
    return logger
