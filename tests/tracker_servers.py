"""A real MLflow tracking server on loopback and W&B's offline records, for the tests that train with trackers.

The server starts in the background (``MLflowServer(...)``) while the test does its first work, and is waited
for when needed (``wait_ready``). Its SQLite store starts as a copy of an empty store already migrated to this
MLflow version, kept in pytest's cache: a new store's migrations take about as long again as the server's start.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
from conftest import free_port


def session_members(session_id: int) -> list[str]:
    """The processes of a session (the server's, started in a session of its own): 'pid command' each."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after 'pid (comm)': state ppid pgrp session ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(f"{stat.parent.name} {text[text.index('(') + 1 : text.rindex(')')]}")
    return found


class MLflowServer:
    """``mlflow server`` on a free loopback port, in a session of its own (stopped with everything it started).

    ``template``: where an empty, migrated store of this MLflow version is kept between test sessions."""

    def __init__(self, root: Path, template: Path | None = None):
        import importlib.metadata

        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        self.store = root / "mlflow.db"
        self.template = template and template / f"mlflow-{importlib.metadata.version('mlflow')}.db"
        self.from_template = bool(self.template and self.template.is_file())
        if self.from_template:
            shutil.copyfile(self.template, self.store)
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job consumers outliving it
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.store}",
                "--artifacts-destination",
                str(root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mlflow server ended: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        self._keep_template()
                        return self.uri
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"mlflow server not up after {timeout} s: {self.log.read_text()[-2000:]}")

    def _keep_template(self) -> None:
        """The migrated, still empty store, for the next session (SQLite's backup: a consistent copy)."""
        if self.template is None or self.from_template:
            return
        self.template.parent.mkdir(parents=True, exist_ok=True)
        partial = self.template.with_suffix(".partial")
        with sqlite3.connect(self.store) as source, sqlite3.connect(partial) as copy:
            source.backup(copy)
        partial.replace(self.template)

    def stop(self, kill: bool = False) -> list[str]:
        """SIGTERM (SIGKILL with ``kill``) to the server's process group; waits until its session is empty and
        returns what is left of it."""
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
        return session_members(self.process.pid)


def tracker_environment(tmp: Path, mlflow_uri: str) -> dict[str, str]:
    """MLflow at the server, W&B offline with its own folders under ``tmp`` (nothing in the home folder)."""
    return {
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb_data"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb_config"),
    }


def results_by_epoch(csv_file: Path) -> dict[int, dict[str, float]]:
    from utils.trackers import read_results

    return read_results(csv_file)


def check_mlflow_run(
    uri: str, experiment: str, run_id: str, csv_file: Path, params: dict[str, str], artifacts: set[str]
) -> None:
    """The experiment holds one run, ``run_id``: finished, every results.csv column at every epoch once (with its
    values, but for the time columns: an epoch trained again after a kill keeps its first timing), ``params``
    among its parameters, ``artifacts`` among its files."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one MLflow run for the whole training
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert params.items() <= run.data.params.items()
    rows = results_by_epoch(csv_file)
    for key in rows[0]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == sorted(rows), key  # every epoch, once
        if not key.startswith("time/"):
            np.testing.assert_allclose(
                [m.value for m in history], [rows[e][key] for e in sorted(rows)], rtol=1e-4, atol=1e-9, err_msg=key
            )
    found = {a.path for a in client.list_artifacts(run_id)}
    found |= {a.path for folder in ("weights", "plots") for a in client.list_artifacts(run_id, folder)}
    assert artifacts <= found, found


def check_wandb_files(run_dir: Path, run_id: str, csv_file: Path, processes: tuple[int, int]) -> None:
    """Every offline folder of the training carries ``run_id`` (between ``processes`` of them: one per process
    that got as far as starting W&B); together they hold every epoch once, the weights and results.csv."""
    from utils.trackers.wandb_records import read_run

    held = read_run(run_dir, run_id)
    assert processes[0] <= len(held.folders) <= processes[1], held.folders
    assert all(f.name.endswith(f"-{run_id}") for f in held.folders)
    assert held.run_ids == {run_id}
    rows = results_by_epoch(csv_file)
    columns = set(rows[0])
    counts = Counter(
        (key, int(row["epoch"])) for row in held.history if "epoch" in row for key in row if key in columns
    )
    assert counts == Counter({(key, e): 1 for key in columns for e in rows})  # every epoch, once
    assert {"results.csv", "weights/best.pt", "weights/last.pt"} <= held.files


def wandb_services() -> dict[int, int]:
    """W&B's service processes (wandb-core) running now: their pid -> the pid of the process they serve."""
    found = {}
    for line in os.popen("ps -eo pid,args").read().splitlines():
        parts = line.split()
        if len(parts) > 2 and "wandb-core" in parts[1] and "--pid" in parts:
            found[int(parts[0])] = int(parts[parts.index("--pid") + 1])
    return found


def orphaned_wandb_services(before: dict[int, int], timeout: float = 10) -> list[int]:
    """Services started since ``before`` whose process is gone (each should end with its process)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [
            pid
            for pid, parent in wandb_services().items()
            if pid not in before and not Path(f"/proc/{parent}").exists()
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def run_through_a_stopped_server(server: MLflowServer, run_dir: Path) -> tuple[float, list[str]]:
    """Epochs logged to MLflow, the server killed after three; the slowest call after it, and the warnings."""
    import logging

    from mlflow import MlflowClient

    from utils.log import LOGGER
    from utils.results_log import result_columns
    from utils.trackers import TrackerRun, open_trackers

    columns = result_columns(("box", "obj", "cls"))[1:]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOGGER.addHandler(handler)
    try:
        logger = open_trackers(TrackerRun(run_dir, names=("mlflow",), experiment="stopped"), is_main=True)
        for epoch in range(3):
            logger.log_epoch(epoch, dict.fromkeys(columns, 0.1 * epoch))
        assert logger.flush(60)
        history = MlflowClient(server.uri).get_metric_history(logger.state()["mlflow"]["run_id"], columns[0])
        assert sorted(m.step for m in history) == [0, 1, 2]
        server.stop(kill=True)  # gone at once, as a crashed server or a lost network is
        slowest = 0.0
        for epoch in range(3, 10):
            time.sleep(0.02)  # a training epoch
            start = time.perf_counter()
            logger.log_epoch(epoch, dict.fromkeys(columns, 0.1 * epoch))
            slowest = max(slowest, time.perf_counter() - start)
        assert logger.flush(60)  # the tracker gave up (its retries spent); training never waited for it
        logger.close()
    finally:
        LOGGER.removeHandler(handler)
    return slowest, [line for line in lines if line.startswith("WARNING")]
