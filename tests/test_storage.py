"""The storage seam (utils/storage.py) on a local folder, on a real S3 server on loopback (SeaweedFS,
tests/s3_server.py) and on fsspec's memory file system: whole-file writes, reads, listings; wrong credentials, an
unreachable endpoint and a missing backend are one line each, with no secret in it."""

from __future__ import annotations

import sys
import time
import uuid

import pytest
from conftest import free_port
from s3_server import SECRET_KEY, shared_s3_server

from utils.errors import UserError
from utils.storage import Storage, is_url, open_storage, protocol_of


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory, worker_id):
    # Under xdist each worker's base folder sits in the run's own folder, which all workers share.
    base = tmp_path_factory.getbasetemp()
    yield from shared_s3_server(base if worker_id == "master" else base.parent)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def bucket(s3_env) -> str:
    """A new bucket of this test's own."""
    name = f"t{uuid.uuid4().hex[:12]}"
    open_storage(f"s3://{name}").fs.mkdir(name)
    return name


def test_locations_are_told_apart() -> None:
    assert protocol_of("s3://b/runs") == "s3" and protocol_of("GS://b") == "gs"
    assert not is_url("runs/train") and not is_url("/abs/runs") and not is_url("file:///abs/runs")
    assert open_storage("file:///tmp/x").location == "/tmp/x"


def test_a_local_storage_writes_whole_files_and_lists_them(tmp_path) -> None:
    storage = open_storage(tmp_path / "run")
    storage.write_bytes("weights/last.pt", b"abc")
    storage.upload(tmp_path / "run/weights/last.pt", "weights/copy.pt")
    assert storage.read_bytes("weights/copy.pt") == b"abc" and storage.exists("weights/last.pt")
    assert storage.listdir("weights") == ["copy.pt", "last.pt"] and storage.listdir("nothing") == []


@pytest.mark.slow
def test_an_s3_bucket_holds_a_runs_files(bucket, tmp_path) -> None:
    storage = open_storage(f"s3://{bucket}/runs/exp")
    storage.check_access()
    assert storage.listdir() == [] and not storage.exists("weights/last.pt")
    storage.write_bytes("weights/last.pt", b"first")
    storage.write_bytes("weights/last.pt", b"second")  # replaced whole
    (tmp_path / "results.csv").write_text("epoch\n0\n")
    storage.upload(tmp_path / "results.csv", "results.csv")
    assert storage.read_bytes("weights/last.pt") == b"second"
    assert storage.read_bytes("results.csv") == b"epoch\n0\n"
    assert storage.listdir() == ["results.csv", "weights"] and storage.listdir("weights") == ["last.pt"]


@pytest.mark.slow
def test_wrong_credentials_are_one_line_without_the_secret(bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    with pytest.raises(UserError) as info:
        open_storage(f"s3://{bucket}/runs").check_access()
    message = str(info.value)
    assert message.startswith(f"opening s3://{bucket}/runs: ") and "\n" not in message
    assert "not-the-secret-at-all" not in message and SECRET_KEY not in message


def test_an_unreachable_endpoint_is_one_line_within_seconds(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-value")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^opening s3://bucket/runs: .*check the credentials and the endpoint\)$"):
        open_storage("s3://bucket/runs").check_access()
    assert time.monotonic() - started < 30


def test_a_missing_backend_is_one_line_naming_the_package(monkeypatch) -> None:
    import fsspec  # noqa: F401 (its registry module, shadowed by a mapping of the same name on the package)

    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs raises ImportError
    # As in a process that never imported s3fs: fsspec keeps the classes it imported in its registry.
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(UserError, match=r"^s3://b/runs: s3:// needs the package s3fs \(pip install s3fs\)$"):
        open_storage("s3://b/runs")


def test_a_backend_without_atomic_uploads_writes_beside_and_moves() -> None:
    """A protocol not known to upload atomically gets a temporary object moved into place: never half visible."""
    import fsspec

    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    moves = []
    real_mv = fs.mv
    fs.mv = lambda a, b, **kw: (moves.append((a, b)), real_mv(a, b, **kw))[1]
    storage = Storage(f"memory://{uuid.uuid4().hex}/run", fs, "sftp")
    storage.write_bytes("weights/last.pt", b"x" * 1000)
    assert storage.read_bytes("weights/last.pt") == b"x" * 1000 and storage.listdir("weights") == ["last.pt"]
    ((tmp, target),) = moves
    assert target.endswith("/weights/last.pt") and tmp.rpartition("/")[2].startswith(".last.pt.")
