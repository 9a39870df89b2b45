"""Weights & Biases: one W&B run per training run, under one run id across resumes and restarts.

W&B reads its own environment (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``,
``WANDB_API_KEY``, ...); the project defaults to the project folder's name and the files to the run folder
(``<run>/wandb/``). The run id is drawn once, written to trackers.yaml and the checkpoint, and given to every
process that continues the run: online, W&B resumes that run; offline, W&B ignores resuming and writes one
folder per process, and the shared id is what makes ``wandb sync`` upload them as one run. Which epochs the run
holds is read from those folders' records (``wandb_records.py``), so an epoch is logged once across them.
Rows carry their epoch under ``epoch`` (the charts' x axis) and a step that grows across processes.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from utils.log import LOGGER
from utils.trackers.base import FAILED, KILLED, Tracker, TrackerRun
from utils.trackers.wandb_records import read_run

EXIT_CODES = {"finished": 0, FAILED: 1, KILLED: 1}


def new_run_id() -> str:
    """Eight lowercase letters and digits, W&B's own form of a run id."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbTracker(Tracker):
    name, title, package = "wandb", "W&B", "wandb"

    def __init__(self) -> None:
        self.run: Any = None  # wandb's Run once open() ran: wandb is imported there
        self.step = 0  # the next row's; rows of earlier processes of the run came before
        self.run_id = ""
        self._held: dict[str, set[int]] = {}

    def planned_ids(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        self.run_id = (saved or {}).get("run_id") or os.environ.get("WANDB_RUN_ID") or new_run_id()
        return {"run_id": self.run_id}

    def open(self, run: TrackerRun, saved: Mapping[str, str] | None) -> dict[str, str]:
        import wandb

        files_dir = Path(os.environ.get("WANDB_DIR") or run.run_dir)
        run_id = self.run_id or self.planned_ids(run, saved)["run_id"]
        earlier = read_run(files_dir, run_id)
        self._held, self.step = earlier.epochs(), earlier.last_step() + 1
        offline = wandb.setup().settings.mode in ("offline", "dryrun")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or run.experiment_name,
            name=run.name,
            id=run_id,
            dir=str(files_dir),
            resume=None if offline else "allow",
        )
        self.step = max(self.step, int(self.run.step or 0))  # online, the server knows the run's last step
        self.run.define_metric("epoch")
        self.run.define_metric("*", step_metric="epoch")
        where = "offline, `wandb sync` uploads it" if offline else "online"
        LOGGER.info(f"W&B: run {run_id} ({where}) in {files_dir / 'wandb'}")
        return {"run_id": run_id, "project": self.run.project or ""}

    def held(self) -> dict[str, set[int]]:
        return self._held

    def _log(self, row: dict[str, Any]) -> None:
        self.run.log(row, step=self.step)
        self.step += 1

    def log_params(self, params: Mapping[str, Any]) -> None:
        plain = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in params.items()}
        self.run.config.update(plain, allow_val_change=True)

    def log_metrics(self, epoch: int, values: Mapping[str, float]) -> None:
        self._log({"epoch": epoch, **values})

    def log_images(self, paths: Sequence[Path], step: int) -> None:
        import wandb

        if paths:
            self._log({"epoch": step, **{f"plots/{Path(p).stem}": wandb.Image(str(p)) for p in paths}})

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        # Saved as the run's files (linked from the run folder, uploaded by W&B, or by `wandb sync` offline);
        # W&B's artifact store would copy the weights outside the run folder first.
        for path in paths:
            path = Path(path).resolve()
            base = path.parent.parent if path.parent.name == "weights" else path.parent
            self.run.save(str(path), base_path=str(base), policy="now")

    def close(self, status: str) -> None:
        if self.run is not None:
            import wandb

            self.run.finish(exit_code=EXIT_CODES.get(status, 0))
            self.run = None
            wandb.teardown()  # ends W&B's service process now rather than when this process exits
