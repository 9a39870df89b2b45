"""Experiment trackers: several at once, never in training's way, one tracker run per training across kills.

One real MLflow tracking server on loopback serves the session (its start costs seconds); W&B runs offline.
The training here is a stand-in that writes results.csv as training does and makes the tracker calls the
engine makes, in the same order; it is killed with SIGKILL and resumed.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

from utils.errors import UserError
from utils.log import LOGGER
from utils.results_log import append_results_row, result_columns, truncate_results
from utils.trackers import NullLogger, Tracker, TrackerRun, Trackers, open_trackers, read_ids, run_params

COLUMNS = result_columns(("box", "obj", "cls"))


class Lines:
    """The project logger's messages while in use."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self) -> Lines:
        LOGGER.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        LOGGER.removeHandler(self.handler)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


class Recording(Tracker):
    """A tracker that records what reaches it; ``held`` pretends its run already holds those epochs."""

    name, title = "recording", "Recording"

    def __init__(self, held: dict[str, set[int]] | None = None, gate: threading.Event | None = None,
                 fail_at: int | None = None):
        self.logged: list[tuple[int, tuple[str, ...]]] = []
        self._held, self.gate, self.fail_at = held or {}, gate, fail_at
        self.closed_with = ""

    def open(self, run, saved):
        return {"run_id": (saved or {}).get("run_id", "r1")}

    def held(self):
        return self._held

    def log_metrics(self, epoch, values):
        if self.gate is not None:
            self.gate.wait()  # a server that answers only after minutes of retries
        if epoch == self.fail_at:
            raise OSError(28, "No space left on device")
        self.logged.append((epoch, tuple(values)))

    def close(self, status):
        self.closed_with = status


def write_rows(csv_file: Path, epochs) -> None:
    for epoch in epochs:
        append_results_row(csv_file, [epoch, *values_of(epoch)], COLUMNS)


def values_of(epoch: int) -> list[float]:
    """An epoch's results.csv values (5 significant digits, as results.csv holds them)."""
    return [round(0.1 + 0.01 * epoch + 0.001 * i, 5) for i in range(len(COLUMNS) - 1)]


def test_a_tracker_that_hangs_or_fails_never_holds_training_up(tmp_path) -> None:
    gate = threading.Event()
    hanging, failing = Recording(gate=gate), Recording(fail_at=2)
    hanging.title, failing.title = "Hanging", "Failing"
    with Lines() as log:
        stuck = Trackers(TrackerRun(tmp_path / "a"), [hanging], max_pending=4, close_timeout=0.5)
        start = time.perf_counter()
        for epoch in range(200):
            stuck.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
        elapsed = time.perf_counter() - start
        stuck.close()
        broken = Trackers(TrackerRun(tmp_path / "b"), [failing])  # a disk that fills up at epoch 2
        for epoch in range(5):
            broken.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
            assert broken.flush(10)
        broken.close()
    gate.set()  # let the hanging thread end
    # A tracker waiting on a server would hold every call forever; here 200 calls do not wait for it.
    assert elapsed < 2.0, elapsed
    assert [e for e, _ in failing.logged] == [0, 1] and failing.closed_with == "failed"
    assert log.lines == [
        "WARNING Hanging is 4 records behind: new records are discarded until it catches up (results.csv keeps "
        "them; the tracker run is completed from it at the end)",
        "WARNING Hanging did not finish within 0.5 s; its last records may be missing (results.csv holds them)",
        "WARNING Failing stopped for the rest of this run (OSError: [Errno 28] No space left on device); "
        "training goes on and results.csv keeps the record"]


def test_reconciling_with_results_csv_logs_each_epoch_once(tmp_path) -> None:
    csv_file = tmp_path / "results.csv"
    write_rows(csv_file, range(4))
    tracker = Recording(held={c: {0, 1} for c in COLUMNS[1:]})  # its run holds epochs 0 and 1 already
    trackers = Trackers(TrackerRun(tmp_path, resumed=True, saved={"recording": {"run_id": "from-checkpoint"}}),
                        [tracker])
    trackers.log_epoch(3, dict(zip(COLUMNS[1:], values_of(3))))  # held now: the reconciliation logged it
    trackers.log_epoch(4, dict(zip(COLUMNS[1:], values_of(4))))
    write_rows(csv_file, [4, 5])  # epoch 5: a record the tracker never got (a full queue discarded it)
    assert trackers.flush(10)
    assert trackers.state() == {"recording": {"run_id": "from-checkpoint"}}
    assert read_ids(tmp_path) == trackers.state()  # trackers.yaml, written when the tracker run opened
    trackers.close()
    assert [e for e, _ in tracker.logged] == [2, 3, 4, 5]
    assert all(keys == COLUMNS[1:] for _, keys in tracker.logged)
    # A resumed run prefers the run folder's ids to the checkpoint's; a new run in the folder starts anew.
    resumed = Trackers(TrackerRun(tmp_path, resumed=True, saved={"recording": {"run_id": "older"}}), [Recording()])
    fresh = Trackers(TrackerRun(tmp_path), [Recording()])
    assert resumed.flush(10) and fresh.flush(10)
    assert resumed.state()["recording"]["run_id"] == "from-checkpoint"
    assert fresh.state()["recording"]["run_id"] == "r1"
    resumed.close()
    fresh.close()


def test_tracker_names_packages_and_ranks(tmp_path, monkeypatch) -> None:
    with pytest.raises(UserError, match=r"^--loggers comet: not a tracker \(choose from tensorboard, mlflow, wandb\)$"):
        open_trackers(TrackerRun(tmp_path, names=("comet",)), is_main=True)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError, match=r"^--loggers mlflow needs the mlflow package \(pip install mlflow\)$"):
        open_trackers(TrackerRun(tmp_path, names=("tensorboard", "mlflow")), is_main=True)
    with pytest.raises(UserError, match="needs the mlflow package"):  # on every rank: all stop at once
        open_trackers(TrackerRun(tmp_path, names=("mlflow",)), is_main=False)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert isinstance(open_trackers(TrackerRun(tmp_path, names=("mlflow", "wandb")), is_main=False), NullLogger)
    assert isinstance(open_trackers(TrackerRun(tmp_path, names=()), is_main=True), NullLogger)
    assert not list(tmp_path.iterdir())
    # Importing the trackers imports none of the trackers' packages (nor torch).
    code = ("import sys, utils.trackers; "
            "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_in_a_resumed_folder_shows_every_epoch_once(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    import cv2

    first = open_trackers(TrackerRun(tmp_path), is_main=True)
    for epoch in range(3):
        write_rows(tmp_path / "results.csv", [epoch])
        first.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
    first.log_pr_curve(np.linspace(1, 0, 101), np.linspace(0, 1, 101), 2)
    first.close()
    truncate_results(tmp_path / "results.csv", keep_below_epoch=2)  # resumed from epoch 1's checkpoint
    cv2.imwrite(str(tmp_path / "confusion_matrix.png"), np.full((24, 32, 3), 200, np.uint8))
    second = open_trackers(TrackerRun(tmp_path, resumed=True), is_main=True)
    for epoch in (2, 3):
        write_rows(tmp_path / "results.csv", [epoch])
        second.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
    second.log_images([tmp_path / "confusion_matrix.png"], 3)
    second.close()
    acc = _events(tmp_path)
    for i, tag in enumerate(COLUMNS[1:]):
        scalars = acc.Scalars(tag)
        assert [e.step for e in scalars] == [0, 1, 2, 3], tag
        np.testing.assert_allclose([e.value for e in scalars], [values_of(e)[i] for e in range(4)], rtol=1e-6)
    assert acc.Tags()["images"] == ["plots/confusion_matrix"]
    assert [e.step for e in acc.Tensors("val/PR_curve")] == [2]


# ---- MLflow (a real server), W&B (offline) and TensorBoard together, across kills ---------------------------

def session_members(session_id: int) -> list[str]:
    """The processes of a session (the server's, started in a session of its own): 'pid command' each."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after 'pid (comm)': state ppid pgrp session ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(f"{stat.parent.name} {text[text.index('(') + 1:text.rindex(')')]}")
    return found


class MLflowServer:
    """``mlflow server`` on a free loopback port, in a session of its own (stopped with everything it started)."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job consumers outliving it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mlflow server ended: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self.uri
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"mlflow server not up after {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill``) to the server's process group; waits until its session is empty."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        deadline = time.monotonic() + 10
        while session_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow")
    server = MLflowServer(tmp_path_factory.mktemp("mlflow_server"))
    yield server
    server.stop()
    left = session_members(server.process.pid)
    assert not left, f"the MLflow server left processes behind: {left}"


BATCHES = 4
MID_EPOCH_SAVE = (4, 2)  # a checkpoint inside epoch 4, after its batch 2


def fake_training(run_dir: Path, epochs: int, kill: tuple | None) -> int:
    """Training's record and tracker calls, in the engine's order, with a checkpoint kept as JSON; SIGKILLs
    itself at ``kill``: ("checkpoint lost", epoch) after the tracker got the epoch but before the epoch's
    checkpoint was on disk; ("mid-epoch", epoch, batch) inside an epoch, after a mid-epoch checkpoint."""
    from utils.trackers import plot_files

    last = run_dir / "weights/last.json"
    ckpt = json.loads(last.read_text()) if last.exists() else None
    start, start_batch = (0, 0) if ckpt is None else \
        (ckpt["mid"][0], ckpt["mid"][1]) if ckpt["mid"] else (ckpt["epoch"] + 1, 0)
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    truncate_results(run_dir / "results.csv", keep_below_epoch=start + (start_batch > 0))  # as RunRecord does
    logger = open_trackers(TrackerRun(run_dir, names=("tensorboard", "mlflow", "wandb"), experiment="fake",
                                      resumed=ckpt is not None, saved=ckpt and ckpt["trackers"]), is_main=True)
    logger.log_params(run_params({"epochs": epochs, "data": Path("fake.yaml")}, {"lr0": 0.01}))

    def save(epoch: int, mid: tuple | None) -> None:
        last.write_text(json.dumps({"epoch": epoch, "mid": mid, "trackers": logger.state()}))

    for epoch in range(start, epochs):
        for batch in range(start_batch if epoch == start else 0, BATCHES):
            time.sleep(0.05)  # a training step
            if (epoch, batch) == MID_EPOCH_SAVE:
                save(epoch - 1, (epoch, batch + 1))
            if kill == ("mid-epoch", epoch, batch):
                os.kill(os.getpid(), signal.SIGKILL)
        write_rows(run_dir / "results.csv", [epoch])
        values = dict(zip(COLUMNS[1:], values_of(epoch)))
        if kill == ("checkpoint lost", epoch):
            logger.log_epoch(epoch, values)
            logger.flush(60)
            os.kill(os.getpid(), signal.SIGKILL)
        save(epoch, None)
        logger.log_epoch(epoch, values)
    for name in ("best.pt", "last.pt"):
        (run_dir / "weights" / name).write_bytes(os.urandom(64))
    import cv2

    cv2.imwrite(str(run_dir / "PR_curve.png"), np.full((24, 32, 3), 90, np.uint8))
    logger.log_images(plot_files(run_dir), epochs - 1)
    logger.log_artifacts([run_dir / "weights/best.pt", run_dir / "weights/last.pt", run_dir / "results.csv"])
    logger.close()
    return 0


def run_killable(target, *args) -> tuple[int, int]:
    """``target(*args)`` in a forked process; its exit code (-9 when it SIGKILLed itself) and its pid."""
    process = multiprocessing.get_context("fork").Process(target=lambda: os._exit(target(*args)))
    process.start()
    process.join(180)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise AssertionError("the training stand-in hung")
    return process.exitcode, process.pid


def check_mlflow_run(uri: str, run_id: str) -> None:
    """The experiment holds one run, ``run_id``: finished, every epoch once with results.csv's values, the
    parameters, the weights, results.csv and the plots."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("fake").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one MLflow run for the whole training
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "6" and run.data.params["hyp/lr0"] == "0.01"
    for i, key in enumerate(COLUMNS[1:]):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(6)), key  # every epoch, once
        np.testing.assert_allclose([m.value for m in history], [values_of(e)[i] for e in range(6)], rtol=1e-6)
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    artifacts |= {a.path for folder in ("weights", "plots") for a in client.list_artifacts(run_id, folder)}
    assert {"results.csv", "weights/best.pt", "weights/last.pt", "plots/PR_curve.png"} <= artifacts


def check_wandb_files(run_dir: Path, run_id: str) -> None:
    """Every offline folder of the training carries ``run_id``; together they hold every epoch once and the
    weights and results.csv."""
    from utils.trackers.wandb_records import read_run

    held = read_run(run_dir, run_id)
    # One folder per process that got as far as starting W&B (the first one did: it waited for its trackers
    # before it was killed; the second may have been killed before W&B started).
    assert 2 <= len(held.folders) <= 3
    assert all(f.name.endswith(f"-{run_id}") for f in held.folders)
    assert held.run_ids == {run_id}
    counts = Counter((key, int(row["epoch"])) for row in held.history if "epoch" in row
                     for key in row if key in COLUMNS[1:])
    assert counts == Counter({(key, e): 1 for key in COLUMNS[1:] for e in range(6)})  # every epoch, once
    assert {"results.csv", "weights/best.pt", "weights/last.pt"} <= held.files


def run_through_a_stopped_server(server: MLflowServer, run_dir: Path) -> tuple[float, list[str]]:
    """Epochs logged to MLflow, the server killed after three; the slowest call after it, and the warnings."""
    from mlflow import MlflowClient

    with Lines() as log:
        logger = open_trackers(TrackerRun(run_dir, names=("mlflow",), experiment="stopped"), is_main=True)
        for epoch in range(3):
            logger.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
        assert logger.flush(60)
        history = MlflowClient(server.uri).get_metric_history(logger.state()["mlflow"]["run_id"], COLUMNS[1])
        assert sorted(m.step for m in history) == [0, 1, 2]
        server.stop(kill=True)  # gone at once, as a crashed server or a lost network is
        slowest = 0.0
        for epoch in range(3, 10):
            time.sleep(0.02)  # a training epoch
            start = time.perf_counter()
            logger.log_epoch(epoch, dict(zip(COLUMNS[1:], values_of(epoch))))
            slowest = max(slowest, time.perf_counter() - start)
        assert logger.flush(60)  # the tracker gave up (its retries spent); training never waited for it
        logger.close()
    return slowest, [line for line in log.lines if line.startswith("WARNING")]


def wandb_services_of(pids) -> list[str]:
    """W&B's service processes still running for these training processes (they end when theirs is gone)."""
    services = [f"--pid {p}" for p in pids]
    deadline = time.monotonic() + 10
    while (left := [a for a in os.popen("ps -eo args").read().splitlines()
                    if "wandb-core" in a and any(a.endswith(s) for s in services)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_one_tracker_run_holds_every_epoch_once_across_kills_and_a_stopped_server_slows_nothing(
        mlflow_server, tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    import mlflow  # noqa: F401  (imported here once: the forked trainings start without importing it)
    import wandb  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    for key, value in {"MLFLOW_TRACKING_URI": mlflow_server.uri, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config")}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "runs/exp"
    mlflow_server.wait_ready()

    # Killed once after the tracker got epoch 2 but before epoch 2's checkpoint was written (a launcher kill),
    # once inside epoch 4; the run folder then loses trackers.yaml (the checkpoint still has the ids).
    codes, pids = zip(run_killable(fake_training, run_dir, 6, ("checkpoint lost", 2)),
                      run_killable(fake_training, run_dir, 6, ("mid-epoch", 4, 3)))
    assert codes == (-signal.SIGKILL, -signal.SIGKILL)
    ids = read_ids(run_dir)
    (run_dir / "trackers.yaml").unlink()
    code, pid = run_killable(fake_training, run_dir, 6, None)
    assert code == 0
    now = read_ids(run_dir)  # the same tracker runs, found again from the checkpoint
    assert [now[k]["run_id"] for k in ("mlflow", "wandb")] == [ids[k]["run_id"] for k in ("mlflow", "wandb")]
    rows = (run_dir / "results.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(6))
    check_mlflow_run(mlflow_server.uri, ids["mlflow"]["run_id"])
    check_wandb_files(run_dir, ids["wandb"]["run_id"])
    assert [e.step for e in _events(run_dir).Scalars("metrics/mAP_0.5")] == list(range(6))
    assert not wandb_services_of((*pids, pid))

    # The server stops in the middle of a run: training goes on at its pace, with one warning.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a synchronous client would wait >= 2 s a call
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    slowest, warnings = run_through_a_stopped_server(mlflow_server, tmp_path / "runs/stopped")
    assert slowest < 0.5, slowest
    assert len(warnings) == 1 and warnings[0].startswith("WARNING MLflow stopped for the rest of this run ("), \
        warnings
