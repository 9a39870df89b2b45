"""The object-storage tests' fixtures, shared through conftest.py: the run's one S3 server (tests/s3_server.py), its
variables, a bucket of a test's own, and the GCS emulator (tests/gcs_server.py)."""

from __future__ import annotations

import uuid

import pytest

from tests.gcs_server import gcs_server
from tests.s3_server import shared_s3_server


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
    from utils.storage import open_storage

    name = f"t{uuid.uuid4().hex[:12]}"
    open_storage(f"s3://{name}").fs.mkdir(name)
    return name


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """The GCS emulator of this test process."""
    yield from gcs_server(tmp_path_factory.mktemp("gcs"))


@pytest.fixture
def gcs_env(gcs, monkeypatch):
    for name, value in gcs.env().items():
        monkeypatch.setenv(name, value)
    return gcs
