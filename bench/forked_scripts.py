"""The repository's scripts run in forks of one process that has imported them once, for a dry run at toy sizes.

A toy run's seconds go mostly to starting interpreters and importing torch and the project, once per command: a
dry run of bench/gpu_report.py starts a dozen. ``Forker`` imports the scripts' modules once, then runs each command
(``python train.py ...``, ``python val.py ...``, ``python -m pytest ...``, ``python bench/X.py ...``) in a fork
of itself: a process of its own (its own exit status, output, kill), the same ``main(argv)`` the script's
``__main__`` calls, without the start-up. A command of another program goes to ``subprocess.Popen`` as usual.

Only where nothing has initialised CUDA (a fork keeps no working CUDA context): the dry run on the CPU. The real
run starts fresh interpreters, as a user does.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from utils.log import LOGGER

ROOT = Path(__file__).resolve().parents[1]

# script (relative to the repository's root, or "-m module") -> the module whose main(argv) the script runs
SCRIPTS = {
    "train.py": "train",
    "val.py": "val",
    "bench/gpu_report.py": "bench.gpu_report",
    "bench/cudnn_benchmark.py": "bench.cudnn_benchmark",
    "-m pytest": "pytest",
}


def script_of(cmd: list[str]) -> str | None:
    """The SCRIPTS key ``cmd`` runs with this Python, or None."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] == "-m" and len(cmd) > 2:
        key = f"-m {cmd[2]}"
    else:
        path = Path(cmd[1])
        key = str(path.resolve().relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else cmd[1]
    return key if key in SCRIPTS else None


class ForkedRun:
    """One command run as ``main(argv)`` in a fork; the part of ``subprocess.Popen``'s interface the bench uses."""

    def __init__(
        self,
        script: ModuleType,
        argv: list[str],
        cwd: Path,
        env: dict[str, str] | None,
        out: Any,
        threads: int | None = None,
    ):
        read_end = None
        if out is subprocess.PIPE:
            read_end, write_fd = os.pipe()
        else:
            write_fd = out.fileno()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered before the fork is written twice
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            _run_as_script(script, argv, cwd, env, threads)
        if read_end is not None:
            os.close(write_fd)
        self.stdout: IO[bytes] | None = os.fdopen(read_end, "rb") if read_end is not None else None
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None:
                return self._wait_until(timeout)
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _wait_until(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                return self.returncode
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["fork", str(self.pid)], timeout)
            time.sleep(0.02)

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _run_as_script(
    script: ModuleType, argv: list[str], cwd: Path, env: dict[str, str] | None, threads: int | None
) -> None:
    """In the child: the script's ``main(argv)`` with its output on fds 1 and 2, then exit with its status."""
    code = 1
    if hasattr(script, "PROCESS_STARTED"):  # train.py's clock starts at the process's start: this fork's
        script.PROCESS_STARTED = time.monotonic()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        sys.argv = argv
        for stream in (sys.stdout, sys.stderr):  # line by line, as PYTHONUNBUFFERED gives a fresh interpreter
            stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]  # a TextIOWrapper here
        result = script.main(argv[1:])
        code = int(result) if result is not None else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


class Forker:
    """Starts commands: the repository's scripts as forks of this process (their modules imported once, here),
    anything else as a subprocess. ``threads``: torch's intra-op threads in each fork (toy tensors gain nothing
    from more, and on a busy machine threads that wait for each other's cores cost the most)."""

    def __init__(self, threads: int | None = None, preload: tuple[str, ...] = ()) -> None:
        self.threads = threads
        self.scripts = {key: importlib.import_module(module) for key, module in SCRIPTS.items()}
        for module in preload:  # what the scripts import only on some paths (torch.compile's, pytest's plugins)
            try:
                importlib.import_module(module)
            except ImportError as e:  # the script that needs it says so, in its own output
                LOGGER.debug(f"not preloaded: {module} ({e})")
        # Every object alive now out of the garbage collector's reach, as each script's setup_process does for
        # itself (utils/process.py): done once here, each fork's own full collection then has little left to scan.
        gc.collect()
        gc.freeze()

    def __call__(
        self, cmd: list[str], cwd: Path, env: dict[str, str] | None, stdout: Any
    ) -> ForkedRun | subprocess.Popen:
        key = script_of(cmd)
        if key is None:
            return subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, env=env)
        argv = [cmd[2], *cmd[3:]] if key.startswith("-m ") else cmd[1:]
        return ForkedRun(self.scripts[key], argv, cwd, env, stdout, self.threads)


# How a bench starts a command: (cmd, cwd, env or None for this one's, stdout: subprocess.PIPE or a file)
Launcher = Callable[[list[str], Path, "dict[str, str] | None", Any], "ForkedRun | subprocess.Popen"]


def start_subprocess(cmd: list[str], cwd: Path, env: dict[str, str] | None, stdout: Any) -> subprocess.Popen:
    """A fresh interpreter per command (the real run's way)."""
    return subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, env=env)
