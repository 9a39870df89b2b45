"""Helpers of the benches that run Ultralytics' trainer beside ours (recipe_vs_ultralytics.py, speed_vs_ultralytics.py).

Ultralytics' trainer runs as its own program: the ``yolo`` command installed beside the Python given with
--ultralytics-python (its own virtual environment), as ``yolo detect train key=value ...``, offline (YOLO_OFFLINE=1).
Both trainers' final validation tables are read from their logs the same way. Each whole process is run
under GNU time, which reports its wall time and its peak resident set size (the largest of the process and its
waited-for children, as GNU time measures it). Where GNU time is not installed (some GPU images), a Python parent
reads the same figure from the kernel (``getrusage(RUSAGE_CHILDREN)``, the call GNU time makes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GNU_TIME = "/usr/bin/time"
# GNU time's "%M %e" for a machine without it: the child's peak RSS in KiB (wait4's rusage) and its wall seconds.
_PYTHON_TIME = (
    "import resource, subprocess, sys, time; t = time.perf_counter(); subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(f'{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss} "
    "{time.perf_counter() - t:.2f}')"
)

# The summary row of a validation table (ours and Ultralytics' alike): all, images, instances, P, R, mAP50, mAP50-95.
_NUMBER = r"([\d.]+(?:e[+-]?\d+)?)"
_ALL_ROW = re.compile(rf"(?:^|\r)[ \t]*all\s+(\d+)\s+(\d+)\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s*$", re.M)


@dataclass
class Measured:
    wall_s: float
    peak_rss_mib: float
    exit_code: int
    log: Path


def run_timed(cmd: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> Measured:
    """Run ``cmd`` under GNU time; stdout and stderr go to ``log``."""
    stats = Path(tempfile.mkstemp(prefix="gnu_time_", suffix=".txt")[1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        t0 = time.perf_counter()
        timer = (
            [GNU_TIME, "-f", "%M %e", "-o", str(stats)]
            if os.access(GNU_TIME, os.X_OK)
            else [sys.executable, "-c", _PYTHON_TIME, str(stats)]
        )
        code = subprocess.call([*timer, *cmd], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        wall = time.perf_counter() - t0
    fields = stats.read_text().split()
    stats.unlink()
    peak_kib = float(fields[-2]) if len(fields) >= 2 else float("nan")
    return Measured(wall, peak_kib / 1024, code, log)


def absolute_data_yaml(data_yaml: Path, out: Path) -> Path:
    """A copy of ``data_yaml`` whose ``path`` is absolute (Ultralytics resolves relative ones elsewhere)."""
    data = yaml.safe_load(data_yaml.read_text())
    data["path"] = str((data_yaml.parent / data.get("path", "")).resolve())
    data.pop("builtin", None)
    copy = out / f"{data_yaml.stem}_absolute.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def ultralytics_train_cmd(python: str, **kwargs) -> list[str]:
    """Ultralytics' own command line (the ``yolo`` program beside ``python``) with ``key=value`` arguments."""
    return [str(Path(python).parent / "yolo"), "detect", "train", *(f"{k}={v}" for k, v in kwargs.items())]


# Ultralytics' integrations that log a training run when their package is installed (MLflow is on by default, and our
# test requirements install it): switched off, so that its trainer is timed alone, as ours is without --loggers.
_INTEGRATIONS_OFF = (
    "clearml=False",
    "comet=False",
    "dvc=False",
    "mlflow=False",
    "neptune=False",
    "raytune=False",
    "tensorboard=False",
    "wandb=False",
)


def ultralytics_env(out: Path, python: str) -> dict[str, str]:
    """Offline, with its settings in ``out`` (not the user's home), its tracker integrations off."""
    env = {"YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(out / "ultralytics_config")}
    subprocess.run(
        [str(Path(python).parent / "yolo"), "settings", *_INTEGRATIONS_OFF],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )
    return env


def final_map(log: Path) -> float:
    """mAP50-95 of a trainer's last validation table (the final one: the best weights); both trainers print
    the same 'all' row."""
    rows = _ALL_ROW.findall(log.read_text(errors="replace"))
    return float(rows[-1][5]) if rows else float("nan")
