"""val.py under torch.distributed.run (2 gloo ranks) prints and writes exactly what one process does, with its
defaults (plots on), on loose files and on shards."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import main_on_ranks, write_rectangles_dataset
from test_val import _random_checkpoint

import val
from utils.log import LOGGER

ROOT = Path(__file__).resolve().parents[1]


def _table(stdout: str) -> list[str]:
    """The metric rows (class name, images, instances, P, R, mAP50, mAP50-95) of val.py's report."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["Class", "Images"])
    return [line for line in lines[start : start + 4] if line.strip()]


@contextlib.contextmanager
def _one_thread():
    """The ranks' thread count (OMP_NUM_THREADS=1) in this process: the kernels' summation order depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _single_process(args: list[str], caplog) -> list[str]:
    """val.py's table from one process, in this one."""
    caplog.clear()
    LOGGER.addHandler(caplog.handler)
    old_level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        assert val.main(args) == 0
    finally:
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
    loose = [*tiny, "--data", str(data), "--verbose", "--save-json", "--exist-ok"]  # val.py's defaults otherwise
    shards = [*tiny, "--data", str(tmp_path / "sh" / "data.yaml"), "--project", str(tmp_path / "ddp-shards")]
    # Loose files launched, not forked: val.py's only 2-rank test also covers its start under the launcher (the
    # agent's store, ending with the launcher), which the train.py launcher tests cover for train.py.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "val.py"]
    proc = subprocess.Popen(
        [*torchrun, *loose, "--project", str(tmp_path / "ddp-loose")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with _one_thread():  # meanwhile: the shards on 2 ranks forked as the launcher would start them (cheaper to
        # start than a second launch), then one process over the loose files without plots (the same table)
        codes, outputs = main_on_ranks(val.main, shards, 2, tmp_path / "shard-logs")
        single = _single_process([*loose, "--noplots", "--project", str(tmp_path / "single-loose")], caplog)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"{stdout[-2000:]}{stderr[-2000:]}"
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert _table(stdout) == single and len(single) == 4  # header, all, red, blue: to the last printed digit
    assert _table(outputs[0])[:2] == single[:2]  # the shards hold the same images: the same `all` row
    for run in ("ddp-loose", "ddp-shards"):  # plots on, as by default: drawn once, from every rank's matches
        assert (tmp_path / run / "exp" / "confusion_matrix.png").is_file(), run

    n_boxes = sum(len(p.read_text().splitlines()) for p in (tmp_path / "data/labels/val").glob("*.txt"))
    assert single[1].split()[1:3] == ["9", str(n_boxes)]
    assert float(single[1].split()[-2]) > 0  # not a comparison of zeros
    preds = [
        json.loads((tmp_path / f"{name}-loose" / "exp" / "predictions.json").read_text()) for name in ("single", "ddp")
    ]
    assert preds[0] == preds[1] and len(preds[0]) > 0  # every rank's detections, gathered in image order
