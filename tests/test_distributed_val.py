"""val.py under torch.distributed.run (2 gloo ranks) prints and writes exactly what one process does, with its
defaults (plots on), on loose files and on shards."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_rectangles_dataset
from test_val import _random_checkpoint

import val
from utils.log import LOGGER

ROOT = Path(__file__).resolve().parents[1]


def _table(stdout: str) -> list[str]:
    """The metric rows (class name, images, instances, P, R, mAP50, mAP50-95) of val.py's report."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["Class", "Images"])
    return [line for line in lines[start : start + 4] if line.strip()]


def _single_process(args: list[str], caplog) -> list[str]:
    """val.py's table from one process, in this one, with the ranks' thread count (the kernels' summation order
    depends on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    caplog.clear()
    LOGGER.addHandler(caplog.handler)
    old_level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        assert val.main(args) == 0
    finally:
        torch.set_num_threads(threads)
        LOGGER.removeHandler(caplog.handler)
        LOGGER.setLevel(old_level)
    return _table("\n".join(r.getMessage() for r in caplog.records))


@pytest.mark.slow
def test_val_py_on_two_ranks_equals_one_process(tmp_path, caplog) -> None:
    data = write_rectangles_dataset(tmp_path / "data", n_train=2, n_val=9, seed=3)
    from shards import main as make_shards

    assert make_shards(["--data", str(data), "--out", str(tmp_path / "sh"), "--max-count", "4", "--workers", "1"]) == 0
    weights = _random_checkpoint(tmp_path / "rand.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    tiny = ["--weights", str(weights), "--imgsz", "64", "--batch-size", "2", "--device", "cpu", "--workers", "0"]
    runs = {  # val.py's defaults otherwise: plots on
        "loose": [*tiny, "--data", str(data), "--verbose", "--save-json", "--exist-ok"],
        "shards": [*tiny, "--data", str(tmp_path / "sh" / "data.yaml"), "--exist-ok"],
    }
    # Launched, not forked: val.py's only 2-rank test also covers its start under the launcher (the agent's store,
    # ending with the launcher), which the train.py launcher tests cover for train.py. Both worlds run side by side.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "val.py"]
    procs = {
        name: subprocess.Popen(
            [*torchrun, *args, "--project", str(tmp_path / f"ddp-{name}")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in runs.items()
    }
    # one process over the loose files; the shards hold the same images, so their `all` row is the same
    single = _single_process([*runs["loose"], "--project", str(tmp_path / "single-loose")], caplog)
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name}: {stdout[-2000:]}{stderr[-2000:]}"
        ddp = _table(stdout)
        rows = 4 if name == "loose" else 2  # header, all, then red and blue with --verbose: to the last digit
        assert ddp[:rows] == single[:rows] and len(single) == 4, name
        assert (tmp_path / f"ddp-{name}" / "exp" / "confusion_matrix.png").is_file()  # plots on, drawn once

    n_boxes = sum(len(p.read_text().splitlines()) for p in (tmp_path / "data/labels/val").glob("*.txt"))
    assert single[1].split()[1:3] == ["9", str(n_boxes)]
    assert float(single[1].split()[-2]) > 0  # not a comparison of zeros
    preds = [
        json.loads((tmp_path / f"{name}-loose" / "exp" / "predictions.json").read_text()) for name in ("single", "ddp")
    ]
    assert preds[0] == preds[1] and len(preds[0]) > 0  # every rank's detections, gathered in image order
