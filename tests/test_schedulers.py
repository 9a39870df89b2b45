"""docs/distributed.md's Slurm batch script and Kubernetes manifests, as printed there, run on this machine as two
nodes with the variables each scheduler sets: the two nodes train one run together.

What a scheduler provides is stood in for: Slurm's ``srun`` (runs its command on each node) and ``scontrol show
hostnames`` (the allocation's hosts, here loopback) are small scripts on PATH; Kubernetes' expansion of ``$(NAME)``
in a container's command is done here from the pod's environment (the PyTorchJob operator's MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK; an indexed Job's JOB_COMPLETION_INDEX). The commands are adapted to a CPU machine
in the same few places each time: one process per node, --device cpu, a tiny dataset, a free port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port, write_rectangles_dataset

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "distributed.md"
TIMEOUT_S = 240
QUICK = ["--epochs", "1", "--imgsz", "32", "--workers", "0", "--noautoanchor", "--noplots", "--exist-ok"]


def doc_blocks(language: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    return [block.split("```", 1)[0] for block in text.split(f"```{language}\n")[1:]]


def on_this_machine(args: list[str], data: Path, project: Path, port: int) -> list[str]:
    """A node's command from the docs, for two CPU nodes on loopback."""
    values = {
        "--nproc-per-node": "1",
        "--device": "cpu",
        "--batch-size": "4",
        "--data": str(data),
        "--project": str(project),
        "--master-addr": "127.0.0.1",
        "--master-port": str(port),
    }
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in values:
            out[i + 1] = values[arg]
    assert out[0] == "torchrun" and "train.py" in out, out
    return [sys.executable, "-m", "torch.distributed.run", *out[1:], *QUICK]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' expansion of ``$(NAME)`` in a container's command."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(a)) for a in args]


def run_jobs(jobs: dict[str, list[tuple[list[str], dict[str, str]]]], logs: Path) -> dict[str, list[int]]:
    """Every job's nodes side by side (each job is two launchers and two ranks, mostly waiting on each other); the
    exit codes per job. Node ``i`` of job ``name`` writes ``logs/name.node<i>.log``."""
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for name, nodes in jobs.items():
            procs[name] = []
            for i, (cmd, env) in enumerate(nodes):
                with open(logs / f"{name}.node{i}.log", "w") as out:
                    procs[name].append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        return {name: [p.wait(timeout=TIMEOUT_S) for p in ps] for name, ps in procs.items()}
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()


def base_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def slurm_nodes(tmp_path: Path, data: Path, project: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    """The batch script with its torchrun line adapted, run by bash on each node, srun and scontrol stood in for."""
    (script,) = [b for b in doc_blocks("bash") if "#SBATCH" in b]
    line = " ".join(script.split("srun ", 1)[1].replace("\\\n", " ").split())
    tokens = line.replace('"$head:29500"', "HEAD_ENDPOINT").replace('"$SLURM_JOB_ID"', "JOB_ID").split()
    adapted = on_this_machine(tokens, data, project, port)
    adapted = [{"HEAD_ENDPOINT": f'"$head:{port}"', "JOB_ID": '"$SLURM_JOB_ID"'}.get(t, t) for t in adapted]
    batch = script.split("srun ", 1)[0] + "srun " + " ".join(adapted) + "\n"
    (tmp_path / "job.sh").write_text(batch)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "127.0.0.1\\n127.0.0.2\\n"\n')  # show hostnames
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = dict(base_env(), PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2")
    env["SLURM_JOB_NODELIST"] = "node[1-2]"
    return [(["bash", str(tmp_path / "job.sh")], dict(env, SLURM_NODEID=str(i))) for i in range(2)]


def pytorchjob_nodes(data: Path, project: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    (manifest,) = [yaml.safe_load(b) for b in doc_blocks("yaml") if "kind: PyTorchJob" in b]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    nodes = []
    for rank, role in enumerate(("Master", "Worker")):
        (container,) = specs[role]["template"]["spec"]["containers"]
        env = dict(base_env(), MASTER_ADDR="pytorchjob-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK=str(rank))
        nodes.append((on_this_machine(expand(container["command"], env), data, project, port), env))
    return nodes


def indexed_job_nodes(data: Path, project: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    (job,) = [yaml.safe_load(b) for b in doc_blocks("yaml") if "completionMode: Indexed" in b]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert job["spec"]["completions"] == 2
    nodes = []
    for index in range(2):
        env = dict(base_env(), JOB_COMPLETION_INDEX=str(index))
        nodes.append((on_this_machine(expand(container["command"], env), data, project, port), env))
    return nodes


@pytest.mark.slow
def test_the_documented_scheduler_jobs_train_one_run_on_two_nodes(tmp_path) -> None:
    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4, size=32)
    jobs = {
        "slurm": slurm_nodes(tmp_path, data, tmp_path / "slurm", free_port()),
        "pytorchjob": pytorchjob_nodes(data, tmp_path / "pytorchjob", free_port()),
        "indexed-job": indexed_job_nodes(data, tmp_path / "indexed-job", free_port()),
    }
    codes = run_jobs(jobs, tmp_path)
    for name in jobs:
        logs = [(tmp_path / f"{name}.node{i}.log").read_text() for i in range(2)]
        assert codes[name] == [0, 0], f"{name}: {codes[name]}\n" + "\n".join(log[-2500:] for log in logs)
        assert "world size 2" in "".join(logs), name
        (run,) = (tmp_path / name).iterdir()  # one run folder for the two nodes
        rows = (run / "results.csv").read_text().splitlines()
        assert len(rows) == 2 and (run / "weights" / "last.pt").is_file(), name
