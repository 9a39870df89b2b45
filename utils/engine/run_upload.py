"""A run folder on object storage (``--project s3://bucket/runs``): the run works in a local staging folder, and
every file it writes there is uploaded to the run's URL through the storage seam (utils/storage.py).

Checkpoints are uploaded by the checkpoint writer's thread as each one is complete (``RunRecord``), so that run.json
names the newest checkpoint complete in the bucket; the other files (results.csv, plots, TensorBoard events, the
trackers' local files, opt.yaml, hyp.yaml) by this module's thread, after every epoch and at the end; run.json by
the record whenever it changes and as a heartbeat. No upload runs on the training thread during the epochs. A failed
upload is tried again with backoff and reported in one line; training goes on either way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from utils.checkpoint import RUN_STATE
from utils.distributed import DistInfo
from utils.errors import UserError
from utils.log import LOGGER
from utils.storage import Storage, join, open_storage

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # a failed upload is tried again after these; then the next one tries
CHECKPOINTS = "weights/"  # uploaded by the checkpoint writer's thread
Stamp = tuple[int, int]  # a local file's modification time (ns) and size: changed, it is uploaded again


def staging_folder(name: str) -> Path:
    """A new local folder for a run whose folder is a URL (removed at the end: ``remove_staging``)."""
    return Path(tempfile.mkdtemp(prefix=f"yolo-run-{name}-"))


def remove_staging(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _stamp(path: Path) -> Stamp:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


class RunUpload:
    """Uploads the files of the local folder ``local`` to ``storage`` (the run's URL), each whole.

    ``upload`` sends one file now (retried); ``start`` runs a thread that sends every changed file when ``request``
    wakes it and calls ``beat`` (the record's heartbeat) at least every ``heartbeat_s`` seconds; ``close`` ends it
    with a last pass over every file.
    """

    def __init__(
        self,
        storage: Storage,
        local: Path,
        heartbeat_s: float = 60.0,
        retry_delays: Sequence[float] = RETRY_DELAYS_S,
    ) -> None:
        self.storage, self.local = storage, local
        self.heartbeat_s, self.retry_delays = heartbeat_s, tuple(retry_delays)
        self.beat: Callable[[], None] | None = None
        self._sent: dict[str, Stamp] = {}  # what the storage holds of each file
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def mark_sent(self, relatives: Sequence[str]) -> None:
        """These local files are what the storage holds (downloaded from it): not uploaded until they change."""
        with self._lock:
            for relative in relatives:
                path = self.local / relative
                if path.is_file():
                    self._sent[relative] = _stamp(path)

    def upload(self, relative: str, retry: bool = True) -> bool:
        """The local file ``relative`` to the storage, tried again after each of ``retry_delays``; True once sent.
        One warning line when it failed (whether a later try succeeded or not); never raises for the storage."""
        path = self.local / relative
        errors: list[str] = []
        for delay in (*(self.retry_delays if retry else ()), None):
            try:
                stamp = _stamp(path)
                self.storage.upload(path, relative)
            except (UserError, OSError) as e:
                errors.append(str(e))
                if delay is None:
                    break
                time.sleep(delay)
                continue
            with self._lock:
                self._sent[relative] = stamp
            if errors:
                LOGGER.warning(
                    f"WARNING {self.storage.full(relative)}: uploaded on try {len(errors) + 1} ({len(errors)} "
                    f"failed, the last: {errors[-1]})"
                )
            return True
        LOGGER.warning(
            f"WARNING {self.storage.full(relative)}: not uploaded after {len(errors)} tries ({errors[-1]}); "
            "training goes on and the next upload tries again"
        )
        return False

    def changed(self, with_checkpoints: bool) -> list[str]:
        """The local files not yet sent as they are now (run.json is the record's; checkpoints the writer's)."""
        found = []
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            relative = path.relative_to(self.local).as_posix()
            if relative == RUN_STATE or (relative.startswith(CHECKPOINTS) and not with_checkpoints):
                continue
            if os.path.basename(relative).startswith("."):  # a file being written beside its target
                continue
            with self._lock:
                sent = self._sent.get(relative)
            try:
                if sent != _stamp(path):
                    found.append(relative)
            except FileNotFoundError:  # removed meanwhile
                continue
        return found

    def sync(self, with_checkpoints: bool = False, retry: bool = True) -> bool:
        """Every changed file sent; True when all were."""
        sent = [self.upload(relative, retry) for relative in self.changed(with_checkpoints)]  # every one tried
        return all(sent)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="run-upload", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Send the changed files soon (the thread's next pass); returns at once."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._stopping:
                return
            self.sync()
            if self.beat is not None:
                self.beat()

    def close(self, finished: bool) -> bool:
        """End the thread and send every changed file, checkpoints included (best.pt stripped at the end); a run
        that did not finish tries each file once. True when everything is sent."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        return self.sync(with_checkpoints=True, retry=finished)


# ---- finding runs in a project at a URL -----------------------------------------------------------------------


def _run_states(storage: Storage) -> list[tuple[str, dict]]:
    """Each run folder's name and its run.json, for the folders under ``storage`` that hold a readable one."""
    found = []
    for name in storage.listdir():
        try:
            state = json.loads(storage.read_bytes(f"{name}/{RUN_STATE}"))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            continue
        if isinstance(state, dict):
            found.append((name, state))
    return found


def newest_interrupted_run(project: str, stale_after_s: float) -> str:
    """The URL of the newest complete checkpoint of the newest interrupted run under the URL ``project``: its record
    not finished and its heartbeat older than ``stale_after_s`` (a run still alive elsewhere is never taken)."""
    now = time.time()
    interrupted: list[tuple[float, str, str]] = []
    alive: list[tuple[float, str, str]] = []
    for name, state in _run_states(open_storage(project)):
        newest = state.get("newest_checkpoint")
        if state.get("status") == "finished" or not isinstance(newest, str):
            continue
        try:
            updated = float(state.get("updated", 0.0))
        except (TypeError, ValueError):
            updated = 0.0
        (alive if now - updated < stale_after_s else interrupted).append((updated, name, newest))
    if interrupted:
        _, name, newest = max(interrupted)
        return join(project, name, newest)
    if alive:
        names = ", ".join(f"{name} ({now - updated:.0f} s ago)" for updated, name, _ in sorted(alive))
        raise UserError(
            f"{project}: no interrupted run to resume: the records of {names} were updated less than twice "
            f"--dist-timeout ago (alive elsewhere?); resume one by its URL/weights/last.pt once it has stopped"
        )
    raise UserError(f"{project}: no interrupted run to resume (train first, or pass --resume URL/weights/last.pt)")


def job_run_folder(project: str, info: DistInfo) -> str | None:
    """The URL of the run folder under ``project`` that this launcher job made (a launcher restart continues it):
    the newest marked with its run id since its launcher started."""
    if not info.run_id:
        return None
    storage, mine = open_storage(project), []
    for name in storage.listdir():
        try:
            marked = storage.read_bytes(f"{name}/run_id").decode("utf-8", "replace").strip() == info.run_id
        except (FileNotFoundError, NotADirectoryError):
            continue
        when = storage.modified(f"{name}/run_id") if marked else None
        if when is not None and (info.launcher_started is None or when >= int(info.launcher_started)):
            mine.append((when, name))
    return join(project, max(mine)[1]) if mine else None
