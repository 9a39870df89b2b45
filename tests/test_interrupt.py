"""Ctrl-C during training (issue 49 item 11): an exact checkpoint inside the epoch, one line naming the command that
resumes it, exit status 130; resumed, the run ends as an uninterrupted one."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import main_on_ranks

import train
from utils.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# yolov5n at 32 px, 16 images in batches of 4: 4 steps an epoch, each read back (--log-interval 1).
RUN = [
    *("--imgsz", "32", "--batch-size", "4", "--workers", "0", "--noautoanchor", "--device", "cpu", "--noplots"),
    *("--epochs", "2", "--noval", "--deterministic", "--loggers", "--log-interval", "1", "--name", "exp"),
]


def _interrupted_run(data: Path, project: Path) -> tuple[int, str]:
    """train.py as a user starts it, Ctrl-C'd (SIGINT) as its first step starts; its exit status and output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", YOLO_LOG_LEVEL="DEBUG")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "train.py", "--data", str(data), "--project", str(project), *RUN]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:  # DEBUG names each batch as its step starts
            lines.append(line)
            if "epoch 0 batch 0:" in line:
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stdout.readlines()
        status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, "".join(lines)


def test_ctrl_c_saves_inside_the_epoch_names_the_resume_command_and_resumes_exactly(rectangles_yaml, tmp_path) -> None:
    t0 = time.monotonic()
    status, output = _interrupted_run(rectangles_yaml, tmp_path / "cut")
    assert status == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "resume with:" in line]
    assert len(said) == 1, output[-3000:]
    last = tmp_path / "cut/exp/weights/last.pt"
    command = said[0].split("resume with: ", 1)[1]
    assert command == f"python train.py --resume {last}", said
    mid = load_checkpoint(last)["mid_epoch"]
    assert mid is not None and mid["epoch"] == 0 and 0 < mid["batch"] < 4, mid  # inside epoch 0: exact
    print(f"interrupted run: {time.monotonic() - t0:.1f} s")

    logs = tmp_path / "logs"
    codes, outputs = main_on_ranks(train.main, shlex.split(command)[2:], 1, logs / "resumed")  # as the line says
    assert codes == [0], outputs[0][-3000:]
    argv = ["--data", str(rectangles_yaml), "--project", str(tmp_path / "straight"), *RUN]
    codes, outputs = main_on_ranks(train.main, argv, 1, logs / "straight")
    assert codes == [0], outputs[0][-3000:]
    resumed, straight = load_checkpoint(last), load_checkpoint(tmp_path / "straight/exp/weights/last.pt")
    assert resumed["epoch"] == straight["epoch"] == 1
    for key in ("model", "ema"):
        assert all(torch.equal(resumed[key][k], straight[key][k]) for k in straight[key]), key
    rows = [(p / "results.csv").read_text().splitlines() for p in (tmp_path / "cut/exp", tmp_path / "straight/exp")]
    assert [r.split(",")[:4] for r in rows[0]] == [r.split(",")[:4] for r in rows[1]]  # epoch and train losses
