"""Fuzz every reader of a user's file with hypothesis: mutated and generated inputs, one oracle.

Each input must end in one of three ways, within a time bound (and, run from the command line, a memory bound):
success; the project's ``UserError`` with a one-line message; or a counted skip (the reader's own signal that it
reported and skipped a bad item: a corrupt status in a label table, a bad shard, ``ImageError``, ``LabelError``).
Anything else (another exception, a multi-line or empty error, a timeout, ``MemoryError``) is a finding: it is
counted once per (reader, exception, innermost frame of the project) and its first input is saved with the
traceback under ``--out``.

    python bench/fuzz_readers.py --examples 200000                      # every reader, 200k inputs each
    python bench/fuzz_readers.py --readers checkpoint shard_tar --examples 1000000 --seed 7
    nice -n 19 python bench/fuzz_readers.py --examples 10000000 --seconds 600 --cpu-seconds 100   # bounded

Inputs are mutations of small valid files made at start (byte flips, cuts, inserted spans and hostile tokens such
as deep nesting, NaN, huge numbers, NUL bytes) and, for the YAML, JSON and XML formats, valid documents with values
replaced by hostile ones. Hypothesis drives the search: it seeds one random generator per input, from which the
mutations are drawn (drawing each byte through hypothesis costs more than most reads), generates only (no
shrinking, no example database), so a run of millions of inputs stays fast and every finding is kept rather than
the first. A finding is reproduced by reading its saved input with the reader (``TARGETS[name].read``).
tests/test_fuzz_smoke.py runs a few hundred inputs per reader from a fixed seed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import os
import random
import signal
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from utils.errors import UserError  # noqa: E402

OK, SKIP, ERROR, FINDING = "ok", "skip", "error", "finding"
TIME_LIMIT_S = 30.0  # one input; a reader slower than this on a small file is a finding (a hang)
# Inputs are written to memory-backed storage when there is one: a write to a busy disk costs more than most reads.
WORK_ROOT = "/dev/shm" if Path("/dev/shm").is_dir() else None

# Spans a mutation may insert: what broke readers before (deep nesting, YAML aliases, non-finite and huge numbers,
# NUL bytes, home-folder and parent paths, pickle opcodes) and format punctuation.
TOKENS = (
    b"[" * 3000,
    b"{" * 3000,
    b"a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b]\n",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b".nan",
    b".inf",
    b"1e400",
    b"9" * 5000,
    b"18446744073709551616",
    b"-1",
    b"0",
    b"\x00",
    b"~nosuchuser/x",
    b"../../../../tmp/x",
    b"x" * 300,
    b"true",
    b"null",
    b'"',
    b"\n",
    b",",
    b":",
    b"<",
    b"]]>",
    b"&lt;",
    b"\xff\xfe",
    b"\x80\x02",
    b"(",
    b".",
    b"\x00" * 512,
)
# Values a structured edit puts into a valid document.
HOSTILE_ATOMS = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    -(2**63) - 1,
    10**30,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e-320,
    0.5,
    "",
    "\x00",
    "~nosuchuser/x",
    "../../../../tmp/x",
    "x" * 300,
    "nc",
    "a/b",
    "pipe:true",
    "/",
    "é",
)


def hostile(rng: random.Random, depth: int = 0) -> Any:
    """A hostile value: an atom above, a random number or text, or a small list or mapping of them."""
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind < 3:
        return rng.choice(HOSTILE_ATOMS)
    if kind == 3:
        return rng.choice((rng.randint(-(2**70), 2**70), rng.uniform(-1e6, 1e6), rng.randint(-5, 100)))
    if kind == 4:
        return "".join(
            chr(rng.choice((rng.randrange(32, 127), rng.randrange(0, 0x2FFF)))) for _ in range(rng.randrange(9))
        )
    if kind < 7:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(("x", 0, "names", "nc", "")): hostile(rng, depth + 1) for _ in range(rng.randrange(4))}


class Timeout(Exception):
    """An input took longer than TIME_LIMIT_S."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Timeout(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- inputs -------------------------------------------------------------------------------------------------


def mutate(rng: random.Random, seeds: tuple[bytes, ...]) -> bytes:
    """A seed with 1 to 6 edits: byte flips, cut spans, inserted random bytes or tokens, a cut tail, a repeat."""
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 6)):
        op, at = rng.randrange(6), rng.randint(0, len(data))
        if op == 0 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 1:
            del data[at : at + rng.randint(1, 64)]
        elif op == 2:
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 3:
            data[at:at] = rng.choice(TOKENS)
        elif op == 4:
            del data[at:]
        else:
            data[at:at] = bytes(data[at : at + rng.randint(1, 256)]) * rng.randint(1, 8)
    return bytes(data)


def _slots(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every (container path, key) of a nested document."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        out.append((*path, key))
        out.extend(_slots(value, (*path, key)))
    return out


def edit(rng: random.Random, document: Any, dump: Callable[[Any], str]) -> bytes:
    """A valid document with 1 to 3 values replaced by hostile ones (or removed)."""
    doc = copy.deepcopy(document)
    for _ in range(rng.randint(1, 3)):
        slots = _slots(doc)
        if not slots:
            break
        *parent_path, key = rng.choice(slots)
        parent = doc
        for k in parent_path:
            parent = parent[k]
        if rng.randrange(10) == 0 and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = hostile(rng)
    return dump(doc).encode("utf-8", "surrogatepass")


def _yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True)


def _json(doc: Any) -> str:
    return json.dumps(doc)


# ---- the readers --------------------------------------------------------------------------------------------


@dataclass
class Target:
    """One reader: its valid seed inputs (made in a work folder), how one input is read, and structured edits."""

    name: str
    make_seeds: Callable[[Path], tuple[bytes, ...]]
    read: Callable[[bytes, Path], str]  # OK or SKIP; raises UserError or anything else (a finding)
    documents: Callable[[], list[tuple[Any, Callable[[Any], str]]]] = lambda: []


def _png(w: int = 32, h: int = 24) -> bytes:
    import cv2

    return cv2.imencode(".png", np.full((h, w, 3), 90, np.uint8))[1].tobytes()


def _jpeg(w: int = 32, h: int = 24) -> bytes:
    import cv2

    return cv2.imencode(".jpg", np.full((h, w, 3), 90, np.uint8))[1].tobytes()


DATA_YAML = {"path": ".", "train": "images", "val": "images", "nc": 2, "names": ["cat", "dog"]}


def _data_yaml_seeds(work: Path) -> tuple[bytes, ...]:
    (work / "images").mkdir(exist_ok=True)
    (work / "images" / "a.png").write_bytes(_png())
    coco = {**DATA_YAML, "train": {"annotations": "coco.json", "images": "images"}}
    return (_yaml(DATA_YAML).encode(), _yaml(coco).encode(), b"train: images\nval: images\nnames: {0: cat, 1: dog}\n")


def _read_data_yaml(data: bytes, work: Path) -> str:
    from utils.data.config import load_data_config

    path = work / "data.yaml"
    path.write_bytes(data)
    load_data_config(path)
    return OK


def _label_seeds(work: Path) -> tuple[bytes, ...]:
    (work / "im.png").write_bytes(_png())
    return (b"0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n", b"0 0.1 0.1 0.3 0.1 0.3 0.3 0.1 0.3\n", b"")


def _read_labels(data: bytes, work: Path) -> str:
    from utils.data.label_table import CORRUPT
    from utils.data.yolo_labels import verify_pair

    (work / "im.txt").write_bytes(data)
    status = verify_pair(str(work / "im.png"), str(work / "im.txt"), 2)[0]
    return SKIP if status == CORRUPT else OK


COCO = {
    "images": [{"id": 1, "file_name": "a.png", "width": 32, "height": 24}],
    "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [2, 2, 10, 8], "iscrowd": 0, "area": 80}],
    "categories": [{"id": 3, "name": "cat"}, {"id": 5, "name": "dog"}],
}


def _coco_seeds(work: Path) -> tuple[bytes, ...]:
    (work / "images").mkdir(exist_ok=True)
    (work / "images" / "a.png").write_bytes(_png())
    return (_json(COCO).encode(),)


def _read_coco(data: bytes, work: Path) -> str:
    from utils.data.coco_reader import read_coco_table
    from utils.data.splits import CocoSplit

    path = work / "coco.json"
    path.write_bytes(data)
    table, _ = read_coco_table(CocoSplit(str(path), str(work / "images")), workers=1, verbose=False)
    return SKIP if table.counts.get("corrupt") or len(table.usable()) < len(table) else OK


def _read_coco_eval(data: bytes, work: Path) -> str:
    """The data YAML's ``annotations`` as val.py scores against it: the file checked, then COCOeval."""
    from utils.coco_json import coco_eval

    path = work / "ground_truth.json"
    path.write_bytes(data)
    coco_eval(path, [{"image_id": 1, "category_id": 3, "bbox": [2, 2, 10, 8], "score": 0.9}])
    return OK


VOC = {
    "annotation": {
        "size": {"width": 32, "height": 24, "depth": 3},
        "object": [
            {"name": "cat", "difficult": 0, "bndbox": {"xmin": 2, "ymin": 2, "xmax": 12, "ymax": 10}},
            {"name": "dog", "truncated": 1, "bndbox": {"xmin": 1.5, "ymin": 3, "xmax": 30, "ymax": 20}},
        ],
    }
}


def _xml(doc: Any) -> str:
    """A nested mapping as XML elements (a list repeats its key's element; other values are element text)."""
    from xml.sax.saxutils import escape

    def element(tag: Any, value: Any) -> str:
        if isinstance(value, list):
            return "".join(element(tag, v) for v in value)
        inner = "".join(element(k, v) for k, v in value.items()) if isinstance(value, dict) else escape(str(value))
        return f"<{tag}>{inner}</{tag}>"

    return "".join(element(k, v) for k, v in doc.items())


VOC_XML = _xml(VOC).encode()


def _voc_seeds(work: Path) -> tuple[bytes, ...]:
    root = work / "voc"
    for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "JPEGImages" / "a.jpg").write_bytes(_jpeg())
    (root / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    return (VOC_XML,)


def _read_voc(data: bytes, work: Path) -> str:
    from utils.data.splits import VocSplit
    from utils.data.voc_reader import read_voc_table

    root = work / "voc"
    (root / "Annotations" / "a.xml").write_bytes(data)
    split = VocSplit((str(root),), "train", ("cat", "dog"))
    table, _ = read_voc_table(split, root, workers=1, verbose=False)
    return SKIP if len(table.usable()) < len(table) else OK


def _image_seeds(work: Path) -> tuple[bytes, ...]:
    """One small image of every format the readers take (utils/data/image_io.py reads each one's header)."""
    import cv2

    image = np.full((24, 32, 3), 90, np.uint8)
    others = tuple(cv2.imencode(ext, image)[1].tobytes() for ext in (".webp", ".tiff", ".bmp"))
    lossy = cv2.imencode(".webp", image, [cv2.IMWRITE_WEBP_QUALITY, 80])[1].tobytes()
    return (_png(), _jpeg(), _png(13, 11), *others, lossy)


def _read_image(data: bytes, work: Path) -> str:
    from utils.data.image_io import ImageError, decode_image, probe_image_bytes

    try:
        probe_image_bytes(data)
    except ImageError:
        return SKIP
    return SKIP if decode_image(np.frombuffer(data, np.uint8)) is None else OK


TINY_MODEL = {
    "nc": 2,
    "anchors": [[10, 13, 16, 30], [30, 61, 62, 45]],
    "backbone": [[-1, 1, "Conv", [8, 3, 2]], [-1, 1, "C3", [8, 1]]],
    "head": [[-1, 1, "SPPF", [8, 5]], [[1, 2], 1, "Detect", ["nc", "anchors"]]],
}
TINY_ANCHOR_FREE = {
    "nc": 2,
    "scales": {"n": [0.5, 0.25, 1024]},
    "backbone": [[-1, 1, "Conv", [16, 3, 2]], [-1, 1, "Conv", [16, 3, 2]], [-1, 1, "C2f", [16, True]]],
    "head": [[-1, 1, "Conv", [16, 3, 2]], [[1, 2, 3], 1, "Detect", ["nc"]]],
}


# The checkpoint reader's model: one layer and a one-level head, so a file that loads costs little to build.
MINIMAL_MODEL = {
    "nc": 2,
    "anchors": [[10, 13]],
    "backbone": [[-1, 1, "Conv", [4, 3, 2]]],
    "head": [[[0], 1, "Detect", ["nc", "anchors"]]],
}


def _checkpoint_seeds(work: Path) -> tuple[bytes, ...]:
    import torch

    from models.yolo import Model
    from utils.checkpoint import model_state

    buf = io.BytesIO()
    torch.save({**model_state(Model(MINIMAL_MODEL)), "epoch": 1, "names": ["cat", "dog"]}, buf)
    return (buf.getvalue(),)


def _with_entry(zip_bytes: bytes, change: Callable[[str, bytes], bytes]) -> bytes:
    """``zip_bytes`` rewritten with each entry's bytes passed through ``change(name, data)``."""
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in entries:
            z.writestr(name, change(name, data))
    return out.getvalue()


def _checkpoint_input(rng: random.Random, seeds: tuple[bytes, ...]) -> bytes:
    """A mutation of the whole file; of the pickle inside an intact zip (what reaches the unpicklers); or of one
    tensor's bytes, its length kept (a file that opens, with other weights)."""
    kind = rng.randrange(3)
    if kind == 0:
        return mutate(rng, seeds)
    if kind == 1:
        return _with_entry(seeds[0], lambda name, data: mutate(rng, (data,)) if name.endswith("data.pkl") else data)

    def flip(name: str, data: bytes) -> bytes:
        if "/data/" not in name or not data or rng.randrange(4):
            return data
        changed = bytearray(data)
        changed[rng.randrange(len(changed))] = rng.randrange(256)
        return bytes(changed)

    return _with_entry(seeds[0], flip)


def _read_checkpoint(data: bytes, work: Path) -> str:
    from models.loading import load_model

    path = work / "w.pt"
    path.write_bytes(data)
    load_model(path)
    return OK


def _model_yaml_seeds(work: Path) -> tuple[bytes, ...]:
    return (_yaml(TINY_MODEL).encode(), _yaml(TINY_ANCHOR_FREE).encode())


def _read_model_yaml(data: bytes, work: Path) -> str:
    from models.yolo import Model

    path = work / "tinyn.yaml"
    path.write_bytes(data)
    Model(str(path))
    return OK


def _hyp_seeds(work: Path) -> tuple[bytes, ...]:
    return ((ROOT / "data" / "hyps" / "hyp.scratch-low.yaml").read_bytes(),)


def _read_hyp(data: bytes, work: Path) -> str:
    from models.families import family_of

    path = work / "hyp.yaml"
    path.write_bytes(data)
    family_of("yolov5").read_hyp(path)
    return OK


def _results_seeds(work: Path) -> tuple[bytes, ...]:
    from utils.results_log import append_results_row, result_columns

    path = work / "seed.csv"
    path.unlink(missing_ok=True)
    columns = result_columns(("box", "obj", "cls"))
    for epoch in range(3):
        append_results_row(path, [epoch] + [0.5] * (len(columns) - 1), columns)
    return (path.read_bytes(),)


def _read_results(data: bytes, work: Path) -> str:
    from utils.plots import read_results_csv
    from utils.results_log import extend_results_columns, result_columns, truncate_results
    from utils.trackers.composite import read_results

    path = work / "results.csv"
    path.write_bytes(data)
    read_results_csv(path)
    truncate_results(path, keep_below_epoch=2)
    extend_results_columns(path, result_columns(("box", "obj", "cls", "extra")))
    read_results(path)  # the trackers' reconciliation
    return OK


META = {
    "names": {0: "cat", 1: "dog"},
    "stride": 32,
    "task": "detect",
    "batch": 1,
    "imgsz": [64, 64],
    "description": "Ultralytics YOLO11n model",
    "args": {"nms": False, "half": False},
}


def _meta_seeds(work: Path) -> tuple[bytes, ...]:
    from utils.formats.metadata import ModelMeta

    ours = ModelMeta(names=["cat", "dog"], stride=32, kind="onnx", family="yolov5", layout="yolov5")
    return (_yaml(META).encode(), _json(META).encode(), ours.to_json().encode())


def _read_meta(data: bytes, work: Path) -> str:
    from utils.formats.metadata import METADATA_YAML, ModelMeta

    folder = work / "model_openvino_model"
    folder.mkdir(exist_ok=True)
    (folder / METADATA_YAML).write_bytes(data)
    ModelMeta.from_yaml(folder, "openvino")
    text = data.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):  # YAML reads JSON too; a JSON document also goes to the ONNX reader
        ModelMeta.from_json(text, "onnx", work / "m.onnx")
    return OK


def _shard_seeds(work: Path) -> tuple[bytes, ...]:
    buf = io.BytesIO()
    members = {"a.png": _png(), "a.txt": b"0 0.5 0.5 0.2 0.2\n", "b.jpg": _jpeg(), f"{'x' * 120}.png": _png()}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return (buf.getvalue(),)


def _read_shard(data: bytes, work: Path) -> str:
    from utils.data.label_table import CORRUPT
    from utils.data.shard_cache import ShardCache
    from utils.data.webshards import scan_shard

    path = work / "s-000000.tar"
    path.write_bytes(data)
    scan = scan_shard(str(path), ShardCache(work / "cache"), 2)
    return SKIP if scan.bad_shard or CORRUPT in scan.status else OK


TARGETS = {
    t.name: t
    for t in (
        Target("data_yaml", _data_yaml_seeds, _read_data_yaml, lambda: [(DATA_YAML, _yaml)]),
        Target("yolo_labels", _label_seeds, _read_labels),
        Target("coco_json", _coco_seeds, _read_coco, lambda: [(COCO, _json)]),
        Target("coco_eval", _coco_seeds, _read_coco_eval, lambda: [(COCO, _json)]),
        Target("voc_xml", _voc_seeds, _read_voc, lambda: [(VOC, _xml)]),
        Target("image", _image_seeds, _read_image),
        Target("checkpoint", _checkpoint_seeds, _read_checkpoint),
        Target("model_yaml", _model_yaml_seeds, _read_model_yaml, lambda: [(TINY_MODEL, _yaml)]),
        Target("hyp_yaml", _hyp_seeds, _read_hyp),
        Target("results_csv", _results_seeds, _read_results),
        Target("export_metadata", _meta_seeds, _read_meta, lambda: [(META, _yaml), (META, _json)]),
        Target("shard_tar", _shard_seeds, _read_shard),
    )
}


# ---- the oracle ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What one reader's inputs ended in, and its findings (the first input of each kind)."""

    reader: str
    outcomes: Counter = field(default_factory=Counter)
    findings: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def line(self) -> str:
        parts = ", ".join(f"{self.outcomes[k]} {k}" for k in (OK, ERROR, SKIP, FINDING))
        return (
            f"{self.reader}: {sum(self.outcomes.values())} inputs in {self.seconds:.1f} s, {self.cpu_seconds:.1f} s CPU ({parts}); "
            + (
                f"{len(self.findings)} distinct finding(s): {'; '.join(self.findings)}"
                if self.findings
                else "no findings"
            )
        )


def _where(e: BaseException) -> str:
    """The innermost frame in this project's code (else the innermost frame) as file:line."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "/bench/" not in f.filename]
    frame = (ours or frames)[-1] if frames else None
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def judge(target: Target, data: bytes, work: Path, report: Report, time_limit_s: float = TIME_LIMIT_S) -> str:
    """Read one input and file its outcome; a finding keeps its first input and traceback."""
    try:
        with time_limit(time_limit_s):
            outcome = target.read(data, work)
    except UserError as e:
        message = str(e)
        outcome = ERROR if message.strip() and "\n" not in message else FINDING
        if outcome == FINDING:
            report.findings.setdefault(
                f"UserError of {len(message.splitlines())} lines at {_where(e)}", (data, message)
            )
    except Exception as e:  # noqa: BLE001  (anything but the project's error is what the fuzzer looks for)
        outcome = FINDING
        key = f"{type(e).__name__} at {_where(e)}"
        report.findings.setdefault(key, (data, "".join(traceback.format_exception(e))[-4000:]))
    report.outcomes[outcome] += 1
    return outcome


def make_input(target: Target, seeds: tuple[bytes, ...], rng: random.Random) -> bytes:
    """One input for ``target``: a mutated seed, or (for the YAML and JSON formats) an edited valid document."""
    documents = target.documents()
    if documents and rng.randrange(2):
        return edit(rng, *rng.choice(documents))
    return _checkpoint_input(rng, seeds) if target.name == "checkpoint" else mutate(rng, seeds)


class _BudgetSpent(Exception):
    """A reader's time budget ran out: the run stops with the inputs read so far."""


def fuzz(
    name: str,
    examples: int,
    seed: int,
    work: Path,
    time_limit_s: float = TIME_LIMIT_S,
    driver: str = "hypothesis",
    budget_s: float = float("inf"),
    cpu_budget_s: float = float("inf"),
) -> Report:
    """``examples`` inputs to one reader, drawn from ``seed``; the report of what they ended in.

    The inputs come from a ``random.Random`` per input: hypothesis seeds it (``driver='hypothesis'``, the bench's
    search, reproducible from ``seed``), or ``seed`` and the input's number do (``'plain'``: the same inputs on
    every run, without hypothesis's bookkeeping per input; the suite's smoke run). The run stops early once
    ``budget_s`` seconds have passed or it has used ``cpu_budget_s`` seconds of CPU.
    """
    from utils.log import LOGGER

    target = TARGETS[name]
    work.mkdir(parents=True, exist_ok=True)
    seeds = target.make_seeds(work)
    report = Report(name)

    def one(rng: random.Random) -> None:
        if time.perf_counter() - start > budget_s or time.process_time() - cpu_start > cpu_budget_s:
            raise _BudgetSpent
        judge(target, make_input(target, seeds, rng), work, report, time_limit_s)

    level = LOGGER.level
    LOGGER.setLevel("CRITICAL")  # the readers' own warnings about each bad input are not the fuzzer's output
    target.read(seeds[0], work)  # imports and first-use costs are not an input's time
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        if driver == "plain":
            for i in range(examples):
                one(random.Random(f"{name}-{seed}-{i}"))
        else:
            settings(
                max_examples=examples,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(hypothesis_seed(seed)(given(st.randoms(use_true_random=True))(one)))()
    except _BudgetSpent:
        pass
    finally:
        LOGGER.setLevel(level)
        report.seconds, report.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return report


def save_findings(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for key, (data, text) in report.findings.items():
        stem = f"{report.reader}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        (out / f"{stem}.bin").write_bytes(data)
        (out / f"{stem}.txt").write_text(f"{report.reader}: {key}\n\n{text}\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import resource

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--examples", type=int, default=10_000, help="inputs per reader")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per input")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="time budget per reader")
    parser.add_argument("--cpu-seconds", type=float, default=float("inf"), help="CPU time budget per reader")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="address-space bound of this process")
    parser.add_argument("--out", default="runs/fuzz", help="where each finding's first input and traceback go")
    args = parser.parse_args(argv)
    limit = int(args.memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    # One input at a time: worker threads only wait on each other (at a low priority on a busy machine, an
    # OpenMP barrier between starved threads makes a tiny convolution take minutes, past the time limit's reach).
    torch.set_num_threads(1)
    total = 0
    with tempfile.TemporaryDirectory(prefix="fuzz-", dir=WORK_ROOT) as tmp, quiet_stderr():
        for name in args.readers:
            report = fuzz(
                name,
                args.examples,
                args.seed,
                Path(tmp) / name,
                args.time_limit,
                budget_s=args.seconds,
                cpu_budget_s=args.cpu_seconds,
            )
            save_findings(report, Path(args.out))
            print(report.line(), flush=True)
            total += len(report.findings)
    return 1 if total else 0


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """OpenCV's and libjpeg's messages about each broken image go to the process's stderr, not Python's: the
    findings are the output."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


if __name__ == "__main__":
    sys.exit(main())
