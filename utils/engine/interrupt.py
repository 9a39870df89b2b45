"""Ctrl-C and SIGTERM during training: the first asks the run to stop (every rank at the same step, through the
read-back of utils/engine/step.py), which saves an exact checkpoint and ends with one line naming the command that
resumes it; a second Ctrl-C ends the process at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# A launcher (torch.distributed.run) passes the terminal's Ctrl-C on to its workers, which got it from the terminal
# too: a signal this soon after the first is that same Ctrl-C, not a second one.
SAME_SIGNAL_SECONDS = 1.0


class StopRequest:
    """This process's wish to stop: the signal that asked, and when."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at = 0.0
        self.parent = 0  # the process that started this one (a launcher), when the handlers were installed

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if os.getppid() != self.parent:
            # The launcher is gone (the kernel's parent-death SIGTERM, utils/distributed.py): no rank trains on
            # unsupervised, and the other ranks' collectives fail at once and name this one.
            os._exit(128 + signum)
        if self.signum is None:
            self.signum, self.at = signum, now
        elif signum == signal.SIGINT and now - self.at > SAME_SIGNAL_SECONDS:
            os._exit(128 + signum)  # the user insists: no checkpoint, no clean-up (files are written atomically)

    def clear(self) -> None:
        self.signum = None


STOP = StopRequest()


class Interrupted(Exception):
    """The run stopped on a signal after saving a checkpoint; the process exits with 128 + the signal's number,
    as a shell reports a process the signal ended."""

    def __init__(self, signum: int, resume_command: str) -> None:
        super().__init__(resume_command)
        self.signum = signum
        self.resume_command = resume_command

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """While training: SIGINT and SIGTERM ask ``STOP`` to stop (only the main thread can install handlers; another
    thread trains with the handlers as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield STOP
        return
    STOP.clear()
    STOP.parent = os.getppid()
    before = {s: signal.signal(s, STOP.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield STOP
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        STOP.clear()
