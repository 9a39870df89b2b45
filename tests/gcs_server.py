"""A Google Cloud Storage emulator on loopback for the ``gs://`` tests: the test requirements'
gcp-storage-emulator, in memory, one per test process (it starts in about a second). gcsfs finds it through
``STORAGE_EMULATOR_HOST``; utils/storage.py then asks for no credentials (an emulator takes none)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 30


@dataclass(frozen=True)
class GcsServer:
    endpoint: str  # http://127.0.0.1:PORT

    def env(self) -> dict[str, str]:
        """What gcsfs reads: the emulator's address; and gcsfs's lookups of a bucket's layout off (they go to
        Google's control plane, which an emulator does not serve, and log a warning on every call)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def gcs_server(folder: Path) -> Iterator[GcsServer]:
    """The emulator for a fixture (generator): started, yielded, killed; its log in ``folder``."""
    port = _free_port()
    log = open(folder / "gcs-emulator.log", "ab")
    args = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*args, "--in-memory"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = GcsServer(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(server.endpoint):
            assert proc.poll() is None, (folder / "gcs-emulator.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"the GCS emulator did not answer in {START_TIMEOUT_S} s"
            time.sleep(0.1)
        yield server
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
