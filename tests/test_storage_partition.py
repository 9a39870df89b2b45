"""Two hosts and a real partition: two network namespaces joined by a veth pair (iproute2's ``ip netns``), one node
of a 2-node CPU run in each, the run folder on an S3 server (moto's) in the first host's namespace, which both reach
over the link. The second host's link is taken down mid-epoch: the first node ends within --dist-timeout naming the
silent rank, the bucket holds nothing half written, and the run resumes from the bucket once the link is back.
Skipped, with one line naming the reason, where namespaces cannot be made (no root, no iproute2, a container
without the capability)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST_TIMEOUT_MIN = 0.15  # 9 s: long enough for a step on a loaded machine (as the frozen-node test), short for the test
PORT = 9000  # the S3 server's, inside the first host's namespace (its own ports)
MASTER_PORT = 29500


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _two_hosts():
    """(namespace, address) of two hosts joined by a veth pair; removed after the block."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces cannot be made here: no ip command (iproute2)")
    tag = f"hs{os.getpid() % 100000}"
    subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
    hosts = [(f"{tag}a", f"{subnet}.1", f"{tag}va"), (f"{tag}b", f"{subnet}.2", f"{tag}vb")]
    try:
        _ip("netns", "add", hosts[0][0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"network namespaces cannot be made here: {(e.stderr or '').strip().splitlines()[:1]}")
    try:
        _ip("netns", "add", hosts[1][0])
        _ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for ns, address, link in hosts:
            # Each host's name resolves to its own address in its namespace (``ip netns exec`` mounts this file
            # over /etc/hosts): gloo offers the address of the host's name to its peers.
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _in(ns: str, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    out = open(log, "ab")
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


class _PythonIn:
    """One Python process in a namespace, started early (its imports overlap the server's and the ranks' start),
    that runs the code it is sent and answers with what the code printed: each check costs no new interpreter."""

    END = "--end of answer--"

    def __init__(self, ns: str, env: dict[str, str], log: Path) -> None:
        serve = f"""
            import contextlib, io, json, sys, traceback, zipfile
            from utils.storage import local_copy, open_storage
            for request in sys.stdin:
                out = io.StringIO()
                try:
                    with contextlib.redirect_stdout(out):
                        exec(json.loads(request), globals())
                except Exception:
                    out.write("FAILED " + traceback.format_exc().replace("\\n", " | "))
                print(out.getvalue() + {self.END!r}, flush=True)
        """
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", textwrap.dedent(serve)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "ab"),
            text=True,
            start_new_session=True,
        )

    def run(self, code: str, timeout: float = 120) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.proc.stdin.flush()
        lines: list[str] = []
        reading = threading.Thread(target=self._read_answer, args=(lines,), daemon=True)
        reading.start()
        reading.join(timeout)
        answer = "".join(lines)
        assert not reading.is_alive(), f"no answer in {timeout} s to {code!r}: {answer[-3000:]}"
        assert "FAILED Traceback" not in answer and self.proc.poll() is None, answer[-3000:]
        return answer

    def _read_answer(self, lines: list[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.rstrip("\n").endswith(self.END):
                lines.append(line.rstrip("\n").removesuffix(self.END))
                return
            lines.append(line)


def _wait_for_line(log: Path, pattern: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text(errors="replace")):
        assert all(p.poll() is None for p in procs), log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{pattern!r} not in {log}: " + log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def _rank(rank: int, master: str, env: dict[str, str]) -> dict[str, str]:
    """The variables torch.distributed.run would give the one rank of node ``rank``. Each rank is started without the
    launcher, whose own start-up (a torch import) would add seconds to each run; what is tested is the ranks' part:
    rank 0 hosts the rendezvous store in the first host, where the launcher's agent would."""
    return dict(
        env,
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=master,
        MASTER_PORT=str(MASTER_PORT),
    )


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_a_host_cut_off_mid_epoch_is_named_by_the_other_and_the_run_resumes_from_the_bucket(
    rectangles_yaml, tmp_path
) -> None:
    with _two_hosts() as hosts:
        (ns_a, addr_a, _), (ns_b, _, link_b) = hosts
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            TMPDIR=str(tmp_path),
            AWS_ACCESS_KEY_ID="partition-key",
            AWS_SECRET_ACCESS_KEY="partition-secret",
            AWS_ENDPOINT_URL=f"http://{addr_a}:{PORT}",
            AWS_DEFAULT_REGION="us-east-1",
        )
        env.pop("WORLD_SIZE", None)
        server = _in(
            ns_a, [sys.executable, "-m", "moto.server", "-H", addr_a, "-p", str(PORT)], tmp_path / "s3.log", env
        )
        reader = _PythonIn(ns_a, env, tmp_path / "reader.log")
        procs: list[subprocess.Popen] = []
        try:
            _wait_for_line(tmp_path / "s3.log", "Running on", [server], 60)
            reader.run("open_storage('s3://parted').fs.mkdir('parted')")
            project, logs = "s3://parted/runs", [tmp_path / "a.log", tmp_path / "b.log"]
            args = [
                "--data",
                str(rectangles_yaml),
                "--project",
                project,
                "--name",
                "exp",
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
                "--noval",
                "--loggers",  # none: the test reads the record and the log
                "--epochs",
                "1",  # cut inside it, after its first checkpoint: the resumed run ends it
                "--save-steps",
                "1",
                "--dist-timeout",
                str(DIST_TIMEOUT_MIN),
            ]
            train = [sys.executable, "train.py"]
            procs = [
                _in(ns, [*train, *args], log, _rank(r, addr_a, env))
                for r, (ns, log) in enumerate(zip((ns_a, ns_b), logs))
            ]
            # Once a checkpoint inside epoch 0 is complete in the bucket: the second host's link goes down.
            _wait_for_line(logs[0], r"checkpoint last\.pt \(epoch 0 batch 1\) written", procs, 240)
            _ip("-n", ns_b, "link", "set", link_b, "down")
            cut = time.monotonic()
            procs[0].wait(timeout=DIST_TIMEOUT_MIN * 60 + 60)
            waited = time.monotonic() - cut
            output = logs[0].read_text(errors="replace")
            assert procs[0].returncode != 0 and "rank(s) 1 stopped answering" in output, output[-3000:]
            assert waited < DIST_TIMEOUT_MIN * 60 + 30, waited
            _stop(procs[1])  # cut off, it waits for its own timeout: the test need not

            state = reader.run(
                """
                run = open_storage('s3://parted/runs/exp')
                state = json.loads(run.read_bytes('run.json'))
                assert not [f for f in run.files() if f.endswith('.tmp') or '/.' in f], run.files()
                with local_copy('s3://parted/runs/exp/' + state['newest_checkpoint']) as path:
                    # Whole: every member of the checkpoint's zip is there with its CRC (torch is not imported here,
                    # where it would slow the ranks' start; the resumed run loads the checkpoint)
                    assert zipfile.ZipFile(path).testzip() is None
                print(state['status'], state['checkpoint'])
                """
            )
            assert re.fullmatch(r"running epoch \d+( batch \d+)?\n", state), state

            _ip("-n", ns_b, "link", "set", link_b, "up")
            resume = ["--resume", f"{project}/exp/weights/last.pt"]
            logs = [tmp_path / "a2.log", tmp_path / "b2.log"]
            procs = [
                _in(ns, [*train, *resume], log, _rank(r, addr_a, env))
                for r, (ns, log) in enumerate(zip((ns_a, ns_b), logs))
            ]
            for proc, log in zip(procs, logs):
                assert proc.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]
            assert "Resuming training at" in logs[0].read_text(errors="replace")
            final = reader.run(
                "print(json.loads(open_storage('s3://parted/runs/exp').read_bytes('run.json'))['status'])"
            )
            assert final.strip() == "finished"
        finally:
            for proc in [*procs, reader.proc, server]:
                if proc.poll() is None:
                    _stop(proc)
