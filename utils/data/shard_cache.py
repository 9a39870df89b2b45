"""A per-node cache of remote tar shards: fetched once per node, size-limited, least recently used evicted.

Remote URLs (``http(s)://``, and ``pipe:COMMAND`` with the user's opt-in only) are streamed with WebDataset's
``gopen`` into a temporary file and renamed into place, so a reader never sees half a shard; object-storage URLs
(``s3://``, ``gs://``) are downloaded the same way through the storage seam (utils/storage.py), with the
credentials of the environment. Ranks of one node
share the directory: a per-shard ``flock`` makes the first one fetch while the others wait and then reuse the
file. Evicting a shard another process still has open is safe on POSIX (the open file lives on until closed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

from utils.cli import ALLOW_PIPE_ENV
from utils.errors import UserError, first_line
from utils.files import atomic_output
from utils.log import LOGGER

OBJECT_STORE_PREFIXES = ("s3://", "gs://", "gcs://")
REMOTE_PREFIXES = ("http://", "https://", "pipe:", *OBJECT_STORE_PREFIXES)
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "yolo-train" / "shards"
DEFAULT_CACHE_GB = 50.0
CHUNK = 1 << 20


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE_PREFIXES)


def check_pipe_allowed(url: str, source: str) -> None:
    """A one-line error for a ``pipe:`` URL unless the user opted in: its command goes to a shell, and a data
    YAML or shard list that came with a download must not run code by being read."""
    if url.startswith("pipe:") and os.environ.get(ALLOW_PIPE_ENV) != "1":
        raise UserError(
            f"{source}: {url[:120]!r} is a pipe: URL, which runs a shell command; it was not run. "
            f"To run it, pass --allow-pipe (or set {ALLOW_PIPE_ENV}=1)"
        )


class FetchError(OSError):
    """A remote shard could not be fetched; the message names the URL."""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ShardCache:
    """Local copies of remote shards under ``directory``, at most ``max_bytes`` in all (the newest shard is
    always kept, even if alone it is larger). Local paths pass through unchanged."""

    def __init__(self, directory: str | Path | None = None, max_bytes: int | None = None):
        env_dir, env_gb = os.environ.get("YOLO_TRAIN_SHARD_CACHE"), os.environ.get("YOLO_TRAIN_SHARD_CACHE_GB")
        self.directory = Path(directory or env_dir or DEFAULT_CACHE_DIR)
        gb = float(env_gb) if env_gb else DEFAULT_CACHE_GB
        self.max_bytes = int(max_bytes if max_bytes is not None else gb * (1 << 30))
        self.fetched = 0  # shards this process downloaded (the others were found in the cache)
        self._queue: queue.Queue[str | None] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_queue"] = None  # the prefetch thread stays with the process that started it
        return state

    def path_for(self, url: str) -> Path:
        """Where a remote URL's copy lives: a hash of the URL plus its base name, for people reading the folder."""
        tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in url.rstrip("/").rsplit("/", 1)[-1])[-60:]
        return self.directory / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{tail}"

    def local_path(self, url: str) -> str:
        """A local file holding the shard ``url``: itself when local, else the cached copy (fetched if needed)."""
        if not is_remote(url):
            return url
        check_pipe_allowed(url, "shard")  # shard_names.py refused it already; no other way reaches the shell
        dest = self.path_for(url)
        if dest.is_file():
            with contextlib.suppress(OSError):
                os.utime(dest)  # its use time drives eviction
            return str(dest)
        self.directory.mkdir(parents=True, exist_ok=True)
        with _locked(dest.with_name(dest.name + ".lock")):
            if not dest.is_file():  # another rank of this node may have fetched it while we waited
                self._fetch(url, dest)
                self.fetched += 1
                self._evict(keep=dest)
        return str(dest)

    def _fetch(self, url: str, dest: Path) -> None:
        if url.startswith(OBJECT_STORE_PREFIXES):
            self._download(url, dest)
            return
        import webdataset  # imported here: only remote shards need it at this point

        try:
            stream = webdataset.gopen(url, "rb")
            with atomic_output(dest) as tmp:
                with open(tmp, "wb") as out:
                    while chunk := stream.read(CHUNK):
                        out.write(chunk)
                stream.close()  # a pipe's close raises when the command failed: the copy is then not kept
                if tmp.stat().st_size == 0:
                    raise FetchError(f"{url}: empty download")
        except Exception as e:  # gopen raises whatever its transport raises (IOError, ValueError, ...)
            raise FetchError(f"{url}: cannot fetch shard ({first_line(e)})") from e

    def _download(self, url: str, dest: Path) -> None:
        """An object's bytes at ``dest``, whole (a missing backend or wrong credentials: the seam's one line)."""
        from utils.storage import open_storage, split

        folder, name = split(url)
        try:
            open_storage(folder).download(name, dest)
        except OSError as e:
            raise FetchError(f"{url}: cannot fetch shard ({first_line(e) if str(e) else 'no such object'})") from e
        if dest.stat().st_size == 0:
            dest.unlink()
            raise FetchError(f"{url}: empty download")

    def _evict(self, keep: Path) -> None:
        """Delete least recently used copies until the cache fits ``max_bytes``."""
        files = [
            p
            for p in self.directory.iterdir()
            if p.is_file() and not p.name.endswith((".lock", ".tmp")) and not p.name.startswith("index-")
        ]
        entries = []
        for p in files:
            with contextlib.suppress(OSError):
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size
                LOGGER.debug(f"shard cache: evicted {p.name}")

    # ---- prefetch: downloads overlapped with training -----------------------------------------------------
    def prefetch(self, urls: list[str]) -> None:
        """Fetch ``urls`` (in order) in a background thread; a new call replaces what is still queued."""
        remote = [u for u in urls if is_remote(u)]
        if not remote:
            return
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(
                target=self._prefetch_loop, args=(self._queue,), name="shard-prefetch", daemon=True
            ).start()
        with self._queue.mutex:
            self._queue.queue.clear()
        for u in remote:
            self._queue.put(u)

    def _prefetch_loop(self, q: queue.Queue[str | None]) -> None:
        while (url := q.get()) is not None:
            try:
                self.local_path(url)
            except FetchError as e:  # the reader reports it again (and skips) when it needs the shard
                LOGGER.warning(f"WARNING prefetch: {e}")


def check_local_shards(urls: list[str], source: str) -> None:
    """A one-line error naming the first local shard that does not exist."""
    for url in urls:
        if not is_remote(url) and not os.path.isfile(url):
            raise UserError(f"{url}: shard not found (listed by {source})")


def require_fetch(cache: ShardCache, url: str) -> str:
    """``cache.local_path`` with a fetch failure turned into a one-line error (used at start-up)."""
    try:
        return cache.local_path(url)
    except FetchError as e:
        raise UserError(str(e)) from e
