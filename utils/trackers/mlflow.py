"""MLflow: one MLflow run per training run, continued across resumes and restarts.

The tracking URI is ``MLFLOW_TRACKING_URI`` when set (a tracking server, ``http://host:5000``, or any store
MLflow reads), otherwise a local SQLite store beside the run folders, ``<project>/mlruns/mlflow.db``, with the
artifacts in ``<project>/mlruns/artifacts`` (``mlflow ui --backend-store-uri sqlite:///<project>/mlruns/mlflow.db``).
The experiment is ``MLFLOW_EXPERIMENT_NAME`` when set, otherwise the project folder's name. Metrics are logged
under results.csv's column names with the epoch as their step; weights go under ``weights/``, plots under
``plots/``. The MLflow client's own settings (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._TIMEOUT``, tokens)
apply as MLflow documents them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from utils.log import LOGGER
from utils.trackers.base import FAILED, KILLED, Tracker, TrackerRun

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter's value
BATCH_PARAMS = 100  # MLflow's limit on parameters per log_batch call
STATUS = {"finished": "FINISHED", FAILED: "FAILED", KILLED: "KILLED"}


def local_store(run_dir: Path) -> tuple[str, str]:
    """The tracking URI and artifact location of the local store beside the run folders."""
    root = Path(run_dir).resolve().parent / "mlruns"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


class MLflowTracker(Tracker):
    name, title, package = "mlflow", "MLflow", "mlflow"

    def __init__(self) -> None:
        self.client: Any = None  # an MlflowClient once open() ran: mlflow is imported there
        self.run_id = ""
        self.params: dict[str, str] = {}  # those the run holds: MLflow refuses to change a parameter's value
        self._held: dict[str, set[int]] = {}

    def open(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        from mlflow import MlflowClient

        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI") or "", None
        if not uri:
            uri, artifacts = local_store(run.run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._continue(saved, uri) or self._start(run, artifacts)
        return {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri}

    def _continue(self, saved: Mapping[str, str] | None, uri: str) -> str | None:
        """The experiment id of the saved run when it exists at ``uri`` (now RUNNING again); None otherwise."""
        if not saved or not saved.get("run_id"):
            return None
        if saved.get("tracking_uri") != uri:
            LOGGER.info(
                f"MLflow: the run was tracked at {saved.get('tracking_uri')}, now at {uri}: a new MLflow "
                f"run, filled from results.csv"
            )
            return None
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(saved["run_id"])
        except MlflowException as e:
            if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise
            LOGGER.info(f"MLflow: run {saved['run_id']} is not at {uri}: a new MLflow run, filled from results.csv")
            return None
        self.run_id = found.info.run_id
        self.params = dict(found.data.params)
        self._held = {
            key: {m.step for m in self.client.get_metric_history(self.run_id, key)} for key in found.data.metrics
        }
        self.client.update_run(self.run_id, status="RUNNING")
        LOGGER.info(f"MLflow: continuing run {self.run_id} at {uri}")
        return found.info.experiment_id

    def _start(self, run: TrackerRun, artifacts: str | None) -> str:
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.experiment_name
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
            except MlflowException:  # another run created it meanwhile
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        created = self.client.create_run(
            experiment_id, run_name=run.name, tags={"yolo.run_dir": str(Path(run.run_dir).resolve())}
        )
        self.run_id = created.info.run_id
        LOGGER.info(f"MLflow: run {self.run_id} in experiment '{name}' at {self.client.tracking_uri}")
        return experiment_id

    def held(self) -> dict[str, set[int]]:
        return self._held

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        new = {k: str(v)[:MAX_PARAM_LENGTH] for k, v in params.items() if k not in self.params}
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH_PARAMS], synchronous=True)
        self.params.update(new)

    def log_metrics(self, epoch: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, epoch) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "weights" if Path(path).suffix == ".pt" else None)

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, STATUS.get(status, "FINISHED"))

    def abandon(self) -> None:
        pass  # the server that just failed would only retry for minutes; a resume marks the run RUNNING again
