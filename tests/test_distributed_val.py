"""val.py on 2 gloo ranks prints and writes exactly what one process does."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import val

from conftest import main_on_ranks, write_rectangles_dataset
from test_val import _random_checkpoint
from utils.log import LOGGER



def _table(stdout: str) -> list[str]:
    """The metric rows (class name, images, instances, P, R, mAP50, mAP50-95) of val.py's report."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["Class", "Images"])
    return [line for line in lines[start : start + 4] if line.strip()]


@pytest.mark.slow
def test_val_py_on_two_ranks_equals_one_process(tmp_path, caplog) -> None:
    data = write_rectangles_dataset(tmp_path / "data", n_train=2, n_val=9, seed=3)
    weights = _random_checkpoint(tmp_path / "rand.pt")
    args = ["--data", str(data), "--weights", str(weights), "--imgsz", "64", "--batch-size", "2", "--device", "cpu",
            "--workers", "0", "--verbose", "--save-json", "--noplots", "--exist-ok"]
    codes, outputs = main_on_ranks(val.main, [*args, "--project", str(tmp_path / "ddp")], 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]

    # one process, in this one, with the ranks' thread count (the kernels' summation order depends on it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    LOGGER.addHandler(caplog.handler)
    old_level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        val.main([*args, "--project", str(tmp_path / "single")])
    finally:
        torch.set_num_threads(threads)
        LOGGER.removeHandler(caplog.handler)
        LOGGER.setLevel(old_level)
    single, ddp = _table("\n".join(r.getMessage() for r in caplog.records)), _table(outputs[0])
    assert single == ddp and len(single) == 4  # header, all, red, blue: to the last printed digit
    n_boxes = sum(len(p.read_text().splitlines()) for p in (tmp_path / "data/labels/val").glob("*.txt"))
    assert single[1].split()[1:3] == ["9", str(n_boxes)]
    assert float(single[1].split()[-2]) > 0  # not a comparison of zeros
    preds = [json.loads((tmp_path / name / "exp" / "predictions.json").read_text()) for name in ("single", "ddp")]
    assert preds[0] == preds[1] and len(preds[0]) > 0  # every rank's detections, gathered in image order
