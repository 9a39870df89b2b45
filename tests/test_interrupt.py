"""Ctrl-C during training (issue 49 item 11): an exact checkpoint inside the epoch, one line naming the command that
resumes it, exit status 130; resumed, the run ends as an uninterrupted one. Under torch.distributed.run, SIGTERM to
the launcher or to one worker alone stops both ranks at the same step."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, main_on_ranks

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


# Two gloo ranks: yolov5n at 64 px, 16 images in global batches of 2 (one per rank: 8 steps an epoch, each read
# back), one epoch.
DDP_RUN = [*RUN, "--imgsz", "64", "--batch-size", "2", "--epochs", "1"]
STEP_STARTED = re.compile(r"rank (\d) epoch (\d+) batch (\d+):")  # DEBUG: each rank names each batch it starts


def _last_steps(output: str) -> dict[int, tuple[int, int]]:
    """Each rank's last (epoch, batch) started, from the DEBUG lines."""
    return {int(r): (int(e), int(b)) for r, e, b in STEP_STARTED.findall(output)}


def _worker_of(launcher: int, rank: int) -> int:
    """The launcher's worker process of ``rank`` (by the RANK its environment holds)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under the launcher {launcher}")


def _launched_and_signalled(data: Path, project: Path, only_rank: int | None) -> tuple[int, str]:
    """train.py on 2 ranks under torch.distributed.run, SIGTERM'd as rank 0's second step starts (after the first
    step's collectives, so both ranks are inside the epoch, where a stop is saved; on a loaded machine rank 1 can be
    still in its set-up as rank 0's first step starts, and a signal there ends it at once): to the launcher
    (which passes it to every worker, as a scheduler's pre-emption does), or to the worker of ``only_rank`` alone."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", YOLO_LOG_LEVEL="DEBUG")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    cmd = [*launcher, str(free_port()), "train.py", "--data", str(data), "--project", str(project), *DDP_RUN]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "rank 0 epoch 0 batch 1:" in line:
                target = proc.pid if only_rank is None else _worker_of(proc.pid, only_rank)
                os.kill(target, signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, "".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("only_rank", [None, 1], ids=["launcher-signalled", "one-worker-signalled"])
def test_sigterm_under_the_launcher_stops_both_ranks_at_one_step(rectangles_yaml, tmp_path, only_rank) -> None:
    status, output = _launched_and_signalled(rectangles_yaml, tmp_path / "cut", only_rank)
    # The workers end with 143 (128 + SIGTERM); the launcher reports its signal or their status: not 0. Once the first
    # worker has ended, the launcher sends the other SIGTERM itself: one still on its way out ends by that (-15).
    assert status != 0, output[-3000:]
    codes = re.findall(r"exitcode  : (-?\d+)", output)
    ended = "exitcode  : 143" in output and set(codes) <= {"143", "-15"} and len(codes) == 2
    assert ended or "got signal: 15" in output, output[-3000:]
    said = "Stopped by signal 15 with a checkpoint; resume with: python -m torch.distributed.run"
    assert said in output, output[-3000:]
    steps = _last_steps(output)
    assert steps[0] == steps[1], (steps, output[-3000:])  # the stop took effect at the same step on both ranks
    mid = load_checkpoint(tmp_path / "cut/exp/weights/last.pt")["mid_epoch"]
    assert mid is not None, (steps, output[-3000:])  # inside the epoch: exact
    assert (mid["epoch"], mid["batch"]) == (steps[0][0], steps[0][1] + 1), (mid, steps)
    assert output.count("newest complete checkpoint:") == 1, output[-3000:]  # written once, by rank 0

    if only_rank is None:  # resumed on 2 ranks, the run ends as one never stopped (the other case stops alike)
        last = tmp_path / "cut/exp/weights/last.pt"
        codes, outputs = main_on_ranks(train.main, ["--resume", str(last)], 2, tmp_path / "logs/resumed")
        assert codes == [0, 0], outputs[0][-3000:]
        argv = ["--data", str(rectangles_yaml), "--project", str(tmp_path / "straight"), *DDP_RUN]
        codes, outputs = main_on_ranks(train.main, argv, 2, tmp_path / "logs/straight")
        assert codes == [0, 0], outputs[0][-3000:]
        resumed, straight = load_checkpoint(last), load_checkpoint(tmp_path / "straight/exp/weights/last.pt")
        assert resumed["epoch"] == straight["epoch"] == 0 and resumed["mid_epoch"] is None
        for key in ("model", "ema"):
            assert all(torch.equal(resumed[key][k], straight[key][k]) for k in straight[key]), key
