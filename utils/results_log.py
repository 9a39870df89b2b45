"""results.csv: one row per epoch with the losses, validation metrics and learning rates."""

from __future__ import annotations

from pathlib import Path

from utils.files import atomic_output
from utils.log import LOGGER

METRIC_COLUMNS = ("metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95")


def result_columns(loss_names: tuple[str, ...], n_param_groups: int = 3) -> tuple[str, ...]:
    """results.csv's columns (and TensorBoard's tags) for a loss with these terms (the model family's, any number:
    box, obj, cls for YOLOv5; box, cls, dfl for YOLOv8/11; box, cls, l1 for YOLO26) and the learning rate of each
    of the optimizer's parameter groups."""
    return (
        "epoch",
        *(f"train/{n}_loss" for n in loss_names),
        *METRIC_COLUMNS,
        *(f"val/{n}_loss" for n in loss_names),
        *(f"x/lr{j}" for j in range(n_param_groups)),
    )


def append_results_row(csv_file: Path, values: list[float], columns: tuple[str, ...]) -> None:
    """Append a row (writing the header ``columns`` first when the file is new); values follow ``columns``."""
    if len(values) != len(columns):
        raise ValueError(f"expected {len(columns)} values, got {len(values)}")
    new = not csv_file.exists()
    with open(csv_file, "a", encoding="utf-8") as f:
        if new:
            f.write(",".join(f"{c:>20}" for c in columns) + "\n")
        f.write(f"{int(values[0]):>20}," + ",".join(f"{v:>20.5g}" for v in values[1:]) + "\n")


def _row_epoch(line: str, n_columns: int) -> int | None:
    """A row's epoch when it is ``n_columns`` numbers, the first a whole one (``1`` or ``1.0``), else None: a row
    that was edited, cut short or holds bytes that are not UTF-8 is not a row of results."""
    try:
        values = [float(v) for v in line.split(",")]
    except ValueError:
        return None
    return int(values[0]) if len(values) == n_columns > 1 and values[0].is_integer() else None


def _lines(csv_file: Path) -> list[str]:
    """The file's lines; bytes that are not UTF-8 read as U+FFFD (their rows are then dropped, not fatal)."""
    return csv_file.read_text(encoding="utf-8", errors="replace").splitlines()


def truncate_results(csv_file: Path, keep_below_epoch: int) -> None:
    """Drop the rows of epochs >= ``keep_below_epoch`` (a resumed run writes them again; no duplicates), and rows
    that are not numbers (logged: they would stop results.png)."""
    if not csv_file.exists():
        return
    lines = _lines(csv_file)
    n_columns = len(lines[0].split(",")) if lines else 0
    rows = [(line, _row_epoch(line, n_columns)) for line in lines[1:] if line.strip()]
    bad = [line for line, epoch in rows if epoch is None]
    if bad:
        LOGGER.warning(f"WARNING {csv_file}: {len(bad)} row(s) that are not numbers dropped (first: {bad[0][:60]!r})")
    kept = lines[:1] + [  # the epoch written as the integer it is (`1.0` -> `1`), as the trackers read it
        f"{epoch:>20}," + line.split(",", 1)[1]
        for line, epoch in rows
        if epoch is not None and epoch < keep_below_epoch
    ]
    text = "".join(line + "\n" for line in kept)
    if text.encode("utf-8") != csv_file.read_bytes():
        with atomic_output(csv_file) as tmp:
            tmp.write_text(text, encoding="utf-8")


def extend_results_columns(csv_file: Path, columns: tuple[str, ...]) -> None:
    """A results.csv whose header is the start of ``columns`` (written before the later ones existed) gets the
    whole header, its rows ``nan`` in the new columns; a file with other columns is left as it is."""
    if not csv_file.exists():
        return
    lines = _lines(csv_file)
    header = [c.strip() for c in lines[0].split(",")] if lines else []
    if not header or len(header) >= len(columns) or tuple(header) != columns[: len(header)]:
        return
    pad = "," + ",".join(f"{'nan':>20}" for _ in columns[len(header) :])
    rows = [line + pad for line in lines[1:] if line.strip()]
    with atomic_output(csv_file) as tmp:
        tmp.write_text("\n".join([",".join(f"{c:>20}" for c in columns), *rows]) + "\n", encoding="utf-8")
