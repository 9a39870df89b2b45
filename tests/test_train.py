"""train.py end to end on generated data: single process, DDP on CPU (gloo), resume, failures."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port, main_on_ranks, run_forked

import train
from utils.checkpoint import load_checkpoint
from utils.engine.timing import TIME_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
# Small and fast: yolov5n at 64 px on 16 images of 96 px, batch 8, no AutoAnchor.
TINY = ["--imgsz", "64", "--batch-size", "8", "--workers", "0", "--noautoanchor", "--device", "cpu"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def train_args(data: Path, project: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--project", str(project), "--name", "exp", *TINY, *extra]


def train_cmd(
    data: Path, project: Path, *extra: str, nproc: int = 0, nnodes: int = 1, node_rank: int = 0, port: int | None = None
) -> list[str]:
    args = ["train.py", *train_args(data, project, *extra)]
    if not nproc:
        return [sys.executable, *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}"]
    if nnodes > 1:
        launcher += [f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    else:
        launcher += ["--standalone"]
    return [*launcher, *args]


def results_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "results.csv") as f:
        return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]


def results_only(row: dict[str, str]) -> dict[str, str]:
    """A results.csv row without the time split (measurements that differ from run to run)."""
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over the trainable tensors (weights and biases, not BN statistics)."""
    names = [k for k in b if k.endswith((".weight", ".bias"))]
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in names])
    return float(diff.norm() / torch.cat([b[k].double().flatten() for k in names]).norm())


@pytest.mark.slow
def test_sync_bn_ddp_matches_single_process_with_same_global_batch(rectangles_yaml, tmp_path) -> None:
    # Losses divide by the positives of the global batch (all-reduced), so with SyncBN a step on 2 ranks is
    # the step of 1 process on the same global batch up to float summation order (issue 19). The rectangles
    # spread 1-3 boxes per image, so the ranks' positives differ in every step.
    common = (
        "--epochs",
        "2",
        "--noplots",
        "--noval",
        "--deterministic",
        "--no-amp",
        "--optimizer",
        "SGD",
        "--seed",
        "3",
    )
    # Both in processes of one thread (the kernels' summation order depends on the thread count).
    single = run_forked([(train.main, (train_args(rectangles_yaml, tmp_path / "single", *common, "--sync-bn"),), {})])
    assert single == [0]  # --sync-bn in one process: exact BN statistics
    codes, outputs = main_on_ranks(
        train.main, train_args(rectangles_yaml, tmp_path / "synced", *common, "--sync-bn"), 2, tmp_path
    )
    assert codes == [0, 0], "".join(outputs)[-3000:]
    reference = weights(tmp_path / "single/exp/weights/last.pt")
    synced_diff = relative_l2(weights(tmp_path / "synced/exp/weights/last.pt"), reference)
    assert synced_diff <= 2e-5
    loss_columns = ("train/box_loss", "train/obj_loss", "train/cls_loss")
    for one, two in zip(results_rows(tmp_path / "single/exp"), results_rows(tmp_path / "synced/exp"), strict=True):
        assert [f"{float(one[c]):.4g}" for c in loss_columns] == [f"{float(two[c]):.4g}" for c in loss_columns]


def _two_nodes(data: Path, project: Path, *extra: str) -> list[subprocess.Popen]:
    """Nodes 0 and 1 of a 2-node run on loopback, one rank each, training long; output in project/node{0,1}.log."""
    project.mkdir(parents=True)
    port, procs = free_port(), []
    for node in (0, 1):
        with open(project / f"node{node}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    train_cmd(
                        data,
                        project,
                        "--epochs",
                        "50",
                        "--noplots",
                        "--noval",
                        *extra,
                        nproc=1,
                        nnodes=2,
                        node_rank=node,
                        port=port,
                    ),
                    cwd=ROOT,
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


@pytest.mark.slow
def test_a_frozen_node_and_a_node_whose_launcher_is_killed_each_make_the_other_node_exit_naming_it(
    rectangles_yaml, tmp_path
) -> None:
    # Two 2-node runs at once, so that their waits overlap. In the first, node 1 freezes: it keeps its sockets open,
    # so nothing fails fast and only the collective timeout (--dist-timeout 0.15: 9 s) can end node 0's wait. In the
    # second, only node 1's launcher is killed -9 (as the OOM killer would): its rank must not train on unsupervised
    # but end with it; its sockets close, so node 0 needs no timeout to notice.
    frozen = _two_nodes(rectangles_yaml, tmp_path / "frozen", "--dist-timeout", "0.15")
    killed = _two_nodes(rectangles_yaml, tmp_path / "killed")
    stopped, orphan = [], None
    try:
        _wait_for(tmp_path / "frozen/exp/weights/last.pt", frozen[0])
        worker = subprocess.run(["pgrep", "-f", "-P", str(frozen[1].pid), "train.py"], capture_output=True, text=True)
        stopped = [frozen[1].pid, *map(int, worker.stdout.split())]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t_frozen = time.time()
        _wait_for(tmp_path / "killed/exp/weights/last.pt", killed[0])
        orphan = rank_pid(killed[1], 1)
        os.kill(killed[1].pid, signal.SIGKILL)
        t_killed = time.time()
        killed[0].wait(timeout=120)
        waited_killed = time.time() - t_killed
        deadline = time.time() + 10  # the kernel's SIGTERM arrives at once; the rank may take a moment to go
        while _running(orphan):
            assert time.time() < deadline, f"rank 1 (pid {orphan}) outlived its killed launcher"
            time.sleep(0.1)
        frozen[0].wait(timeout=120)
        waited_frozen = time.time() - t_frozen
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if orphan is not None and _running(orphan):
            os.kill(orphan, signal.SIGKILL)
        for proc in (*frozen, *killed):
            if proc.poll() is None:
                kill_run(proc)
            proc.wait(timeout=30)
    # Frozen: the 9 s timeout, the heartbeat check and the launcher's own shutdown. Killed: the default --dist-timeout
    # is 10 minutes, so this is no timeout.
    assert waited_frozen < 9 + 60 and waited_killed < 60, (waited_frozen, waited_killed)
    for name, node0 in (("frozen", frozen[0]), ("killed", killed[0])):
        output = (tmp_path / name / "node0.log").read_text()
        assert "world size 2" in output  # the two nodes trained together until the freeze or the kill
        assert node0.returncode != 0, name
        assert "rank 0: a collective failed" in output and "rank(s) 1 stopped answering" in output, output[-3000:]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's new parent may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, "training ended before the checkpoint appeared"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# Not anchored at a line start: rank 0's progress bar (stderr, carriage returns) shares the file with the log.
BATCH_LINE = re.compile(r"rank (\d+) epoch (\d+) batch (\d+): ([^\r\n]*)")


def files_trained_on(output: str, epoch: int, batches: range | None = None) -> list[str]:
    """The image files of ``epoch``'s batches (all ranks) in a YOLO_LOG_LEVEL=DEBUG log."""
    return [
        name
        for _, e, b, names in BATCH_LINE.findall(output)
        if int(e) == epoch and (batches is None or int(b) in batches)
        for name in names.split()
    ]


def rank_pid(proc: subprocess.Popen, rank: int) -> int:
    """The process id of global rank ``rank`` among a launcher's workers (from their environment)."""
    workers = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train.py"], capture_output=True, text=True)
    for pid in map(int, workers.stdout.split()):
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
    raise AssertionError(f"no rank {rank} among the workers of {proc.pid}")


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher started with start_new_session and its ranks (which run in sessions of their own)."""
    ranks = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train.py"], capture_output=True, text=True)
    for pid in [int(p) for p in ranks.stdout.split()]:
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # the launcher may have ended already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_a_2_rank_run_cut_mid_epoch_resumes_on_1_and_on_4_ranks_with_the_unseen_samples_and_on_3_at_the_next_epoch(
    rectangles96_yaml, tmp_path, monkeypatch
) -> None:
    # Global batch 32 on 96 images: 3 batches per epoch, 2 per optimizer step (an explicit optimizer accumulates
    # up to the nominal batch of 64), so there is a step boundary inside each epoch; --save-steps 1 writes a
    # checkpoint there. At 32 px: which samples each rank sees does not depend on the size.
    rectangles_yaml = rectangles96_yaml
    common = (
        "--epochs",
        "2",
        "--noplots",
        "--noval",
        "--batch-size",
        "32",
        "--save-steps",
        "1",
        "--optimizer",
        "AdamW",
        "--imgsz",
        "32",
    )
    env = dict(_env(), YOLO_LOG_LEVEL="DEBUG")
    log = tmp_path / "cut.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            train_cmd(rectangles_yaml, tmp_path / "cut", *common, nproc=2),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        last, snapshot = tmp_path / "cut/exp/weights/last.pt", tmp_path / "snapshot.pt"
        try:
            deadline = time.time() + 240
            while True:  # the first checkpoint written inside an epoch; copied at once (later ones replace it)
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                if last.exists():
                    shutil.copy(last, snapshot)
                    if load_checkpoint(snapshot)["mid_epoch"]:
                        break
                time.sleep(0.02)
            # Rank 1 is killed while rank 0 may be writing the next checkpoint: the launcher (no restarts) ends the
            # other rank and exits with an error, leaving no rank behind.
            ranks = [rank_pid(proc, 0), rank_pid(proc, 1)]
            os.kill(ranks[1], signal.SIGKILL)
            assert proc.wait(timeout=120) != 0
            deadline = time.time() + 10
            while any(_running(pid) for pid in ranks):
                assert time.time() < deadline, f"ranks left after the launcher ended: {ranks}"
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                kill_run(proc)
    left = load_checkpoint(last)  # what a run killed mid-write leaves is complete, never half-written
    assert left["optimizer"] is not None and left["model"].keys() == load_checkpoint(snapshot)["model"].keys()
    mid = load_checkpoint(snapshot)["mid_epoch"]
    epoch, cut = int(mid["epoch"]), int(mid["batch"])
    assert cut == 2
    seen_before_cut = files_trained_on(log.read_text(), epoch, range(cut))
    assert len(seen_before_cut) == 32 * cut

    # The resumed runs are forked from this process (the cut one above is the launched run).
    monkeypatch.setenv("YOLO_LOG_LEVEL", "DEBUG")
    headers = set()
    for ranks in (1, 4):  # --epochs: only the cut epoch, which is what these check
        resumed_last = tmp_path / f"on{ranks}/exp/weights/last.pt"
        resumed_last.parent.mkdir(parents=True)
        shutil.copy(snapshot, resumed_last)
        codes, outputs = main_on_ranks(
            train.main, ["--resume", str(resumed_last), "--epochs", str(epoch + 1)], ranks, tmp_path / f"logs{ranks}"
        )
        output = "".join(outputs)
        assert codes == [0] * ranks, output[-3000:]
        assert f"Resuming training at batch {cut} of epoch {epoch}" in output
        assert {int(r) for r, *_ in BATCH_LINE.findall(output)} == set(range(ranks))
        # The rest of the cut epoch is exactly the samples not yet seen: every image once over the epoch.
        epoch_files = seen_before_cut + files_trained_on(output, epoch)
        assert sorted(epoch_files) == sorted(p.name for p in (rectangles_yaml.parent / "images/train").iterdir())
        assert load_checkpoint(resumed_last)["epoch"] == epoch
        assert sorted(p.name for p in resumed_last.parents[2].iterdir()) == ["exp"]
        # The time split: the same columns at any number of ranks, and the slowest rank one of these.
        (row,) = results_rows(resumed_last.parents[1])
        assert list(row)[-len(TIME_COLUMNS) :] == list(TIME_COLUMNS) and int(float(row["time/slowest_rank"])) < ranks
        headers.add(tuple(row))
    assert len(headers) == 1

    # 3 ranks cannot split the global batch of 32: one line says so, the cut epoch is left, the next one trained.
    resumed_last = tmp_path / "on3/exp/weights/last.pt"
    resumed_last.parent.mkdir(parents=True)
    shutil.copy(snapshot, resumed_last)
    codes, outputs = main_on_ranks(
        train.main, ["--resume", str(resumed_last), "--epochs", str(epoch + 2)], 3, tmp_path / "logs3"
    )
    output = "".join(outputs)
    assert codes == [0] * 3, output[-3000:]
    assert "the global batch 32 cannot be split over 3 ranks: continuing with 30 from the next epoch boundary" in output
    assert not files_trained_on(output, epoch) and files_trained_on(output, epoch + 1)
    assert load_checkpoint(resumed_last)["epoch"] == epoch + 1


EPOCHS = 3  # a kill inside epoch 0 (the launcher restarts), one inside a later epoch (resumed with --resume)


@pytest.mark.slow
def test_a_launcher_restart_and_a_kill_inside_an_epoch_end_as_an_uninterrupted_run_in_one_tracker_run(
    rectangles_yaml, tmp_path, monkeypatch, request
) -> None:
    """A 2-rank run launched with --max-restarts 1 and MLflow (a real server), W&B (offline) and TensorBoard: one
    rank killed (the launcher restarts the group, which resumes by itself), then the whole run killed inside an
    epoch and resumed with --resume. Its weights equal an uninterrupted run's, results.csv and each tracker hold
    every epoch once, in one MLflow run and one W&B run id, with the weights and results.csv; then the MLflow
    server is killed under a logging run, which goes on at its pace with one warning."""
    import mlflow  # noqa: F401  (test requirements: missing, the test fails rather than skips)
    import wandb  # noqa: F401
    from tracker_servers import (
        MLflowServer,
        check_mlflow_run,
        check_wandb_files,
        orphaned_wandb_services,
        run_through_a_stopped_server,
        tracker_environment,
        wandb_services,
    )

    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider: the store is migrated anew
    server = MLflowServer(tmp_path / "mlflow", template=cache.mkdir("mlflow-store") if cache else None)  # starts now
    services_before = wandb_services()
    try:
        # yolo26n: its one-to-one loss weight follows the epoch, so a restart that lost its place would show.
        # --save-steps 1: a checkpoint inside every epoch (2 steps each).
        common = (
            "--cfg",
            "yolo26n.yaml",
            "--epochs",
            str(EPOCHS),
            "--noplots",
            "--noval",
            "--deterministic",
            "--imgsz",
            "32",
            "--save-steps",
            "1",
        )
        # The uninterrupted run is forked from this process (while the server starts), with plots (they change
        # nothing it computes); the interrupted one launched.
        straight = [a for a in common if a != "--noplots"]
        codes, outputs = main_on_ranks(
            train.main, train_args(rectangles_yaml, tmp_path / "straight", *straight), 2, tmp_path / "logs"
        )
        assert codes == [0, 0], "".join(outputs)[-3000:]
        assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["exp"]  # rank 1 made no exp2
        _check_a_finished_run(tmp_path / "straight/exp")
        env = {**_env(), **tracker_environment(tmp_path, server.wait_ready())}
        for key, value in env.items():  # the resumed run is forked from here
            monkeypatch.setenv(key, value)
        import mlflow  # noqa: F401  (imported once here: the forked resume starts with it)
        import wandb  # noqa: F401

        cmd = train_cmd(
            rectangles_yaml, tmp_path / "restarted", *common, "--loggers", "tensorboard", "mlflow", "wandb", nproc=2
        )
        at = cmd.index("--standalone")  # the elastic form (--nnodes MIN:MAX, a c10d rendezvous), as on a cluster
        cmd[at : at + 1] = [
            "--max-restarts=1",
            "--nnodes=1:2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=elastic-job",
            "--rdzv-conf=last_call_timeout=1",
        ]
        run_dir = tmp_path / "restarted/exp"
        last, snapshot = run_dir / "weights/last.pt", tmp_path / "snapshot.pt"
        # Its data loading waits for its first trackers to start (tests/gated_train.py): the kills below must find
        # tracker runs to continue, and on a loaded machine they can start later than this tiny run would end.
        cmd[cmd.index("train.py")] = str(Path(__file__).with_name("gated_train.py"))
        env.update(GATE_TRACKERS_FILE=str(run_dir / "trackers.yaml"), GATE_TRACKERS="mlflow,wandb")
        with open(tmp_path / "launched.log", "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                _wait_for(last, proc)  # inside epoch 0: the launcher restarts the group, which resumes from it
                os.kill(rank_pid(proc, 1), signal.SIGKILL)
                # Killed inside an epoch once the restarted group has written a checkpoint (naming the tracker runs).
                mid = _snapshot_inside_an_epoch(
                    last,
                    snapshot,
                    proc,
                    with_trackers=("mlflow", "wandb"),
                    after=(tmp_path / "launched.log", "restart 1 of launcher run"),
                )
            finally:
                kill_run(proc)
        output = (tmp_path / "launched.log").read_text()
        assert "restart 1 of launcher run elastic-job" in output, output[-3000:]
        ids = load_checkpoint(snapshot)["trackers"]
        shutil.copy(snapshot, last)  # as the kill left it (the run may have gone on past the copy)
        # The epoch the kill was inside, as if its row had been written before the kill: trained again, written once.
        rows = (run_dir / "results.csv").read_text().splitlines()
        if not any(int(r.split(",")[0]) == mid for r in rows[1:]):
            (run_dir / "results.csv").write_text(
                "\n".join([*rows, rows[-1].replace(rows[-1].split(",")[0], f"{mid:>20}", 1)]) + "\n"
            )
        (run_dir / "trackers.yaml").unlink()  # lost: the checkpoint keeps the tracker runs' ids too

        codes, outputs = main_on_ranks(train.main, ["--resume", str(last)], 2, tmp_path / "logs_resumed")
        assert codes == [0, 0], "".join(outputs)[-3000:]
        assert f"Resuming training at batch 1 of epoch {mid}" in outputs[0]
        assert [int(r["epoch"]) for r in results_rows(run_dir)] == list(range(EPOCHS))
        assert max_difference(weights(last), weights(tmp_path / "straight/exp/weights/last.pt")) == 0.0
        now = yaml.safe_load((run_dir / "trackers.yaml").read_text())
        assert [now[k]["run_id"] for k in ("mlflow", "wandb")] == [ids[k]["run_id"] for k in ("mlflow", "wandb")]
        check_mlflow_run(
            server.uri,
            "restarted",
            ids["mlflow"]["run_id"],
            run_dir / "results.csv",
            {"cfg": "yolo26n.yaml", "epochs": str(EPOCHS), "hyp/lr0": "0.01"},
            {"results.csv", "weights/best.pt", "weights/last.pt"},
        )
        check_wandb_files(run_dir, ids["wandb"]["run_id"], run_dir / "results.csv", (2, 3))  # restarted, resumed
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        assert [e.step for e in events.Scalars("train/l1_loss")] == list(range(EPOCHS))

        # The server stops in the middle of a run: training goes on at its pace, with one warning.
        for key, value in {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
        }.items():  # a blocking call would wait >= 2 s
            monkeypatch.setenv(key, value)
        slowest, warnings = run_through_a_stopped_server(server, tmp_path / "runs/stopped")
        assert slowest < 0.5, slowest
        assert len(warnings) == 1 and warnings[0].startswith("WARNING MLflow stopped for the rest of this run ("), (
            warnings
        )
    finally:
        left = server.stop()
    assert not left, f"the MLflow server left processes behind: {left}"
    assert not orphaned_wandb_services(services_before)


def _check_a_finished_run(run_dir: Path) -> None:
    """Its files and plots, finite losses that fell, and a last.pt that can resume (optimizer and EMA kept)."""
    rows = results_rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    losses = [sum(float(v) for k, v in r.items() if k.startswith("train/")) for r in rows]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    for name in ("weights/last.pt", "weights/best.pt", "opt.yaml", "hyp.yaml", "results.png", "train_batch0.jpg"):
        assert (run_dir / name).exists(), name
    ckpt = load_checkpoint(run_dir / "weights/last.pt")
    assert ckpt["epoch"] == EPOCHS - 1 and ckpt["optimizer"] is not None and ckpt["ema"] is not None


def _snapshot_inside_an_epoch(
    last: Path, snapshot: Path, proc: subprocess.Popen, with_trackers: tuple[str, ...], after: tuple[Path, str]
) -> int:
    """Copy ``last`` as soon as it is a checkpoint written inside an epoch that names these trackers' runs, and
    written after ``after``'s log file shows its text; its epoch."""
    deadline = time.time() + 240
    log, text = after
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.time() < deadline, f"no '{text}' in {log}"
        time.sleep(0.05)
    seen = last.stat().st_mtime_ns if last.exists() else None  # written before: not this one
    while time.time() < deadline:
        assert proc.poll() is None, "the launched run ended before a checkpoint inside an epoch named its trackers"
        stamp = last.stat().st_mtime_ns if last.exists() else None
        if stamp is not None and stamp != seen:
            seen = stamp
            shutil.copy(last, snapshot)
            ckpt = load_checkpoint(snapshot)
            if ckpt["mid_epoch"] and set(with_trackers) <= set(ckpt["trackers"]):
                return int(ckpt["mid_epoch"]["epoch"])
        time.sleep(0.02)
    raise AssertionError("no checkpoint inside an epoch named the trackers' runs")
