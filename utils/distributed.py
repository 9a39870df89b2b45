"""Everything distributed: who this process is, the process group, waits, collectives and diagnosis.

``dist_info`` is the one place that reads torch.distributed.run's environment. Collectives time out after
``--dist-timeout``; where ranks are known to wait for long work (local rank 0 building a label cache, rank 0
validating) they wait on a key of the rendezvous store instead. Every rank bumps a heartbeat counter in the
store from a thread, so a wait is bounded by progress, not by the length of the work: a rank gives up when the
rank it waits for has not beaten for ``--dist-timeout`` (it died, froze, or sits in a store wait of its own:
the ranks' waits do not match), and names it. A live label-cache build of millions of images is waited for.

Waits are keyed by their tag and how often this rank has waited at that tag, so only a mismatch at one tag
can pair the wrong waits, and such a mismatch ends as above instead of hanging.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import platform
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from utils.cli import parse_device
from utils.errors import UserError

HEARTBEAT_SECONDS = 2.0  # at most; a shorter --dist-timeout beats faster (four beats per timeout)
WAIT_PAUSE_MAX = 0.5  # a store wait looks at the heartbeats of the ranks it waits for at least this often
WAIT_PAUSE_FAST, WAIT_FAST_WINDOW_S = 0.005, 10.0  # a store wait's first seconds: polled every 5 ms
DEFAULT_TIMEOUT_MINUTES = 10.0
PR_SET_PDEATHSIG = 1  # prctl option number (linux/prctl.h)


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank, -1 when not distributed
    local_rank: int  # rank on this machine, -1 when not distributed
    world_size: int  # 1 when not distributed
    local_world_size: int = 1  # processes on this machine
    restart_count: int = 0  # how often torch.distributed.run has restarted the group
    run_id: str = ""  # the launcher's id of this job (the same across its restarts)
    launcher_started: float | None = None  # when the launcher's agent (this process's parent) started, epoch seconds

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank in (-1, 0)

    @property
    def is_local_main(self) -> bool:
        return self.local_rank in (-1, 0)


def dist_info() -> DistInfo:
    """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the restart round as set by torch.distributed.run."""
    env = os.environ
    restart_count = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    started = _parent_start_time() if run_id else None
    world_size = int(env.get("WORLD_SIZE", 1))
    if world_size <= 1:
        return DistInfo(
            rank=-1, local_rank=-1, world_size=1, restart_count=restart_count, run_id=run_id, launcher_started=started
        )
    local_rank = int(env.get("LOCAL_RANK", 0))
    return DistInfo(
        rank=int(env.get("RANK", 0)),
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
        restart_count=restart_count,
        run_id=run_id,
        launcher_started=started,
    )


def check_one_process_per_gpu(device: str, info: DistInfo, command: str) -> None:
    """Several GPUs need one process each: a one-line error giving the launcher's command for ``command`` (the
    script and its arguments) when ``device`` lists several GPUs and this process was not started by a launcher."""
    ids = parse_device(device).gpus
    if len(ids) > 1 and not info.is_distributed:
        raise UserError(
            f"--device {device} names {len(ids)} GPUs but this is one process: start one per GPU "
            f"with `python -m torch.distributed.run --nproc_per_node {len(ids)} {command}`"
        )


def _parent_start_time() -> float | None:
    """When this process's parent started, in seconds since the epoch (Linux /proc); None where unknown.

    Under torch.distributed.run the parent is the launcher's agent: a run folder marked with this job's run id
    before that moment belongs to an earlier job that reused the id (``--rdzv-id`` is often fixed in scripts).
    """
    try:
        with open(f"/proc/{os.getppid()}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def end_with_launcher(info: DistInfo) -> bool:
    """Under torch.distributed.run, have the kernel send this rank SIGTERM when the launcher's agent dies.

    A launcher stopped by SIGKILL (the OOM killer, a scheduler's hard limit, ``kill -9``) cannot stop its ranks:
    they would train on unsupervised, holding their devices, and meet the resumed job in the same run folder.
    Call it first thing in main(): a launcher that dies while this process is still importing is not noticed.
    True when the request was made (Linux, under a launcher).
    """
    if not info.run_id or platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0


# ---- the process group --------------------------------------------------------------------------------


class WaitAbandoned(UserError):
    """A store wait given up: the rank waited for made no progress for --dist-timeout (the message names it)."""


class CollectiveError(RuntimeError):
    """One of this project's collectives failed (gloo raises a bare RuntimeError when a peer dies or times out)."""


class _Group:
    """What this process keeps about its process group: the store (prefixed per restart round), the heartbeat,
    the timeout of store waits and how often it has waited at each tag."""

    store: dist.Store | None = None
    heartbeat_stop: threading.Event | None = None
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    timeout_seconds: float = DEFAULT_TIMEOUT_MINUTES * 60
    waits: dict[str, int] = {}
    host: Any = None  # the gloo group of host numbers under NCCL (host_group)


def _open_store(info: DistInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store under a prefix of this restart round.

    torch.distributed.run keeps one store across restarts; keys of the dead round (gloo's peer addresses among
    them) would otherwise be read by the new one, which then fails to connect.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    hosts = not agent_serves and info.rank == 0
    store = dist.TCPStore(
        host,
        port,
        world_size=info.world_size,
        is_master=hosts,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=hosts,
    )
    return dist.PrefixStore(f"yolo-train/round-{info.restart_count}", store)


def init_process_group(
    device: torch.device, info: DistInfo, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES, shared_gpu: bool = False
) -> None:
    """Join the process group (NCCL for CUDA devices, gloo for CPU and for ranks that share a GPU, which NCCL
    refuses); collectives time out after ``timeout_minutes``, and store waits after as long without progress from
    the rank waited for."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _open_store(info, timeout)
    backend = "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
    _Group.store, _Group.waits, _Group.timeout_seconds = store, {}, timeout.total_seconds()
    _Group.heartbeat_seconds = min(HEARTBEAT_SECONDS, _Group.timeout_seconds / 4)
    _start_heartbeat(store, info.rank, _Group.heartbeat_seconds)


def destroy_process_group() -> None:
    if _Group.heartbeat_stop is not None:
        _Group.heartbeat_stop.set()
        _Group.heartbeat_stop = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _Group.store, _Group.host = None, None


def _store() -> dist.Store:
    """The store of this process group (ours, or the default one when the group was made elsewhere, e.g. in tests)."""
    return _Group.store if _Group.store is not None else dist.distributed_c10d._get_default_store()


def _start_heartbeat(store: dist.Store, rank: int, seconds: float = HEARTBEAT_SECONDS) -> None:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(seconds):
            with contextlib.suppress(Exception):  # a store that went away is diagnosed where it matters
                store.add(f"heartbeat/{rank}", 1)

    store.add(f"heartbeat/{rank}", 1)
    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    _Group.heartbeat_stop = stop


def silent_ranks(world_size: int, seconds: float | None = None) -> list[int] | None:
    """Ranks whose heartbeat did not advance within ``seconds`` (three beats); None when the store itself cannot
    be reached."""
    seconds = 3 * _Group.heartbeat_seconds if seconds is None else seconds
    try:
        store = _store()
        before = [store.add(f"heartbeat/{r}", 0) for r in range(world_size)]
        time.sleep(seconds)
        after = [store.add(f"heartbeat/{r}", 0) for r in range(world_size)]
    except (dist.DistError, RuntimeError):  # the store's host is gone or frozen
        return None
    return [r for r in range(world_size) if after[r] == before[r]]


def collective_failure(error: BaseException, info: DistInfo) -> str | None:
    """One line for a collective that failed (which rank went missing, or that the store is unreachable), or
    None when ``error`` is not one.

    Recognised by type: PyTorch's distributed errors (``DistError`` and its DistBackendError, DistNetworkError,
    DistStoreError) and this project's ``CollectiveError``. gloo raises a bare ``RuntimeError`` when a peer dies
    (connection reset) or times out (checked on torch 2.14.1), also from inside DDP's backward: such an error
    counts when the group is broken, that is when a rank stopped beating or the store is gone.
    """
    if not info.is_distributed:
        return None
    typed = isinstance(error, (dist.DistError, CollectiveError))
    if not typed and type(error) is not RuntimeError:
        return None
    missing = silent_ranks(info.world_size)
    if not typed and missing == []:
        return None  # a RuntimeError of this rank's own; the group is fine
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if missing is None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        who = f"the rendezvous store at {where} does not answer (its node went missing)"
    elif missing:
        who = f"rank(s) {', '.join(map(str, missing))} stopped answering"
    else:
        who = "every rank still answers"
    return f"rank {info.rank}: a collective failed ({first}); {who}; exiting so the launcher can restart the group"


# ---- waiting on the store, bounded by the progress of the ranks waited for ---------------------------------


def _next_key(tag: str) -> str:
    """``wait/TAG/N``: the N-th wait of this rank at ``tag`` (the waits of other tags do not shift it)."""
    _Group.waits[tag] = _Group.waits.get(tag, 0) + 1
    return f"wait/{tag}/{_Group.waits[tag]}"


def _store_unreachable(info: DistInfo, what: str, error: BaseException) -> WaitAbandoned:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return WaitAbandoned(
        f"rank {info.rank}: the rendezvous store at {where} stopped answering while this rank waited "
        f"at '{what}' (its host, rank 0's node, went missing: {type(error).__name__})"
    )


def wait_for_keys(info: DistInfo, keys: dict[int, str], what: str) -> dict[int, bytes]:
    """Wait until each rank in ``keys`` has set its key; returns their values.

    Give up when one of those still awaited made no progress for the timeout, naming it: its heartbeat stood
    still (it died or froze), or it sat in a store wait of its own (the ranks' waits do not match).
    """
    store, timeout = _store(), _Group.timeout_seconds
    values: dict[int, bytes] = {}
    try:
        store.set(f"waiting/{info.rank}", what)
        pending = dict(keys)
        beats: dict[int, int] = {}
        progress: dict[int, float] = {}  # rank -> when it last made progress
        pause, started = WAIT_PAUSE_FAST, time.monotonic()
        while pending:
            # Asked without waiting, then a pause: a store wait that times out logs a C++ warning each time
            # ("waitForInput ... likely a timeout"), which reads as a network failure (a lost store still raises).
            if not store.check(list(pending.values())):
                time.sleep(pause)
            now = time.monotonic()
            # Looked at often at first: the rank that hosts the store may exit soon after setting the key (a store
            # wait woke at once; a poll must not sleep past it). A long wait then looks less often.
            pause = WAIT_PAUSE_FAST if now - started < WAIT_FAST_WINDOW_S else min(pause * 2, WAIT_PAUSE_MAX)
            for rank, key in list(pending.items()):
                if store.check([key]):
                    values[rank] = store.get(key)
                    del pending[rank]
                    continue
                beat = store.add(f"heartbeat/{rank}", 0)
                waits_itself = _waits_at(store, rank)
                if rank not in progress or (beat != beats[rank] and not waits_itself):
                    progress[rank] = now
                beats[rank] = beat
                if now - progress[rank] > timeout:
                    why = (
                        f"it waits at '{waits_itself}' itself: the ranks' waits do not match"
                        if waits_itself
                        else "its heartbeat stopped: it died or froze"
                    )
                    raise WaitAbandoned(
                        f"rank {info.rank}: gave up waiting at '{what}' after {timeout:g} s without "
                        f"progress from rank {rank} ({why})"
                    )
    except dist.DistError as e:  # DistNetworkError: the store's host is gone
        raise _store_unreachable(info, what, e) from e
    with contextlib.suppress(dist.DistError):  # a store gone now is reported by whatever uses it next
        store.set(f"waiting/{info.rank}", "")
    return values


def _waits_at(store: dist.Store, rank: int) -> str:
    """Where ``rank`` waits on the store now ('' when it does not)."""
    key = f"waiting/{rank}"
    return store.get(key).decode() if store.check([key]) else ""


@contextlib.contextmanager
def local_rank_zero_first(info: DistInfo) -> Iterator[None]:
    """Run the block on local rank 0 of each machine first; the machine's other ranks enter once it has left.

    They wait on a store key for as long as local rank 0 is alive (building a large cache may take hours). If
    local rank 0 fails in the block, the others stop with one line instead of waiting for ever.
    """
    if not info.is_distributed or not dist.is_initialized():
        yield
        return
    local_zero = info.rank - info.local_rank
    key = _next_key(f"node-{local_zero}-first")
    store = _store()
    if info.local_rank != 0:
        if wait_for_keys(info, {local_zero: key}, f"rank {local_zero} prepares the data")[local_zero] != b"ok":
            raise UserError(f"rank {info.rank}: local rank 0 failed while preparing the data (its error says why)")
        yield
        return
    try:
        yield
    except BaseException:
        store.set(key, "failed")
        raise
    store.set(key, "ok")


def rank_zero_decides(info: DistInfo, decision: str | None) -> str:
    """Rank 0's ``decision`` for every rank; the others wait for it on the store as long as rank 0 is alive."""
    if not info.is_distributed:
        return decision or ""
    key = _next_key("decision")
    store = _store()
    if info.rank == 0:
        store.set(key, decision or "")
        return decision or ""
    return wait_for_keys(info, {0: key}, "rank 0's decision")[0].decode()


# ---- collectives and models ------------------------------------------------------------------------------


@contextlib.contextmanager
def collective(name: str) -> Iterator[None]:
    """A collective of this project's: the bare RuntimeError gloo raises for a dead or timed-out peer becomes a
    CollectiveError (PyTorch's own DistError types pass as they are)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, dist.DistError):
            raise
        raise CollectiveError(f"{name}: {e}") from e


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (a no-op outside a process group); returns it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with collective("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def host_group() -> Any:
    """A gloo group of every rank for collectives of host numbers: the default group where it is gloo's; under NCCL
    one made at the first call (every rank calls at the same step) and kept, so host numbers never travel through
    the device (a read of an NCCL result would make the host wait for everything queued before it)."""
    if dist.get_backend() == "gloo":
        return None  # the default group
    if _Group.host is None:
        _Group.host = dist.new_group(backend="gloo")
    return _Group.host


def max_over_ranks(values: list[int]) -> list[int]:
    """Each of ``values`` (host integers) maximised over all ranks, on the host (``values`` itself outside a process
    group)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    with collective("all_reduce (max of host numbers)"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host_group())
    return [int(v) for v in tensor.tolist()]


T = TypeVar("T")


def broadcast_object(obj: T, info: DistInfo) -> T:
    """Rank 0's ``obj`` on every rank (pickled between our own processes only)."""
    if not info.is_distributed:
        return obj
    box = [obj if info.rank == 0 else None]
    with collective("broadcast"):
        dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])  # rank 0's object: of the type every rank passed


def de_parallel(model: nn.Module) -> nn.Module:
    """The bare model inside a DataParallel/DistributedDataParallel wrapper."""
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) else model


# ---- the ranks of one node ---------------------------------------------------------------------------------


def node_index(info: DistInfo) -> int:
    """This machine's number: torch.distributed.run gives each node a contiguous run of LOCAL_WORLD_SIZE ranks."""
    return (info.rank - info.local_rank) // max(info.local_world_size, 1)


def node_barrier(info: DistInfo, tag: str) -> None:
    """Wait until every rank of this node has arrived (other nodes are not involved).

    Store keys, not a collective: ranks of other nodes need not call it, and a long fill (a large image cache)
    is waited for as long as the ranks filling are alive (see ``wait_for_keys``).
    """
    if not info.is_distributed or not dist.is_initialized() or info.local_world_size <= 1:
        return
    key = _next_key(f"node-{node_index(info)}/{tag}")
    first = info.rank - info.local_rank
    _store().set(f"{key}/{info.rank}", "arrived")
    others = {r: f"{key}/{r}" for r in range(first, first + info.local_world_size) if r != info.rank}
    wait_for_keys(info, others, f"{tag} (node barrier)")


def node_decides(info: DistInfo, tag: str, decision: str) -> str:
    """Local rank 0's ``decision`` on every rank of this node (so that they all take the same branch)."""
    if not info.is_distributed or not dist.is_initialized() or info.local_world_size <= 1:
        return decision
    key = _next_key(f"node-{node_index(info)}/{tag}/decision")
    store = _store()
    if info.local_rank == 0:
        store.set(key, decision)
        return decision
    local_zero = info.rank - info.local_rank
    return wait_for_keys(info, {local_zero: key}, f"{tag} (rank {local_zero} decides)")[local_zero].decode()
