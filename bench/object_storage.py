"""The same training run with its folder on local disk and in a bucket of an S3 server on loopback (SeaweedFS, as
tests/s3_server.py starts it): identical weights, and the wall time of each.

    python bench/object_storage.py [--epochs 3] [--imgsz 64] [--pairs 2] [--freeze-s 0]
    python bench/object_storage.py --data ../shared/datasets/coco128.yaml --imgsz 640 --save-steps 0 --workers 2
    python bench/object_storage.py ... --pin --alternate   # the server on its own CPUs; bucket first every 2nd pair

Each pair runs train.py as a fresh process twice, by default on generated data (yolov5n, --save-steps 1 so that a
checkpoint is uploaded after every optimizer step; ``--data`` trains on a dataset of yours instead, and
``--save-steps 0`` writes checkpoints at epoch ends only, as a run does by default): --project on local disk, then
--project s3://.... Prints each run's wall
time, the ratio (bucket / local), whether last.pt's weights are equal bit for bit, and each phase of the run
(utils/engine/phases.py) as local / bucket seconds: on a busy machine the wall times drift, the phases show where
the bucket's time goes. ``--freeze-s N`` stops the
server (SIGSTOP) for N seconds during the bucket run's first epoch: training goes on, uploads are retried, and
the weights in the bucket are still the local run's.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"phase (.+?): ([0-9.]+) s \(at")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def train(
    data: Path,
    project: str,
    args: argparse.Namespace,
    env: dict[str, str],
    freeze_pid: int | None = None,
    cpus: set[int] | None = None,
) -> tuple[float, str]:
    """Wall seconds of one train.py process, and its output. With
    ``freeze_pid``, that process group is stopped for --freeze-s seconds once the run's first step is logged; with
    ``cpus``, the process (its threads and loader workers) runs on those CPUs only."""
    cmd = [
        sys.executable,
        "train.py",
        "--data",
        str(data),
        "--project",
        project,
        "--name",
        "exp",
        "--imgsz",
        str(args.imgsz),
        "--epochs",
        str(args.epochs),
        "--cfg",
        args.cfg,
        "--batch-size",
        "16",
        "--workers",
        str(args.workers),
        "--device",
        "cpu",
        "--noautoanchor",
        "--save-steps",
        str(args.save_steps),
        "--deterministic",
    ]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.perf_counter()
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, preexec_fn=pin)
        if freeze_pid is not None:
            freeze(freeze_pid, Path(log.name), args.freeze_s)
        code = proc.wait()
        seconds = time.perf_counter() - start
        output = Path(log.name).read_text(errors="replace")
    if code:
        raise SystemExit(f"train.py failed ({project}):\n{output[-3000:]}")
    return seconds, output


def phases(output: str) -> dict[str, float]:
    """The log's phase stamps (utils/engine/phases.py): each phase's seconds, by name."""
    found: dict[str, float] = {}
    for name, seconds in PHASE.findall(output):
        found[name] = found.get(name, 0.0) + float(seconds)
    return found


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (the server's, already running) on ``cpus``; threads it starts later inherit it."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def freeze(pid: int, log: Path, seconds: float) -> None:
    """SIGSTOP the server's process group for ``seconds`` once ``log`` shows the first training step."""
    deadline = time.monotonic() + 600
    while "phase first step" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.killpg(pid, signal.SIGCONT)
    print(f"server stopped for {seconds:.0f} s after the first step", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--imgsz", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--data", type=Path, help="a data YAML to train on (default: 64 generated images)")
    p.add_argument("--cfg", default="yolov5n.yaml")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--save-steps", type=int, default=1, help="train.py's --save-steps (0: checkpoints at epoch ends)")
    p.add_argument("--freeze-s", type=float, default=0.0, help="SIGSTOP the server this long in the bucket runs")
    p.add_argument(
        "--pin",
        action="store_true",
        help="train.py on the first CPU, the server on the others (as a bucket on other machines): the server's "
        "work then takes no CPU from the run, the upload threads' still does",
    )
    p.add_argument("--alternate", action="store_true", help="every second pair runs the bucket first")
    args = p.parse_args()
    from conftest import write_rectangles_dataset
    from s3_server import shared_s3_server

    from utils.checkpoint import load_checkpoint
    from utils.storage import local_copy, open_storage

    with tempfile.TemporaryDirectory(prefix="bench-object-storage-") as tmp:
        folder = Path(tmp)
        data = (
            args.data.resolve()
            if args.data
            else write_rectangles_dataset(folder / "data", n_train=64, n_val=8, size=96)
        )
        servers = shared_s3_server(folder)
        server = next(servers)
        train_cpus: set[int] | None = None
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs two CPUs or more")
            train_cpus = {cpus[0]}
            pin_process(server.pid, set(cpus[1:]))
            print(f"train.py on CPU {cpus[0]}, the server on CPUs {cpus[1:]}", flush=True)
        try:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **server.env())
            os.environ.update(server.env())
            for pair in range(args.pairs):
                local = folder / f"local{pair}"
                bucket = f"bench{uuid.uuid4().hex[:10]}"
                open_storage(f"s3://{bucket}").fs.mkdir(bucket)
                frozen = server.pid if args.freeze_s > 0 else None
                if args.alternate and pair % 2:
                    t_bucket, out_bucket = train(data, f"s3://{bucket}/runs", args, env, frozen, train_cpus)
                    t_local, out_local = train(data, str(local), args, env, cpus=train_cpus)
                else:
                    t_local, out_local = train(data, str(local), args, env, cpus=train_cpus)
                    t_bucket, out_bucket = train(data, f"s3://{bucket}/runs", args, env, frozen, train_cpus)
                with local_copy(f"s3://{bucket}/runs/exp/weights/last.pt") as uploaded:
                    a, b = load_checkpoint(local / "exp/weights/last.pt"), load_checkpoint(uploaded)
                equal = all(a["model"][k].equal(b["model"][k]) for k in a["model"])
                first = "bucket" if args.alternate and pair % 2 else "local disk"
                print(
                    f"pair {pair} ({first} first): local disk {t_local:.1f} s, bucket {t_bucket:.1f} s, ratio "
                    f"{t_bucket / t_local:.3f}; last.pt weights {'equal' if equal else 'DIFFER'}",
                    flush=True,
                )
                a_phases, b_phases = phases(out_local), phases(out_bucket)
                for name in dict.fromkeys([*a_phases, *b_phases]):
                    if name != "imports and process set-up":  # counted from the process start: not comparable
                        print(f"  {name}: {a_phases.get(name, 0.0):.2f} s / {b_phases.get(name, 0.0):.2f} s")
                for line in out_bucket.splitlines():
                    if "WARNING" in line and "upload" in line:
                        print(f"  {line.strip()}")
        finally:
            next(servers, None)


if __name__ == "__main__":
    main()
