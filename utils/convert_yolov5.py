"""Convert a YOLOv5 v6+ ``.pt`` once into this project's safe format, so later loads use ``weights_only=True``.

Usage:
    python -m utils.convert_yolov5 yolov5s.pt yolov5s_safe.pt

The input is read by its family's allow-list importer (models/families/; nothing in it runs); the output holds
the model config, class names, fp32 weights (and the EMA's when the file has one) and YOLOv5's plain metadata.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, setup_logging


def convert(src: str | Path, dst: str | Path) -> Path:
    """Import ``src`` (a YOLOv5 checkpoint) and save it to ``dst`` in this project's format."""
    from utils.checkpoint import load_checkpoint, save_checkpoint

    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise UserError(f"{dst}: the output must not overwrite the input")
    ckpt = load_checkpoint(src)
    if "format_version" in ckpt:  # only files written by save_checkpoint carry it
        raise UserError(f"{src}: already a checkpoint of this project; nothing to convert")
    save_checkpoint(ckpt, dst)
    LOGGER.info(
        f"{dst}: written ({len(ckpt['model'])} tensors, {len(ckpt['names'])} classes); "
        "it loads with torch.load(weights_only=True)"
    )
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a YOLOv5 v6+ checkpoint to this project's safe format")
    parser.add_argument("source", help="YOLOv5 .pt (official or trained with YOLOv5)")
    parser.add_argument("output", help="where to write the converted checkpoint")
    opt = parser.parse_args(argv)
    setup_logging()

    def run() -> None:
        convert(opt.source, opt.output)

    return run_reporting_errors(run)


if __name__ == "__main__":
    sys.exit(main())
