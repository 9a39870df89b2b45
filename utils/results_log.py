"""results.csv: one row per epoch with the losses, validation metrics and learning rates."""
from __future__ import annotations

from pathlib import Path

RESULT_COLUMNS = (
    "epoch", "train/box_loss", "train/obj_loss", "train/cls_loss",
    "metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95",
    "val/box_loss", "val/obj_loss", "val/cls_loss", "x/lr0", "x/lr1", "x/lr2",
)


def append_results_row(csv_file: Path, values: list[float]) -> None:
    """Append a row (writing the header first when the file is new); values follow RESULT_COLUMNS."""
    if len(values) != len(RESULT_COLUMNS):
        raise ValueError(f"expected {len(RESULT_COLUMNS)} values, got {len(values)}")
    new = not csv_file.exists()
    with open(csv_file, "a", encoding="utf-8") as f:
        if new:
            f.write(",".join(f"{c:>20}" for c in RESULT_COLUMNS) + "\n")
        f.write(f"{int(values[0]):>20}," + ",".join(f"{v:>20.5g}" for v in values[1:]) + "\n")
