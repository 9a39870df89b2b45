"""bench/gpu_report.py --dry-run: every part of the prepared GPU run on the CPU at toy sizes, so that a GPU
machine's minutes are spent measuring, not debugging the script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_each_result(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_report.py", "--dry-run", "--out", str(out), "--work", str(tmp_path / "work")]
    done = subprocess.run([*cmd, "--budget", "900"], cwd=ROOT, capture_output=True, text=True, timeout=1000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == [
        "throughput-yolo11n",
        "profile-and-sync-debug",
        "validation",
        "cuda-tests",
        "val-layouts",
        "compile",
        "cudnn",
        "throughput-yolo11s",
    ]
    assert all(p["status"] == "done" for p in parts.values()), parts
    # Epochs timed between saves. At toy sizes two saves can land within one poll of the watcher and count as one, so
    # the check is that the intervals were measured, not that every one of the 4 saves was seen.
    assert parts["throughput-yolo11n"]["ours"]["intervals"] and parts["throughput-yolo11n"]["ours"]["saves"] >= 3
    assert parts["throughput-yolo11n"]["ours_stamps"]  # the stamped lines of its log
    assert parts["profile-and-sync-debug"]["sync_debug"]["steps"] == 3
    assert (out / "profile.json.gz").stat().st_size > 0
    assert parts["validation"]["ours"]["map50_95"] >= 0  # val.py printed its table
    assert len(parts["cudnn"]["lines"]) == 2  # benchmark off and on
    assert len(parts["val-layouts"]["lines"]) == 4  # channels_last or NCHW, autocast or fp16 weights
    assert parts["compile"]["compiled"]["intervals"] and parts["compile"]["ratio"] > 0  # beside the plain run
    assert "## throughput-yolo11s" in (out / "report.md").read_text()
