"""Report a dataset's health without training.

Usage:
    python check_data.py --data data.yaml [--imgsz 640] [--min-box-px 3] [--max-aspect 20] [--max-imbalance 50]
                         [--save-dir runs/check_data] [--strict]

Reads every split the data YAML names, in any form (label files, COCO JSON, Pascal VOC, tar shards), and prints
images and instances per split and class, backgrounds, corrupt files, label errors, tiny boxes at --imgsz,
extreme aspect ratios, class imbalance (the thresholds are printed and settable), and duplicate images (same
bytes) within a split and across splits, naming both files. Writes labels.jpg (class counts and box sizes of
train) to --save-dir. With --strict the exit status is 1 on leaks across splits, corrupt files or label errors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from utils.cli import add_allow_pipe, add_imgsz, add_max_pixels, add_workers, apply_data_limits, make_parser
from utils.data.config import load_data_config
from utils.data.health import Thresholds, check_dataset, report_lines
from utils.data.label_table import CORRUPT
from utils.errors import run_reporting_errors
from utils.log import LOGGER, setup_logging


def build_parser() -> argparse.ArgumentParser:
    t = Thresholds()
    p = make_parser("Report a dataset's health (counts, problems, leaks) without training")
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, help="dataset YAML")
    add_workers(data)
    add_allow_pipe(data)
    add_max_pixels(data)
    limits = p.add_argument_group("thresholds")
    add_imgsz(limits, help=f"the training image size the box sizes are judged at (default: {t.imgsz})")
    limits.add_argument("--min-box-px", type=float, default=t.min_box_px, help="tiny box: under this many pixels")
    limits.add_argument("--max-aspect", type=float, default=t.max_aspect, help="extreme box aspect ratio: above this")
    limits.add_argument(
        "--max-imbalance",
        type=float,
        default=t.max_imbalance,
        help="class imbalance warning: most / least common class instances above this",
    )
    output = p.add_argument_group("output")
    output.add_argument("--save-dir", default="runs/check_data", help="where labels.jpg is written")
    output.add_argument("--noplots", action="store_true", help="no labels.jpg")
    output.add_argument("--strict", action="store_true", help="exit 1 on leaks, corrupt files or label errors")
    return p


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(opt: argparse.Namespace) -> int:
    apply_data_limits(opt)
    config = load_data_config(opt.data)
    thresholds = Thresholds(opt.imgsz or Thresholds().imgsz, opt.min_box_px, opt.max_aspect, opt.max_imbalance)
    health = check_dataset(config, thresholds, opt.workers)
    for line in report_lines(health, config["names"]):
        print(line)
    if not opt.noplots:
        from utils.plots import plot_labels

        train = health.splits[0].table
        usable = train.labels.rows[(train.status != CORRUPT)[train.labels.image_of_row()]]
        plot = plot_labels(np.asarray(usable), config["names"], Path(opt.save_dir))
        print(f"class counts and box sizes: {plot}")
    if opt.strict and health.failed:
        LOGGER.error("ERROR --strict: leaks across splits, corrupt files or label errors (see above)")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    opt = parse_opt(argv)
    setup_logging()
    return run_reporting_errors(lambda: run(opt))


if __name__ == "__main__":
    sys.exit(main())
