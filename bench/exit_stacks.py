"""Where a process waits after its work is done: stacks of the processes whose log says they reached their end.

    python bench/exit_stacks.py --out FILE [--marker "phase exit"] [--every 10] [--match train.py val.py]

Runs until killed (start it in the background beside a benchmark). Every ``--every`` seconds it looks at each
Python process whose command line holds one of ``--match`` and whose parent's does not (the main process, not
its loader workers), and whose standard output is a file whose last lines hold ``--marker``: the process has
logged its end but is still there. For each such process it appends to ``--out``: its age, each thread's state
and kernel wait channel, its child processes, and where ``py-spy`` is on the PATH, ``py-spy dump --native`` (the
Python and C frames of every thread). utils/process.watch_exit's own dump shows Python frames only, and nothing
when the wait is in the interpreter's C teardown.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

TAIL_BYTES = 4096


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def command_line(pid: int | str) -> str:
    return read(Path(f"/proc/{pid}/cmdline")).replace("\0", " ").strip()


def parent(pid: int) -> int:
    stat = read(Path(f"/proc/{pid}/stat"))
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else 0


def logged_end(pid: int, marker: str) -> bool:
    """True when the process's standard output is a regular file whose last bytes hold ``marker``."""
    try:
        out = Path(f"/proc/{pid}/fd/1").resolve(strict=True)
        if not out.is_file():
            return False
        with open(out, "rb") as f:
            f.seek(max(out.stat().st_size - TAIL_BYTES, 0))
            return marker.encode() in f.read()
    except OSError:
        return False


def age_s(pid: int) -> float:
    """Seconds since the process started (its start time in clock ticks after boot)."""
    ticks = int(read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[1].split()[19])
    uptime = float(read(Path("/proc/uptime")).split()[0])
    return uptime - ticks / 100


def describe(pid: int, py_spy: str | None) -> str:
    lines = [f"pid {pid}, {age_s(pid):.0f} s old: {command_line(pid)[:200]}"]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        stat = read(task / "stat")
        name, state = read(task / "comm").strip(), stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        lines.append(f"  thread {task.name} {name!r}: state {state}, waits in {read(task / 'wchan') or '-'}")
    children = [p.name for p in Path("/proc").glob("[0-9]*") if p.name.isdigit() and parent(int(p.name)) == pid]
    for child in children:
        lines.append(f"  child {child}: {command_line(child)[:120]}")
    if py_spy:
        done = subprocess.run(
            [py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
        )
        lines.append(done.stdout + done.stderr)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--marker", default="phase exit", help="the log line that says the process's work is done")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between looks")
    parser.add_argument("--match", nargs="+", default=["train.py", "val.py"])
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    started = time.monotonic()
    with open(args.out, "a") as out:
        out.write(f"exit_stacks: py-spy {'at ' + py_spy if py_spy else 'not found: kernel wait channels only'}\n")
        out.flush()  # the sampler is killed, never ended: what is not flushed is lost
        while True:
            for entry in Path("/proc").glob("[0-9]*"):
                pid = int(entry.name)
                cmd = command_line(pid)
                if "python" not in cmd or not any(m in cmd for m in args.match):
                    continue
                if any(m in command_line(parent(pid)) for m in args.match) or not logged_end(pid, args.marker):
                    continue
                try:
                    text = describe(pid, py_spy)
                except (OSError, IndexError, ValueError, subprocess.TimeoutExpired) as e:  # it ended while looked at
                    text = f"pid {pid}: {e!r}"
                out.write(f"\n--- {time.monotonic() - started:.0f} s after the sampler started ---\n{text}\n")
                out.flush()
            time.sleep(args.every)


if __name__ == "__main__":
    main()
