"""One prepared GPU run: the measurements a GPU machine is borrowed for, in priority order, in at most 5 minutes.

    python bench/gpu_report.py --out DIR [--ultralytics-python PY] [--budget 290] [--skip PART ...]
    python bench/gpu_report.py --out DIR --dry-run     # every part on the CPU at toy sizes: checks the script

The dry run's commands are the real run's, at toy sizes (the compile part with the eager backend: dynamo traces
the forward, nothing is compiled), each run in a fork of this process after it imported the scripts once
(bench/forked_scripts.py) rather than in a fresh interpreter, with one torch thread each: its seconds go to running
the parts, not to starting Python.

Each part's result is written into ``--out`` as soon as it finishes (``report.md`` to read, ``report.json`` to
compare, ``logs.txt`` with every command's output, ``profile.json.gz``), so a run cut short keeps what it did. The
work (data, runs) goes to ``--work``. The parts, most important first; one whose usual time no longer fits in what
is left of ``--budget`` is skipped, and every command is killed when the budget ends:

1. throughput: ours and Ultralytics' trainers (``--ultralytics-python``) on yolo11n at 640, batch 64, both without
   trackers (bench/gpu_throughput.py): images/s between checkpoint saves, the whole process, and ours' log lines
   stamped with the seconds since its start (where the start-up and the end go);
2. profile: a torch.profiler trace of 5 steps (train.py --profile 5);
3. sync-debug: 3 later steps of the same run under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that
   makes the host wait for the GPU, with the project's lines that called it;
4. validation: val.py and Ultralytics' validator side by side on the same weights (Ultralytics' trained ones,
   which val.py reads too; ours' when there is no Ultralytics); on a GPU val.py twice, in fp32 (its default) and
   with ``--half`` (fp16, Ultralytics' default there);
5. cuda-tests: ``pytest tests/test_cuda.py``;
6. val-layouts: validation's first calls on new shapes in four layouts and precisions (bench/cudnn_benchmark.py
   ``--val-layouts``);
7. compile: ours on yolo11n again with ``--compile`` (inductor), beside part 1's run of ours;
8. cudnn: cuDNN's benchmark off and on (bench/cudnn_benchmark.py);
9. throughput of yolo11s, if time is left.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.forked_scripts import Forker, Launcher, start_subprocess  # noqa: E402
from bench.gpu_throughput import Settings, make_dataset, our_cmd, train_both  # noqa: E402
from bench.ultralytics_side_by_side import final_map, ultralytics_env  # noqa: E402

PROFILE_STEPS, SYNC_STEPS = 5, 3
SYNC_FIRST_STEP = 2 + PROFILE_STEPS + 2  # after the profiler's skipped, warm-up and traced steps, and one more
# Imported once before the dry run's forks: torch.compile's tracer (the compile part); pytest's plugins, which every
# pytest loads at its start (the cuda-tests part), are added from their entry points.
DRY_RUN_PRELOAD = ("torch._dynamo",)
PROGRESS_MARKS = ("it/s", "s/it", "%|")  # a progress bar's line: not a phase stamp
# The dry run's model in place of every part's: the anchor-free family's head on P3-P5 of five convolutions (three
# levels, as val.py reads Ultralytics' checkpoints).
TOY_CFG = """\
family: yolo11
nc: 80
backbone:
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
head:
  - [[2, 3, 4], 1, Detect, [nc]]
"""


@dataclass(frozen=True)
class Sizes:
    """What the parts run at: the GPU's real sizes, or the dry run's toy ones."""

    settings: Settings
    images: int  # train images per epoch
    val_images: int
    cudnn: tuple[int, int]  # cudnn_benchmark.py's image size and batch
    compile_backend: str  # the compile part's (the dry run's eager traces the path without compiling it)

    @classmethod
    def for_run(cls, dry_run: bool, ultralytics_python: str) -> Sizes:
        if dry_run:
            dry = Settings(64, 2, 0, 4, "cpu", ultralytics_python, save_burst_s=0.05)
            return cls(dry, 4, 4, (32, 2), "eager")
        return cls(Settings(640, 64, 16, 4, "0", ultralytics_python), 2048, 500, (640, 64), "inductor")


class Report:
    """``--out``: report.md, report.json and logs.txt, each brought up to date as each part ends."""

    def __init__(self, out: Path, work: Path, budget_s: float, sizes: Sizes, start: Launcher) -> None:
        self.out, self.work, self.sizes, self.start = out, work, sizes, start
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.results: dict[str, dict] = {}
        self.data: tuple[Path, int] | None = None
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.header = {
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "sizes": asdict(sizes),
            "machine": machine(),
        }
        (out / "logs.txt").write_text("")
        (out / "report.md").write_text(f"# GPU report\n\n{json.dumps(self.header, indent=1)}\n")

    def dataset(self) -> tuple[Path, int]:
        """The generated shapes set every part trains and validates on, made by the first part that needs it."""
        if self.data is None:
            s = self.sizes
            parts = min(os.cpu_count() or 1, 16, s.images)
            self.data = make_dataset(self.work, s.images, s.settings.imgsz, parts, s.val_images)
        return self.data

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add_log(self, title: str, log: Path) -> None:
        text = log.read_text(errors="replace") if log.exists() else "(no output)\n"
        with open(self.out / "logs.txt", "a") as f:
            f.write(f"\n===== {title} =====\n{text}")

    def write(self, name: str, result: dict, text: str) -> None:
        self.results[name] = result
        (self.out / "report.json").write_text(json.dumps({**self.header, "parts": self.results}, indent=1))
        with open(self.out / "report.md", "a") as f:
            f.write(f"\n## {name} ({result.get('status')}, {result.get('seconds', 0):.0f} s)\n\n{text}\n")
        print(f"{name}: {result.get('status')}, {result.get('seconds', 0):.0f} s", flush=True)


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    return f"{gpu}, torch {torch.__version__}"


def pytest_plugins() -> tuple[str, ...]:
    """The modules of the pytest plugins installed here (their entry points)."""
    from importlib.metadata import entry_points

    return tuple(sorted({ep.module for ep in entry_points(group="pytest11")}))


def children_cpu_s() -> float:
    """CPU seconds (user and system) of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_logged(
    report: Report, cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, float]:
    """``cmd`` in the repository's root, its output in ``log``; (exit code, -9 when killed at ``timeout``; wall s)."""
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = report.start(cmd, ROOT, env, f)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = -9
            f.write(f"\n[killed after {timeout:.0f} s: the report's budget ended]\n")
    return code, time.perf_counter() - t


def phase_stamps(log: Path, limit: int = 80) -> list[str]:
    """The stamped lines of a trainer's log that are not progress bars: where its seconds went."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line for line in lines if not any(mark in line for mark in PROGRESS_MARKS)][:limit]


# ---- the parts ---------------------------------------------------------------------------------------------


def part_throughput(report: Report, cfg: str) -> tuple[dict, str]:
    sizes = report.sizes
    data = report.dataset()
    env_ul = (
        ultralytics_env(report.work, sizes.settings.ultralytics_python) if sizes.settings.ultralytics_python else {}
    )
    measured = train_both(cfg, sizes.settings, data, report.work, env_ul, max(report.left(), 1), report.start)
    result, lines = {"status": "done"}, []
    for label, run in measured.items():
        report.add_log(f"{label} {cfg} (each line: seconds since its start)", run.log)
        result[label] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run).items()}
        lines.append(
            f"- {label}: {run.images_per_s:.0f} images/s between saves (epochs {run.intervals}), whole process "
            f"{run.whole_s:.1f} s, exit {run.exit_code}"
        )
        if run.exit_code != 0:
            result["status"] = "failed"
    if len(measured) == 2:
        result["ratio"] = measured["ours"].images_per_s / measured["Ultralytics"].images_per_s
        lines.append(f"- ours / Ultralytics: {result['ratio']:.2f}x")
    stamps = phase_stamps(measured["ours"].log)
    result["ours_stamps"] = stamps
    return result, "\n".join(lines) + "\n\nOurs, stamped:\n\n```\n" + "\n".join(stamps) + "\n```"


def part_profile_and_sync(report: Report, cfg: str) -> tuple[dict, str]:
    """One train.py run: --profile 5, then SYNC_STEPS steps under the sync debug mode (in a child of this script)."""
    sizes = report.sizes
    steps_per_epoch = max(sizes.images // sizes.settings.batch_size, 1)
    epochs = -(-(SYNC_FIRST_STEP + SYNC_STEPS) // steps_per_epoch)
    train_args = our_cmd(cfg, sizes.settings, report.dataset()[0], report.work / "profile")[2:]
    train_args[train_args.index("--epochs") + 1] = str(epochs)
    sync_json = report.work / "sync_debug.json"
    sync_json.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child-sync-debug", str(sync_json), *train_args, "--profile", str(PROFILE_STEPS)]
    log = report.work / "profile.log"
    code, wall = run_logged(report, cmd, log, max(report.left(), 1))
    report.add_log("profile and sync-debug run", log)
    trace = report.work / "profile" / Path(cfg).stem / "profile.json"
    if trace.exists():
        with open(trace, "rb") as src, gzip.open(report.out / "profile.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    sync = json.loads(sync_json.read_text()) if sync_json.exists() else None
    status = "done" if code == 0 and trace.exists() and sync is not None else "failed"
    result = {"status": status, "exit": code, "wall_s": wall, "trace": trace.exists(), "sync_debug": sync}
    places = "\n".join(f"- {n}x {place}" for place, n in (sync or {}).get("by_place", {}).items())
    text = (
        f"exit {code}, {wall:.1f} s; trace of {PROFILE_STEPS} steps: "
        f"{'profile.json.gz' if trace.exists() else 'not written'}\n\n"
        f"sync debug over {SYNC_STEPS} steps: {json.dumps({k: v for k, v in (sync or {}).items() if k != 'by_place'})}"
        f"\n\n{places}"
    )
    return result, text


def part_validation(report: Report, cfg: str) -> tuple[dict, str]:
    s = report.sizes.settings
    name = Path(cfg).stem
    theirs_w = report.work / "ultralytics" / name / "weights/last.pt"
    weights = (
        theirs_w if s.ultralytics_python and theirs_w.exists() else report.work / "ours" / name / "weights/last.pt"
    )
    data = str(report.dataset()[0])
    ours = [sys.executable, "val.py", "--data", data, "--weights", str(weights), "--imgsz", str(s.imgsz)]
    ours += ["--batch-size", str(s.batch_size), "--workers", str(s.workers), "--device", s.device, "--noplots"]
    ours += ["--project", str(report.work / "val"), "--exist-ok"]
    cmds = [("ours", ours, None)]
    if s.device != "cpu":  # fp16, as Ultralytics' validator computes on CUDA by default (on a CPU both are fp32)
        cmds.append(("ours --half", [*ours, "--half"], None))
    if s.ultralytics_python:
        yolo = str(Path(s.ultralytics_python).parent / "yolo")
        theirs = [
            yolo,
            "detect",
            "val",
            f"model={weights}",
            f"data={data}",
            f"imgsz={s.imgsz}",
            f"batch={s.batch_size}",
        ]
        theirs += [f"workers={s.workers}", f"device={s.device}", "plots=False", f"project={report.work / 'val_ul'}"]
        theirs += ["name=val", "exist_ok=True"]
        cmds.append(("Ultralytics", theirs, {**os.environ, **ultralytics_env(report.work, s.ultralytics_python)}))
    result, lines = {"status": "done", "weights": str(weights)}, []
    for label, cmd, env in cmds:
        log = report.work / f"val_{label}.log"
        code, wall = run_logged(report, cmd, log, max(report.left(), 1), env)
        report.add_log(f"validation, {label}", log)
        result[label] = {"exit": code, "wall_s": wall, "map50_95": final_map(log)}
        lines.append(f"- {label}: whole process {wall:.1f} s, mAP50-95 {result[label]['map50_95']}, exit {code}")
        if code != 0:
            result["status"] = "failed"
    if "Ultralytics" in result:
        for label in ("ours", "ours --half"):
            if label in result:
                result[f"ratio {label}"] = result[label]["wall_s"] / result["Ultralytics"]["wall_s"]
                lines.append(f"- {label} / Ultralytics (time): {result[f'ratio {label}']:.2f}x")
    return result, "\n".join(lines)


def part_compile(report: Report, cfg: str) -> tuple[dict, str]:
    """Ours with --compile (inductor; the dry run's eager) beside ours without it (the throughput part's run):
    images/s between saves, the whole process, and the compile's own stamps."""
    s = report.sizes.settings
    settings = replace(s, ultralytics_python="", our_extra=("--compile", report.sizes.compile_backend))
    work = report.work / "compile"
    run = train_both(cfg, settings, report.dataset(), work, {}, max(report.left(), 1), report.start)["ours"]
    report.add_log(f"ours {cfg} --compile (each line: seconds since its start)", run.log)
    result = {
        "status": "done" if run.exit_code == 0 else "failed",
        "compiled": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run).items()},
    }
    text = (
        f"- ours --compile {report.sizes.compile_backend}: {run.images_per_s:.0f} images/s between saves (epochs {run.intervals}), whole process "
        f"{run.whole_s:.1f} s, exit {run.exit_code}"
    )
    plain = report.results.get("throughput-yolo11n", {}).get("ours")
    if plain and plain.get("images_per_s"):
        result["ratio"] = run.images_per_s / plain["images_per_s"]
        text += f"\n- compiled / not compiled (the throughput part's run): {result['ratio']:.2f}x"
    stamps = [line for line in phase_stamps(run.log) if "compil" in line.lower() or "phase" in line]
    return result, text + "\n\nStamps:\n\n```\n" + "\n".join(stamps) + "\n```"


def part_cuda_tests(report: Report, cfg: str) -> tuple[dict, str]:
    log = report.work / "cuda_tests.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "--durations=10",
        "-p",
        "no:hypothesispytest",  # unused there; its plugin imports hypothesis at the session's end, for seconds
        "tests/test_cuda.py",
    ]
    code, wall = run_logged(report, cmd, log, max(report.left(), 1))
    report.add_log("tests/test_cuda.py", log)
    summary = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "")
    return {"status": "done" if code == 0 else "failed", "exit": code, "wall_s": wall, "summary": summary}, summary


def part_cudnn(report: Report, cfg: str, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    imgsz, batch = report.sizes.cudnn
    log = report.work / f"cudnn{''.join(extra)}.log"
    cmd = [sys.executable, "bench/cudnn_benchmark.py", "--cfg", cfg, "--imgsz", str(imgsz), "--batch-size", str(batch)]
    cmd += ["--device", "cpu" if report.sizes.settings.device == "cpu" else "cuda", *extra]
    code, wall = run_logged(report, cmd, log, max(report.left(), 1))
    report.add_log(" ".join(["cudnn_benchmark.py", *extra]), log)
    lines = [line for line in log.read_text().splitlines() if line.startswith(("benchmark", "validation"))]
    return {"status": "done" if code == 0 else "failed", "exit": code, "wall_s": wall, "lines": lines}, "\n".join(lines)


def part_val_layouts(report: Report, cfg: str) -> tuple[dict, str]:
    """Validation's first calls on new shapes, channels_last or NCHW, autocast or fp16 weights (cuDNN's benchmark
    off): where val.py's time on a GPU goes beside Ultralytics' validator."""
    return part_cudnn(report, cfg, ("--val-layouts",))


# (name, function, its model, the seconds a part needs room for: about its time on an H200 at the real sizes, as
# docs/benchmarks.md records it; val-layouts: a guess)
PARTS = (
    ("throughput-yolo11n", part_throughput, "yolo11n.yaml", 140),
    ("profile-and-sync-debug", part_profile_and_sync, "yolo11n.yaml", 35),
    ("validation", part_validation, "yolo11n.yaml", 55),
    ("cuda-tests", part_cuda_tests, "", 180),
    ("val-layouts", part_val_layouts, "yolo11n.yaml", 60),
    ("compile", part_compile, "yolo11n.yaml", 150),
    ("cudnn", part_cudnn, "yolo11n.yaml", 65),
    ("throughput-yolo11s", part_throughput, "yolo11s.yaml", 100),
)


def run_parts(report: Report, dry_run: bool, skip: tuple[str, ...] = ()) -> int:
    failed = 0
    toy = report.work / "toy.yaml"
    if dry_run:
        toy.write_text(TOY_CFG)
    for name, function, cfg, needs_s in PARTS:
        t, cpu = time.monotonic(), children_cpu_s()
        cfg = str(toy) if dry_run and cfg else cfg
        if name in skip:
            report.write(name, {"status": "skipped", "asked": True}, "skipped: --skip named it")
            continue
        if not dry_run and report.left() < needs_s:
            report.write(name, {"status": "skipped", "left_s": report.left()}, f"skipped: {report.left():.0f} s left")
            continue
        try:
            result, text = function(report, cfg)
        except Exception as e:  # a part that breaks is reported; the next part still runs
            result, text = {"status": "failed", "error": repr(e)}, f"```\n{traceback.format_exc()}```"
        result["seconds"] = time.monotonic() - t
        result["children_cpu_s"] = children_cpu_s() - cpu  # on a shared machine: what the part cost, load aside
        failed += result["status"] == "failed"
        report.write(name, result, text)
    return 1 if failed else 0


# ---- the child that runs train.py with its sync-debug steps --------------------------------------------------


class SyncWatch:
    """Counts optimizer steps; over ``steps`` steps from ``first`` records every synchronising CUDA operation the
    sync debug mode warns of, with the project's own frames that led to it; writes them to ``path`` as JSON."""

    def __init__(self, first: int, steps: int, path: Path) -> None:
        self.first, self.steps, self.path = first, steps, path
        self.count, self.syncs, self.catcher, self.cuda = 0, [], None, False

    def step(self) -> None:
        self.count += 1
        if self.count == self.first:
            self.start()
        elif self.count == self.first + self.steps and self.catcher is not None:
            self.stop()

    def start(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.catcher = warnings.catch_warnings()
        self.catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.seen
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(ROOT)) and f.filename != __file__
        ]
        where = [f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in frames]
        self.syncs.append({"message": str(message).splitlines()[0][:160], "where": where[-3:]})

    def stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self.catcher.__exit__(None, None, None)
        self.catcher = None
        by_place = Counter(s["where"][-1] if s["where"] else "(outside the project)" for s in self.syncs)
        note = "" if self.cuda else "no CUDA: the sync debug mode has nothing to watch; the steps ran without it"
        summary = {"steps": self.steps, "cuda": self.cuda, "warnings": len(self.syncs), "note": note}
        self.path.write_text(json.dumps({**summary, "by_place": dict(by_place.most_common()), "syncs": self.syncs}))


def child_sync_debug(path: Path, train_argv: list[str]) -> int:
    """train.py's main with a SyncWatch after every optimizer step (after --profile's own hook): the epoch's
    after-step hook (the trainer's FirstStepStamp) is wrapped."""
    import train
    from utils.engine import trainer

    watch = SyncWatch(SYNC_FIRST_STEP, SYNC_STEPS, path)
    after_step = trainer.FirstStepStamp.__call__

    def after_step_watched(self: trainer.FirstStepStamp) -> None:
        after_step(self)
        watch.step()

    trainer.FirstStepStamp.__call__ = after_step_watched  # type: ignore[method-assign]
    return train.main(train_argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-sync-debug"]:
        return child_sync_debug(Path(argv[1]), argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where each part's result is written as it finishes")
    p.add_argument("--work", default="/tmp/gpu_report", help="data and runs")
    p.add_argument("--ultralytics-python", default="", help="a Python with ultralytics installed ('' : ours only)")
    p.add_argument(
        "--budget",
        type=float,
        default=290.0,
        help="seconds for all parts: a part whose usual time no longer fits is skipped (not in a dry run), and every "
        "command is killed when it ends",
    )
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU at toy sizes")
    names = [part[0] for part in PARTS]
    p.add_argument("--skip", nargs="+", default=[], choices=names, metavar="PART", help=f"parts not to run: {names}")
    args = p.parse_args(argv)
    if args.ultralytics_python and not Path(args.ultralytics_python).is_file():
        p.error(f"--ultralytics-python {args.ultralytics_python}: no such file")
    sizes = Sizes.for_run(args.dry_run, args.ultralytics_python)
    # The dry run's commands are forks of this process, which imports the scripts once (bench/forked_scripts.py);
    # the real run starts each in a fresh interpreter, as a user does.
    start = Forker(threads=1, preload=DRY_RUN_PRELOAD + pytest_plugins()) if args.dry_run else start_subprocess
    report = Report(Path(args.out).resolve(), Path(args.work).resolve(), args.budget, sizes, start)
    return run_parts(report, args.dry_run, tuple(args.skip))


if __name__ == "__main__":
    sys.exit(main())
