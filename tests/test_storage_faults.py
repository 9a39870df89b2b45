"""A run folder on an S3 server that stops answering mid-run: a private server (moto's, started for the test: the
suite's shared SeaweedFS must not be frozen under the other tests) is stopped with SIGSTOP for a few seconds while
the run trains; training goes on, the uploads that met the frozen server are tried again, and the bucket ends
holding every file of the run as the run wrote it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

import utils.engine.trainer as trainer
import utils.storage
from utils.engine.run_record import RunRecord
from utils.storage import open_storage

ROOT = Path(__file__).resolve().parents[1]
FREEZE_S = 3.0  # the server stays stopped this long after an epoch has ended while it was
FROZEN_AT_MOST_S = 60.0  # a run whose training waited for the server would end no epoch while it is stopped


def _moto_server(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
    return proc, endpoint


@pytest.fixture
def frozen_later(tmp_path, monkeypatch):
    """A private moto S3 server for this test, its bucket, and the server's process (to stop and continue)."""
    proc, endpoint = _moto_server(tmp_path / "moto.log")
    for name, value in {
        "AWS_ACCESS_KEY_ID": "frozen-key",
        "AWS_SECRET_ACCESS_KEY": "frozen-secret",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    # A request to the frozen server fails after a second (a frozen production server: after a minute) and is
    # tried again, instead of waiting for the server to wake.
    monkeypatch.setattr(utils.storage, "READ_TIMEOUT_S", 1.0)
    bucket = f"f{uuid.uuid4().hex[:10]}"
    open_storage(f"s3://{bucket}").fs.mkdir(bucket)
    yield proc, bucket
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_server_frozen_mid_run_holds_up_no_epoch_and_the_bucket_ends_with_every_file(
    frozen_later, rectangles_yaml, train_here, tmp_path, monkeypatch
) -> None:
    proc, bucket = frozen_later
    run_url = f"s3://{bucket}/runs/exp"
    epochs_ended: list[float] = []
    ended_while_frozen = threading.Event()
    frozen: dict[str, float] = {}
    end_epoch = RunRecord.end_epoch

    froze = threading.Event()

    def timed_end_epoch(self, *args, **kwargs):
        ended = end_epoch(self, *args, **kwargs)
        epochs_ended.append(time.monotonic())
        if not froze.is_set():  # the first epoch's checkpoint is on its way: the server stops under its upload
            os.killpg(proc.pid, signal.SIGSTOP)
            frozen["from"] = time.monotonic()
            froze.set()
        elif "to" not in frozen:
            ended_while_frozen.set()
        return ended

    monkeypatch.setattr(RunRecord, "end_epoch", timed_end_epoch)
    staged = tmp_path / "staged"  # the run's local folder as it ends, before it is removed

    def keep_then_remove(folder: Path) -> None:
        shutil.copytree(folder, staged)
        shutil.rmtree(folder)

    monkeypatch.setattr(trainer, "remove_staging", keep_then_remove)

    def thaw_once_an_epoch_ended_while_frozen() -> None:
        """The server, stopped as the first epoch ended, stays stopped until another epoch has ended meanwhile (at
        most FROZEN_AT_MOST_S) and FREEZE_S more: long enough for the uploads to fail against it."""
        froze.wait(120)
        ended_while_frozen.wait(FROZEN_AT_MOST_S)
        time.sleep(FREEZE_S)
        frozen["to"] = time.monotonic()
        os.killpg(proc.pid, signal.SIGCONT)

    freezer = threading.Thread(target=thaw_once_an_epoch_ended_while_frozen, daemon=True)
    freezer.start()
    args = ["--data", rectangles_yaml, "--epochs", "3", "--noval", "--project", f"s3://{bucket}/runs", "--name", "exp"]
    status, log = train_here(*args)
    freezer.join(timeout=60)
    assert status == 0, log[-3000:]
    assert "to" in frozen, "the server was never frozen"
    # Training went on while the server was stopped: epochs ended then.
    assert [t for t in epochs_ended if frozen["from"] < t < frozen["to"]], (epochs_ended, frozen)
    retried = [line for line in log.splitlines() if "uploaded on try" in line]
    assert retried, log[-3000:]
    # Nothing lost: the bucket holds every file the run wrote, byte for byte.
    bucket_run = open_storage(run_url)
    written = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert bucket_run.files() == written
    for name in written:
        assert bucket_run.read_bytes(name) == (staged / name).read_bytes(), name


@pytest.mark.slow
def test_a_launcher_restart_continues_its_run_in_the_bucket(bucket, rectangles_yaml, tmp_path) -> None:
    """--max-restarts with --project s3://...: the rank killed once a checkpoint is complete in the bucket, the
    launcher's new worker finds the run its job made there (its run_id marker) and continues it: no second run
    folder, every epoch in results.csv once, the record finished."""
    from test_train import _env, kill_run, rank_pid, train_cmd

    project = f"s3://{bucket}/runs"
    cmd = train_cmd(rectangles_yaml, project, "--epochs", "2", "--noval", "--noplots", "--save-steps", "1", nproc=1)
    at = cmd.index("--standalone")
    cmd[at : at + 1] = ["--max-restarts=1", "--standalone"]
    env = dict(_env(), TMPDIR=str(tmp_path))  # the killed rank's staging folder stays here
    run = open_storage(f"{project}/exp")
    with open(tmp_path / "launched.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (run.exists("run.json") and json.loads(run.read_bytes("run.json")).get("newest_checkpoint")):
                assert proc.poll() is None, (tmp_path / "launched.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint reached the bucket"
                time.sleep(0.1)
            os.kill(rank_pid(proc, 0), signal.SIGKILL)
            assert proc.wait(timeout=300) == 0, (tmp_path / "launched.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                kill_run(proc)
    output = (tmp_path / "launched.log").read_text()
    assert re.search(rf"restart 1 of launcher run \S+: continuing {project}/exp\n", output), output[-3000:]
    assert open_storage(project).listdir() == ["exp"]
    assert json.loads(run.read_bytes("run.json"))["status"] == "finished"
    epochs = [int(float(r.split(",")[0])) for r in run.read_bytes("results.csv").decode().splitlines()[1:]]
    assert epochs == [0, 1]
