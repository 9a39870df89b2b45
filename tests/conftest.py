"""Make the repository root importable; shared generated-data fixtures."""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import socket
import sys
import tarfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


COLOURS = [(40, 40, 220), (220, 160, 40), (40, 200, 40), (200, 40, 200), (20, 220, 220)]  # BGR, one per class


def write_rectangles_dataset(
    root: Path,
    n_train: int = 16,
    n_val: int = 8,
    size: int = 96,
    seed: int = 0,
    n_classes: int = 2,
    width: int | None = None,
) -> Path:
    """A tiny YOLO-format dataset of coloured rectangles and its data YAML; returns the YAML path.

    Images are ``size`` high and ``width`` (default ``size``) wide; up to 5 classes, one colour each.
    """
    rng = np.random.default_rng(seed)
    colours = COLOURS[:n_classes]
    width = width or size
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = np.full((size, width, 3), rng.integers(90, 160), np.uint8)
            rows = []
            for _ in range(int(rng.integers(1, 4))):
                cls = int(rng.integers(0, n_classes))
                w, h = int(rng.integers(width // 6, width // 2)), int(rng.integers(size // 6, size // 2))
                x1, y1 = int(rng.integers(0, width - w)), int(rng.integers(0, size - h))
                cv2.rectangle(img, (x1, y1), (x1 + w - 1, y1 + h - 1), colours[cls], -1)
                rows.append(
                    f"{cls} {(x1 + w / 2) / width:.6f} {(y1 + h / 2) / size:.6f} {w / width:.6f} {h / size:.6f}"
                )
            cv2.imwrite(str(root / "images" / split / f"{i:04d}.jpg"), img)
            (root / "labels" / split / f"{i:04d}.txt").write_text("\n".join(rows) + "\n")
    yaml_file = root / "rectangles.yaml"
    names = "".join(
        f"  {k}: {name}\n" for k, name in enumerate(["red", "blue", "green", "magenta", "yellow"][:n_classes])
    )
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}")
    return yaml_file


def write_video(path: Path, frames: int) -> Path:
    """A small mp4 (96x64, 10 fps) of a red rectangle moving right by 6 px a frame."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10, (96, 64))
    for i in range(frames):
        frame = np.full((64, 96, 3), 120, np.uint8)
        cv2.rectangle(frame, (5 + 6 * i, 10), (45 + 6 * i, 50), (40, 40, 220), -1)
        writer.write(frame)
    writer.release()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked(target: Callable[..., int | None], args: tuple, env: dict[str, str]) -> None:
    # OpenMP's thread pool does not survive fork: a forked child that enters a parallel region hangs. One
    # thread per process is also what the launched tests give each process (OMP_NUM_THREADS=1).
    torch.set_num_threads(1)
    for name in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        os.environ.pop(name, None)
    os.environ.update(env)
    sys.exit(target(*args) or 0)


def start_forked(target: Callable[..., int | None], args: tuple, env: dict[str, str]) -> BaseProcess:
    """``target(*args)`` in a forked process of one thread with ``env`` set, started (see ``run_forked``)."""
    proc = multiprocessing.get_context("fork").Process(target=_forked, args=(target, args, env))
    proc.start()
    return proc


def run_forked(jobs: list[tuple[Callable[..., int | None], tuple, dict[str, str]]], timeout: float = 120) -> list[int]:
    """Run each ``(target, args, env)`` as ``target(*args)`` in a forked process of one thread, all at once;
    returns their exit codes (``target``'s return value, 1 if it raised).

    Forked from this process, a job starts without importing torch again: several seconds less per process
    than a launched one on a small machine. Tests of the launcher and of start-up launch real processes.
    """
    procs = [start_forked(*job) for job in jobs]
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, proc in enumerate(procs) if proc.exitcode is None]
    for i in hung:
        procs[i].kill()
        procs[i].join()
    assert not hung, f"process(es) {hung} still running after {timeout} s"
    return [proc.exitcode for proc in procs]


def rank_jobs(target: Callable[..., int | None], world_size: int, *args) -> list[tuple]:
    """``run_forked``'s jobs for ``target(rank, *args)`` on the ranks of one world (env:// with the variables
    torch.distributed.run sets, on a port of its own): several worlds can run side by side."""
    port = str(free_port())
    return [
        (
            target,
            (rank, *args),
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in range(world_size)
    ]


def fork_ranks(target: Callable[..., int | None], world_size: int, *args, timeout: float = 120) -> list[int]:
    """``target(rank, *args)`` on ``world_size`` forked ranks of one world; returns their exit codes."""
    return run_forked(rank_jobs(target, world_size, *args), timeout)


def _main_writing_to(main: Callable[[list[str]], int], argv: list[str], output: str) -> int:
    from utils.log import LOGGER

    sys.stdout = sys.stderr = open(output, "w", buffering=1)  # what a launcher's log of this rank would hold
    for handler in LOGGER.handlers[:]:  # inherited, bound to this test process's captured stdout
        LOGGER.removeHandler(handler)
    return main(argv)


def main_on_ranks(
    main: Callable[[list[str]], int], argv: list[str], world_size: int, out_dir: Path, timeout: float = 240
) -> tuple[list[int], list[str]]:
    """A script's ``main(argv)`` (train.py's, val.py's) on ``world_size`` forked gloo ranks, as
    ``torch.distributed.run --standalone`` would run it; returns each rank's exit code and output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = [str(out_dir / f"rank{rank}.log") for rank in range(world_size)]
    codes = fork_ranks(lambda rank: _main_writing_to(main, argv, outputs[rank]), world_size, timeout=timeout)
    return codes, [Path(output).read_text() for output in outputs]


@pytest.fixture(scope="session")
def rectangles_yaml(tmp_path_factory) -> Path:
    return write_rectangles_dataset(tmp_path_factory.mktemp("rectangles"))


@pytest.fixture(scope="session")
def rectangles96_yaml(tmp_path_factory) -> Path:
    """96 training images of 64 px (3 batches of 32: a step boundary inside an epoch) and 4 to validate."""
    return write_rectangles_dataset(tmp_path_factory.mktemp("rectangles96"), n_train=96, n_val=4, size=64)


# train.py in this process: yolov5n at 64 px, batch 8, no workers, no AutoAnchor, no plots (later flags override).
TINY_IN_PROCESS = [
    "--imgsz",
    "64",
    "--batch-size",
    "8",
    "--workers",
    "0",
    "--noautoanchor",
    "--device",
    "cpu",
    "--noplots",
]


@pytest.fixture(scope="session")
def finished_run(rectangles_yaml, tmp_path_factory) -> tuple[Path, str]:
    """A finished 1-epoch run (TINY_IN_PROCESS, --noval: yolov5n, AdamW by the automatic choice) made once, in a
    forked process: its weights/last.pt and its log. Tests that resume it copy its folder first."""
    import train

    project = tmp_path_factory.mktemp("finished")
    argv = [
        *TINY_IN_PROCESS,
        "--data",
        str(rectangles_yaml),
        "--project",
        str(project),
        "--name",
        "exp",
        "--epochs",
        "1",
        "--noval",
    ]
    codes, outputs = main_on_ranks(train.main, argv, 1, project / "logs")
    assert codes == [0], outputs[0][-3000:]
    return project / "exp/weights/last.pt", outputs[0]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def train_here(monkeypatch):
    """``go(*args) -> (exit status, log text)``: train.py's main in this process, with TINY_IN_PROCESS first."""
    import train
    from utils.log import LOGGER

    for name in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    handler = _Lines()
    LOGGER.addHandler(handler)
    threads = torch.get_num_threads()

    def go(*args: str) -> tuple[int, str]:
        handler.lines.clear()
        status = train.main([*TINY_IN_PROCESS, *map(str, args)])
        return status, "\n".join(handler.lines)

    yield go
    LOGGER.removeHandler(handler)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def project_logger_at_start():
    from utils.log import LOGGER

    return list(LOGGER.handlers), LOGGER.level, LOGGER.propagate, LOGGER.disabled


@pytest.fixture(autouse=True)
def project_logger_as_found(project_logger_at_start):
    """After every test the ``yolo`` logger is as the session found it: in-process ``main()`` calls (their
    ``setup_logging``), module fixtures and tests add handlers and change its level and ``propagate``; left
    over, a handler outlives its test (pytest's one caplog handler attached to it captures records twice)."""
    from utils.log import LOGGER

    yield
    handlers, level, propagate, disabled = project_logger_at_start
    LOGGER.handlers[:] = handlers
    LOGGER.setLevel(level)
    LOGGER.propagate, LOGGER.disabled = propagate, disabled


@pytest.fixture(autouse=True)
def data_limits_as_found(monkeypatch):
    """``--allow-pipe`` and ``--max-pixels`` reach the data readers through the environment (utils/cli.py:
    apply_data_limits); an in-process ``main()`` or ``run()`` sets them, and no test may inherit another's."""
    from utils.cli import ALLOW_PIPE_ENV, MAX_PIXELS_ENV

    monkeypatch.delenv(ALLOW_PIPE_ENV, raising=False)
    monkeypatch.delenv(MAX_PIXELS_ENV, raising=False)


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # a worker per core: OpenMP threads beyond its share spin on cores the other workers need
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# The suite's longest tests, each starting many processes (launchers, ranks, servers), longest first, as its timed
# runs found them (docs/benchmarks.md, "The test suite's time"). Side by side they oversubscribe the cores and take
# longer together than one after another, so they form one pytest-xdist group (pyproject.toml: --dist loadgroup):
# one worker runs them in this order, first, while the other runs the rest, one test at a time, in collection order.
ONE_AFTER_ANOTHER = (
    "test_a_launcher_restart_and_a_kill_inside_an_epoch_end_as_an_uninterrupted_run_in_one_tracker_run",
    "test_a_host_cut_off_mid_epoch_is_named_by_the_other_and_the_run_resumes_from_the_bucket",
    "test_the_documented_scheduler_jobs_train_one_run_on_two_nodes",
    "test_a_frozen_node_and_a_node_whose_launcher_is_killed_each_make_the_other_node_exit_naming_it",
    "test_a_2_rank_run_cut_mid_epoch_resumes_on_1_and_on_4_ranks_with_the_unseen_samples_and_on_3_at_the_next_epoch",
    "test_a_launcher_restart_continues_its_run_in_the_bucket",
    "test_a_2_rank_run_in_a_bucket_killed_inside_an_epoch_resumes_from_the_bucket_alone_bit_identical",
)
# Then the next longest, so that none of them starts last and runs alone while a core idles.
LONGEST_FIRST = (
    *ONE_AFTER_ANOTHER,
    "test_mypy_finds_nothing_in_the_library",
    "test_short_training_learns_more_with_the_new_defaults_than_with_the_old",
    "test_dry_run_runs_every_part_and_writes_each_result",
    "test_sync_bn_ddp_matches_single_process_with_same_global_batch",
    "test_sigterm_under_the_launcher_stops_both_ranks_at_one_step",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which names each test's group in its id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The longest tests first, then the other slow ones, then the rest; each group in file order. Tests marked
    # traces_with_dynamo after all of them: once torch.compile or torch.export has run in a process, a child forked
    # from it fails at its first backward ("Unable to handle autograd's threading in combination with fork-based
    # multiprocessing"), and many tests fork their ranks. Each worker runs its tests in this order, so none of them
    # forks after such a test.
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple[bool, int, bool]:
        name = getattr(item, "originalname", item.name)  # a parametrized test's function name
        if name in ONE_AFTER_ANOTHER:
            item.add_marker(pytest.mark.xdist_group("one_after_another"))
        dynamo, slow = item.get_closest_marker("traces_with_dynamo"), item.get_closest_marker("slow")
        return dynamo is not None, rank.get(name, len(rank)), slow is None

    items.sort(key=order)


def tar_members(path: Path) -> dict[str, bytes]:
    """A tar file's members, name to bytes."""
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    """A tar file of ``members`` (name to bytes), in that order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# The deploy tests' session fixtures (narrow trained checkpoints per layout, files exported once): shared here so
# that every module that uses them gets the same ones.
from tests.deploy_fixtures import deploy_data, exported_onnx, trained  # noqa: E402, F401

# The object-storage tests' servers (an S3 server shared by the run, a GCS emulator) and buckets.
from tests.storage_fixtures import bucket, gcs, gcs_env, s3_env, s3_server  # noqa: E402, F401


def keep_checkpoints_inside_epoch(monkeypatch, epoch: int) -> list[dict]:
    """Patches the trainer so that every checkpoint it writes inside ``epoch`` (a mid-epoch one) is also kept, as a
    host snapshot, in the list returned."""
    from utils.checkpoint import host_snapshot
    from utils.engine.trainer import Trainer

    kept: list[dict] = []
    checkpoint = Trainer.checkpoint

    def keeping(self, at: int, mid_epoch: dict | None) -> dict:
        ckpt = checkpoint(self, at, mid_epoch)
        if mid_epoch and mid_epoch["epoch"] == epoch:
            kept.append(host_snapshot(ckpt))
        return ckpt

    monkeypatch.setattr(Trainer, "checkpoint", keeping)
    return kept
