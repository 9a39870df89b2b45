"""A short run of bench/fuzz_readers.py over every reader of a user's file: the same inputs on every run (a fixed
seed, no hypothesis bookkeeping), each of which must end in success, the project's one-line UserError or a counted
skip. The bench runs the same readers for millions of inputs by hand (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fuzz_readers", ROOT / "bench" / "fuzz_readers.py")
fuzz_readers = sys.modules["fuzz_readers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_readers)

# Inputs per reader: a few hundred where a read costs little, fewer where each builds a model.
EXAMPLES = {
    "data_yaml": 100,
    "yolo_labels": 300,
    "coco_json": 60,
    "coco_eval": 60,
    "voc_xml": 40,
    "image": 150,
    "checkpoint": 25,
    "model_yaml": 30,
    "hyp_yaml": 150,
    "results_csv": 200,
    "export_metadata": 150,
    "shard_tar": 200,
}
# Readers whose smoke inputs still find something, each owned by another item of issue 49: strict, so the case fails
# once the finding is fixed and the mark must go.
OPEN: dict[str, str] = {}  # none open now


def test_every_reader_has_a_smoke_run() -> None:
    assert set(EXAMPLES) == set(fuzz_readers.TARGETS)


@pytest.mark.parametrize(
    "reader",
    [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=OPEN[r])) if r in OPEN else r
        for r in EXAMPLES
    ],
)
def test_reader_ends_each_input_in_success_one_line_or_skip(reader: str) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-smoke-", dir=fuzz_readers.WORK_ROOT) as work:
        report = fuzz_readers.fuzz(reader, EXAMPLES[reader], seed=0, work=Path(work), driver="plain")
    assert sum(report.outcomes.values()) == EXAMPLES[reader]
    assert report.outcomes[fuzz_readers.OK] > 0, "no input was read whole: the mutations test nothing past the start"
    assert not report.findings, "\n\n".join(text for _, text in report.findings.values())
