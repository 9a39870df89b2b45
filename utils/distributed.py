"""Everything distributed: who this process is, the process group, waits, collectives and diagnosis.

``dist_info`` is the one place that reads torch.distributed.run's environment. Collectives time out after
``--dist-timeout``; where ranks are known to wait for long work (local rank 0 building a label cache, rank 0
validating) they wait on a key of the rendezvous store instead, which has no collective timeout. Every rank
bumps a heartbeat counter in the store, so a rank that stops answering can be named when a collective fails.
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

import torch
import torch.distributed as dist
import torch.nn as nn

from utils.errors import UserError

LONG_WAIT = datetime.timedelta(hours=12)  # for work of unknown length (a million-image label cache)
HEARTBEAT_SECONDS = 2.0
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
        return DistInfo(rank=-1, local_rank=-1, world_size=1, restart_count=restart_count, run_id=run_id,
                        launcher_started=started)
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

class _Group:
    """What this process keeps about its process group: the store (prefixed per restart round) and heartbeat."""

    store: dist.Store | None = None
    heartbeat_stop: threading.Event | None = None
    waits = 0  # store waits so far; every rank makes the same ones in the same order


def _open_store(info: DistInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store under a prefix of this restart round.

    torch.distributed.run keeps one store across restarts; keys of the dead round (gloo's peer addresses among
    them) would otherwise be read by the new one, which then fails to connect.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    hosts = not agent_serves and info.rank == 0
    store = dist.TCPStore(host, port, world_size=info.world_size, is_master=hosts, timeout=timeout,
                          wait_for_workers=False, multi_tenant=hosts)
    return dist.PrefixStore(f"yolo-train/round-{info.restart_count}", store)


def init_process_group(device: torch.device, info: DistInfo, timeout_minutes: float = 10.0) -> None:
    """Join the process group (NCCL for CUDA devices, gloo for CPU); collectives time out after ``timeout_minutes``."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _open_store(info, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout)
    _Group.store, _Group.waits = store, 0
    _start_heartbeat(store, info.rank)


def destroy_process_group() -> None:
    if _Group.heartbeat_stop is not None:
        _Group.heartbeat_stop.set()
        _Group.heartbeat_stop = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _Group.store = None


def _store() -> dist.Store:
    """The store of this process group (ours, or the default one when the group was made elsewhere, e.g. in tests)."""
    return _Group.store if _Group.store is not None else dist.distributed_c10d._get_default_store()


def _start_heartbeat(store: dist.Store, rank: int) -> None:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(Exception):  # a store that went away is diagnosed where it matters
                store.add(f"heartbeat/{rank}", 1)

    store.add(f"heartbeat/{rank}", 1)
    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    _Group.heartbeat_stop = stop


def silent_ranks(world_size: int, seconds: float = 3 * HEARTBEAT_SECONDS) -> list[int] | None:
    """Ranks whose heartbeat did not advance within ``seconds``; None when the store itself cannot be reached."""
    try:
        store = _store()
        before = [store.add(f"heartbeat/{r}", 0) for r in range(world_size)]
        time.sleep(seconds)
        after = [store.add(f"heartbeat/{r}", 0) for r in range(world_size)]
    except Exception:  # the store's host is gone or frozen: any error of the client means that
        return None
    return [r for r in range(world_size) if after[r] == before[r]]


def describe_failure(error: BaseException, info: DistInfo) -> str:
    """One line for a collective that failed: which rank went missing, or that the store is unreachable."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    missing = silent_ranks(info.world_size)
    if missing is None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        who = f"the rendezvous store at {where} does not answer (its node went missing)"
    elif missing:
        who = f"rank(s) {', '.join(map(str, missing))} stopped answering"
    else:
        who = "every rank still answers"
    return f"rank {info.rank}: a collective failed ({first}); {who}; exiting so the launcher can restart the group"


# ---- waiting without a collective timeout ---------------------------------------------------------------

def _next_key(tag: str) -> str:
    _Group.waits += 1
    return f"wait/{tag}/{_Group.waits}"


@contextlib.contextmanager
def local_rank_zero_first(info: DistInfo) -> Iterator[None]:
    """Run the block on local rank 0 of each machine first; the machine's other ranks enter once it has left.

    They wait on a store key (no collective timeout: building a large cache may take hours). If local rank 0
    fails in the block, the others stop with one line instead of waiting for ever.
    """
    if not info.is_distributed or not dist.is_initialized():
        yield
        return
    key = _next_key(f"node-{info.rank - info.local_rank}")
    store = _store()
    if info.local_rank != 0:
        store.wait([key], LONG_WAIT)
        if store.get(key) != b"ok":
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
    """Rank 0's ``decision`` for every rank; the others wait for it on the store however long rank 0 takes."""
    if not info.is_distributed:
        return decision or ""
    key = _next_key("decision")
    store = _store()
    if info.rank == 0:
        store.set(key, decision or "")
        return decision or ""
    store.wait([key], LONG_WAIT)
    return store.get(key).decode()


# ---- collectives and models ------------------------------------------------------------------------------

def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (a no-op outside a process group); returns it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's ``obj`` on every rank (pickled between our own processes only)."""
    if not info.is_distributed:
        return obj
    box = [obj if info.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def de_parallel(model: nn.Module) -> nn.Module:
    """The bare model inside a DataParallel/DistributedDataParallel wrapper."""
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) else model


# ---- the ranks of one node ---------------------------------------------------------------------------------

class _NodeWaits:
    count = 0  # node barriers so far; every rank of a node makes the same ones in the same order


def node_index(info: DistInfo) -> int:
    """This machine's number: torch.distributed.run gives each node a contiguous run of LOCAL_WORLD_SIZE ranks."""
    return (info.rank - info.local_rank) // max(info.local_world_size, 1)


def node_barrier(info: DistInfo, tag: str, poll_seconds: float = 0.02) -> None:
    """Wait until every rank of this node has arrived (other nodes are not involved).

    A store counter, not a collective: ranks of other nodes need not call it, and a long fill (a large image
    cache) is not cut short by the collective timeout.
    """
    if not info.is_distributed or not dist.is_initialized() or info.local_world_size <= 1:
        return
    _NodeWaits.count += 1
    key = f"node/{node_index(info)}/{tag}/{_NodeWaits.count}"
    store = _store()
    store.add(key, 1)
    deadline = time.monotonic() + LONG_WAIT.total_seconds()
    while store.add(key, 0) < info.local_world_size:
        if time.monotonic() > deadline:
            raise UserError(f"rank {info.rank}: the other ranks of this node did not reach '{tag}'")
        time.sleep(poll_seconds)


def node_decides(info: DistInfo, tag: str, decision: str) -> str:
    """Local rank 0's ``decision`` on every rank of this node (so that they all take the same branch)."""
    if not info.is_distributed or not dist.is_initialized() or info.local_world_size <= 1:
        return decision
    _NodeWaits.count += 1
    key = f"node/{node_index(info)}/{tag}/{_NodeWaits.count}/decision"
    store = _store()
    if info.local_rank == 0:
        store.set(key, decision)
        return decision
    store.wait([key], LONG_WAIT)
    return store.get(key).decode()
