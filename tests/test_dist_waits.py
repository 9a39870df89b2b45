"""Store waits between ranks are bounded by the progress of the rank waited for (issue 30, defect 5), and a
failed collective is recognised by its exception type."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from conftest import fork_ranks, rank_jobs, run_forked

from utils import distributed
from utils.distributed import (
    CollectiveError,
    DistInfo,
    WaitAbandoned,
    collective,
    collective_failure,
    dist_info,
    init_process_group,
    node_barrier,
    rank_zero_decides,
)

TIMEOUT_MINUTES = 2 / 60  # --dist-timeout of 2 s: heartbeats every 0.5 s


def _record(out: str, rank: int, **values) -> None:
    with open(f"{out}.{rank}", "w") as f:
        json.dump(values, f)


def _silent_rank(rank: int, out: str, mode: str) -> int:
    info = dist_info()
    init_process_group(torch.device("cpu"), info, TIMEOUT_MINUTES)
    # A live rank busy for longer than the timeout (a long label-cache build) is waited for.
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(2.6)
    node_barrier(info, "long but live")
    waited_live = time.monotonic() - t0
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        distributed._Group.heartbeat_stop.set()  # frozen: alive, but no progress
        time.sleep(4)  # rank 0 gives up after 2 s
        os._exit(0)
    t0 = time.monotonic()
    try:
        node_barrier(info, "filled")
    except WaitAbandoned as e:
        _record(out, rank, waited_live=waited_live, error=str(e), seconds=time.monotonic() - t0)
        os._exit(1)
    os._exit(0)


@pytest.mark.slow
def test_a_rank_that_dies_or_stops_beating_in_a_node_barrier_is_named_within_the_timeout(tmp_path) -> None:
    modes = {"dies": [1, 3], "freezes": [1, 0]}  # two worlds side by side: they mostly wait
    codes = run_forked(
        [job for mode in modes for job in rank_jobs(_silent_rank, 2, str(tmp_path / mode), mode)], timeout=60
    )
    assert codes == [code for expected in modes.values() for code in expected]
    for mode in modes:
        report = json.loads(open(f"{tmp_path / mode}.0").read())
        assert report["waited_live"] >= 2.5  # not given up while rank 1 was busy but beating
        assert report["error"].startswith(
            "rank 0: gave up waiting at 'filled (node barrier)' after 2 s without "
            "progress from rank 1 (its heartbeat stopped"
        ), report
        assert 2 <= report["seconds"] < 6, report


def _mismatched(rank: int, out: str) -> int:
    info = dist_info()
    init_process_group(torch.device("cpu"), info, TIMEOUT_MINUTES)
    t0 = time.monotonic()
    try:
        if rank == 0:
            node_barrier(info, "a")  # rank 1 never comes here: it waits for a decision rank 0 never makes
        else:
            rank_zero_decides(info, None)
    except WaitAbandoned as e:
        _record(out, rank, error=str(e), seconds=time.monotonic() - t0)
        time.sleep(1)  # rank 0 hosts the store: let rank 1 read it before it goes
        os._exit(1)
    os._exit(0)


def test_ranks_whose_waits_do_not_match_give_up_instead_of_hanging(tmp_path) -> None:
    out = str(tmp_path / "mismatch")
    assert fork_ranks(_mismatched, 2, out, timeout=60) == [1, 1]
    for rank, other, where in ((0, 1, "a (node barrier)"), (1, 0, "rank 0's decision")):
        report = json.loads(open(f"{out}.{rank}").read())
        assert report["error"].startswith(
            f"rank {rank}: gave up waiting at '{where}' after 2 s without progress from rank {other} (it waits at "
        ), report
        assert "the ranks' waits do not match" in report["error"] and report["seconds"] < 6


def test_a_failed_collective_is_recognised_by_its_type_not_its_words(monkeypatch) -> None:
    info = DistInfo(rank=0, local_rank=0, world_size=2)
    silent: list[int] = []
    monkeypatch.setattr(distributed, "silent_ranks", lambda world_size: silent)
    # PyTorch's distributed errors count whatever they say.
    assert collective_failure(dist.DistNetworkError("anything"), info) is not None
    assert collective_failure(CollectiveError("anything"), info) is not None
    # Other errors do not, whatever they say.
    assert collective_failure(ValueError("gloo connection timed out"), info) is None
    # In a collective of ours, gloo's bare RuntimeError becomes a CollectiveError.
    try:
        with collective("all_reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer")
    except CollectiveError as e:
        assert "all_reduce" in str(e)
    else:
        raise AssertionError("not converted")
    # gloo's bare RuntimeError from inside DDP counts when the group is broken (a rank stopped beating), not else.
    assert collective_failure(RuntimeError("Connection reset by peer"), info) is None
    silent.append(1)
    line = collective_failure(RuntimeError("Connection reset by peer"), info)
    assert line.startswith("rank 0: a collective failed (Connection reset by peer); rank(s) 1 stopped answering")
    assert collective_failure(RuntimeError("gloo timed out"), DistInfo(rank=-1, local_rank=-1, world_size=1)) is None


def _waiting_quietly(rank: int, out: str) -> int:
    os.dup2(os.open(f"{out}.{rank}", os.O_WRONLY | os.O_CREAT), 2)  # the C++ store client writes its warnings here
    info = dist_info()
    init_process_group(torch.device("cpu"), info, TIMEOUT_MINUTES)
    if rank == 0:
        time.sleep(1.0)  # rank 1 waits a second for the decision, as it waits for rank 0's validation
    decision = rank_zero_decides(info, "go" if rank == 0 else None)
    node_barrier(info, "end")
    return 0 if decision == "go" else 1


def test_a_rank_waiting_on_the_store_writes_no_warnings(tmp_path) -> None:
    """Issue 49 item 12: store waits that time out and try again each made the store client write a
    ``waitForInput ... likely a timeout`` warning, dozens per 2-process run."""
    out = str(tmp_path / "stderr")
    assert fork_ranks(_waiting_quietly, 2, out, timeout=60) == [0, 0]
    for rank in range(2):
        text = open(f"{out}.{rank}").read()
        assert "waitForInput" not in text and "timeout" not in text.lower(), text[-2000:]
