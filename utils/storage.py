"""Where a run's files live: a local folder or an object store (``s3://``, ``gs://``, any fsspec URL), behind one seam.

A ``Storage`` is opened on a location (``open_storage``) and then addressed with paths relative to it. Writes are
whole files, never visible half written: on a local disk through ``utils/files.py``'s write-beside-and-rename; on an
object store a single upload is atomic (the object appears when its PUT, or the multipart upload's completion,
succeeds), and on any other fsspec backend the file is uploaded under a temporary name and moved. fsspec and its
backends (s3fs, gcsfs) are optional: imported only for a URL, one line naming the package when missing. Credentials
and endpoints come from the environment and the providers' own files as the backends read them; they never appear
in a message of this module (``redact``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from utils.errors import UserError
from utils.files import atomic_output

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Protocols whose single upload is atomic (what a reader sees is the old object or the whole new one).
ATOMIC_UPLOAD = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
# Environment variables whose values are secrets: never part of a message.
SECRET_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
)
CONNECT_TIMEOUT_S = 5  # an unreachable endpoint is one line within seconds, not a minute of retries
READ_TIMEOUT_S = 60.0  # an answer that stops coming (a frozen server): the request fails and is tried again
# An upload's whole time is bounded too: aiohttp's read timeout does not cover a PUT whose server stopped answering
# (it waits for the server to wake). The bound grows with the file, at a rate below any working link's.
SLOWEST_UPLOAD_BYTES_S = 1 << 20


def protocol_of(location: str | Path) -> str | None:
    """The URL's protocol (``"s3"``), or None for a local path (``file://`` URLs included)."""
    match = _SCHEME.match(str(location))
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store or another remote file system rather than a local path."""
    return protocol_of(location) is not None


def redact(message: str) -> str:
    """``message`` with every secret of the environment (``SECRET_VARIABLES``) replaced by ``***``."""
    for name in SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            message = message.replace(value, "***")
    return message


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return redact(f"{error.__class__.__name__}: {lines[0]}" if lines else error.__class__.__name__)


@dataclass(frozen=True)
class FileStat:
    """A file's size in bytes and when it was last written (seconds since the epoch; None where not known)."""

    size: int
    modified: float | None


def _stamp(info: dict) -> float | None:
    """The modification time in a backend's file info: s3fs's ``LastModified`` (a datetime), gcsfs's ``updated``
    (an ISO 8601 text), or ``mtime``."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if isinstance(stamp, str):
        with contextlib.suppress(ValueError):
            stamp = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    return float(stamp) if isinstance(stamp, (int, float)) else None


@dataclass(frozen=True)
class Storage:
    """Files under ``location``: ``fs`` is fsspec's file system for a URL, None for a local folder."""

    location: str
    fs: Any = None
    protocol: str | None = None

    def full(self, relative: str = "") -> str:
        """The location of ``relative`` (a ``/``-separated path under this storage), as this storage names it."""
        if not relative:
            return self.location
        if self.fs is None:
            return str(Path(self.location) / relative)
        return f"{self.location.rstrip('/')}/{relative.lstrip('/')}"

    def write_bytes(self, relative: str, data: bytes) -> None:
        """``data`` as the whole file ``relative``: visible all at once or not at all."""
        target = self.full(relative)
        if self.fs is None:
            with atomic_output(target) as tmp:
                tmp.write_bytes(data)
            return
        bounded = self._bounded(len(data))
        self._remote(
            lambda: self._put(target, lambda path: self.fs.pipe_file(path, data, **bounded)), f"writing {target}"
        )

    def upload(self, local: str | Path, relative: str) -> None:
        """The local file ``local`` as the file ``relative``, all at once (a local storage copies it atomically)."""
        target = self.full(relative)
        if self.fs is None:
            with atomic_output(target) as tmp:
                tmp.write_bytes(Path(local).read_bytes())
            return
        bounded = self._bounded(Path(local).stat().st_size)
        self._remote(
            lambda: self._put(target, lambda path: self.fs.put_file(str(local), path, **bounded)), f"writing {target}"
        )

    def _bounded(self, size: int) -> dict[str, float]:
        """fsspec's bound on an asynchronous backend's call (its ``timeout``, which cancels the call), for an upload
        of ``size`` bytes; none for a synchronous backend, which takes no such argument."""
        if not getattr(self.fs, "async_impl", False):
            return {}
        return {"timeout": READ_TIMEOUT_S + size / SLOWEST_UPLOAD_BYTES_S}

    def upload_tree(self, local: str | Path, relative: str) -> None:
        """The local file or folder ``local`` as ``relative`` (a folder's files each whole, one by one)."""
        local = Path(local)
        if not local.is_dir():
            self.upload(local, relative)
            return
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.upload(path, f"{relative}/{path.relative_to(local).as_posix()}")

    def _put(self, target: str, put: Any) -> None:
        if self.protocol in ATOMIC_UPLOAD:
            put(target)
            return
        head, _, name = target.rpartition("/")
        tmp = f"{head}/.{name}.{uuid.uuid4().hex}.tmp"
        put(tmp)
        self.fs.mv(tmp, target)

    def download(self, relative: str, local: str | Path) -> None:
        """The file ``relative`` as the local file ``local``, whole (written beside it and renamed)."""
        target = self.full(relative)
        with atomic_output(local) as tmp:
            if self.fs is None:
                shutil.copyfile(target, tmp)
            else:
                self._remote(lambda: self.fs.get_file(target, str(tmp)), f"reading {target}")

    def files(self, relative: str = "") -> list[str]:
        """Every file under ``relative``, as paths relative to it (``weights/last.pt``), sorted."""
        target = self.full(relative)
        if self.fs is None:
            root = Path(target)
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        found: Iterable[str] = self._remote(lambda: self.fs.find(target), f"listing {target}")
        prefix = target.split("://", 1)[-1].rstrip("/") + "/"
        return sorted(f.split("://", 1)[-1][len(prefix) :] for f in found if f.split("://", 1)[-1].startswith(prefix))

    def file_stats(self, relative: str = "", recursive: bool = True) -> dict[str, FileStat]:
        """Every file under the folder ``relative`` (directly under it unless ``recursive``), as paths relative to
        it with their sizes and modification times, from one listing; empty where there is no such folder."""
        target = self.full(relative)
        if self.fs is None:
            root = Path(target)
            if not root.is_dir():
                return {}
            found = [p for p in (root.rglob("*") if recursive else root.iterdir()) if p.is_file()]
            return {p.relative_to(root).as_posix(): FileStat(p.stat().st_size, p.stat().st_mtime) for p in found}
        prefix = target.split("://", 1)[-1].rstrip("/") + "/"
        listing: dict[str, dict] = self._remote(
            lambda: self.fs.find(prefix, maxdepth=None if recursive else 1, detail=True), f"listing {target}"
        )
        return {
            name.split("://", 1)[-1][len(prefix) :]: FileStat(int(info.get("size") or 0), _stamp(info))
            for name, info in listing.items()
            if name.split("://", 1)[-1].startswith(prefix) and info.get("type", "file") == "file"
        }

    def download_many(self, pairs: list[tuple[str, Path]]) -> None:
        """Each file ``relative`` as its local path, several at once where the backend can (s3fs, gcsfs), each
        written beside its path and renamed, so that no local path ever holds part of a file."""
        if not pairs:
            return
        temporary = [local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp") for _, local in pairs]
        for tmp in temporary:
            tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self.fs is None:
                for (relative, _), tmp in zip(pairs, temporary, strict=True):
                    shutil.copyfile(self.full(relative), tmp)
            else:
                remote = [self.full(relative) for relative, _ in pairs]
                where = f"reading {len(pairs)} files under {self.location}"
                self._remote(lambda: self.fs.get(remote, [str(t) for t in temporary]), where)
            for (_, local), tmp in zip(pairs, temporary, strict=True):
                os.replace(tmp, local)
        finally:
            for tmp in temporary:
                tmp.unlink(missing_ok=True)

    def modified(self, relative: str) -> float | None:
        """When the file ``relative`` was last written (seconds since the epoch); None where it does not exist."""
        target = self.full(relative)
        if self.fs is None:
            return Path(target).stat().st_mtime if Path(target).is_file() else None
        try:
            info = self._remote(lambda: self.fs.info(target), f"looking for {target}")
        except FileNotFoundError:
            return None
        return _stamp(info)

    def read_bytes(self, relative: str) -> bytes:
        target = self.full(relative)
        if self.fs is None:
            return Path(target).read_bytes()
        return self._remote(lambda: self.fs.cat_file(target), f"reading {target}")

    def exists(self, relative: str = "") -> bool:
        target = self.full(relative)
        if self.fs is None:
            return Path(target).exists()
        return bool(self._remote(lambda: self.fs.exists(target), f"looking for {target}"))

    def listdir(self, relative: str = "") -> list[str]:
        """The names directly under ``relative`` (none where it does not exist)."""
        target = self.full(relative)
        if self.fs is None:
            return sorted(p.name for p in Path(target).iterdir()) if Path(target).is_dir() else []
        if not self.exists(relative):
            return []
        entries: Iterable[str] = self._remote(lambda: self.fs.ls(target, detail=False), f"listing {target}")
        return sorted(e.rstrip("/").rpartition("/")[2] for e in entries)

    def check_access(self) -> None:
        """Raise a one-line UserError when the location cannot be reached or read with the credentials at hand
        (called before a run trains, so that wrong credentials cost no training)."""
        if self.fs is None:
            return
        bucket = self.location.split("://", 1)[1].split("/", 1)[0]
        try:
            self._remote(lambda: self.fs.ls(f"{self.protocol}://{bucket}", detail=False), f"opening {self.location}")
        except FileNotFoundError:
            raise UserError(f"opening {self.location}: the bucket {bucket} does not exist") from None

    def _remote(self, call: Any, doing: str) -> Any:
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as e:  # backends raise their own types (botocore, aiohttp, google-auth ...)  # noqa: BLE001
            raise UserError(f"{doing}: {_first_line(e)} (check the credentials and the endpoint)") from None


def local_path(location: str | Path) -> Path:
    """A local location as a path (a ``file://`` URL without its scheme)."""
    text = str(location)
    return Path(text[len("file://") :] if text.lower().startswith("file://") else text)


def join(location: str, *parts: str) -> str:
    """``location`` (a URL or a local path) with ``parts`` appended, ``/``-separated for a URL."""
    if not is_url(location):
        return str(Path(location, *parts))
    return "/".join([location.rstrip("/"), *(p.strip("/") for p in parts)])


def split(location: str) -> tuple[str, str]:
    """``location``'s folder and its last part (``s3://b/runs/exp`` -> ``s3://b/runs``, ``exp``)."""
    if not is_url(location):
        return str(Path(location).parent), Path(location).name
    head, _, name = location.rstrip("/").rpartition("/")
    return head, name


@contextlib.contextmanager
def local_copy(location: str | Path) -> Iterator[Path]:
    """A local path of the file ``location``: itself when local; for a URL, a download into a temporary folder
    (the file keeps its name, whose suffix says its format), removed when the block ends."""
    if not is_url(location):
        yield local_path(location)
        return
    folder, name = split(str(location))
    storage = open_storage(folder)
    tmp = Path(tempfile.mkdtemp(prefix="yolo-download-"))
    try:
        try:
            storage.download(name, tmp / name)
        except FileNotFoundError:
            raise UserError(f"{location}: no such file") from None
        yield tmp / name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_storage(location: str | Path) -> Storage:
    """The storage of ``location``: a local folder, or a URL through fsspec and the protocol's backend."""
    protocol = protocol_of(location)
    if protocol is None:
        return Storage(str(local_path(location)))
    try:
        import fsspec
    except ImportError:
        raise UserError(f"{location}: a URL needs the package fsspec (pip install fsspec)") from None
    try:
        fs = fsspec.filesystem(protocol, **_backend_options(protocol))
    except ImportError:
        package = BACKEND_PACKAGES.get(protocol, f"the fsspec backend of {protocol}://")
        raise UserError(f"{location}: {protocol}:// needs the package {package} (pip install {package})") from None
    except ValueError as e:
        raise UserError(f"{location}: {_first_line(e)}") from None
    if protocol in ("s3", "s3a"):
        # s3fs tries a timed-out request 5 times, unseen, on top of botocore's attempts: against a frozen server
        # one upload would then wait 10 READ_TIMEOUT_S before its caller heard. Once here; the run's uploads are
        # tried again with backoff and reported (utils/engine/run_upload.py), botocore retries what is transient.
        fs.retries = 1
    return Storage(str(location), fs, protocol)


def _backend_options(protocol: str) -> dict[str, Any]:
    """Bounded connection attempts, so that an unreachable endpoint fails in seconds; the rest as the backend reads
    it from the environment (s3fs: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...)."""
    if protocol in ("s3", "s3a"):
        config = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": 2, "mode": "standard"},
        }
        return {"config_kwargs": config, "skip_instance_cache": True}
    if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator (gcsfs reads STORAGE_EMULATOR_HOST) takes no credentials: asking for none skips the search
        # for Google's (its last step waits on the metadata server of a Compute Engine machine)
        return {"token": "anon", "skip_instance_cache": True}
    return {"skip_instance_cache": True}
