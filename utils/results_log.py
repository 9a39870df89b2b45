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


def truncate_results(csv_file: Path, keep_below_epoch: int) -> None:
    """Drop the rows of epochs >= ``keep_below_epoch`` (a resumed run writes them again; no duplicates)."""
    if not csv_file.exists():
        return
    lines = csv_file.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if line.strip() and int(line.split(",")[0]) < keep_below_epoch]
    if len(kept) != len(lines):
        csv_file.write_text("".join(kept), encoding="utf-8")
