"""The order the suite's tests start in (tests/conftest.py): the longest named by tests that exist, and the tests that
trace with torch.compile or torch.export marked and collected after every other."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import LONGEST_FIRST


def test_the_longest_first_order_names_tests_that_exist_once_each() -> None:
    # A renamed test would drop out of the order silently and could start last, running alone while a core idles.
    defined = {
        name
        for path in Path(__file__).parent.glob("test_*.py")
        for name in re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)
    }
    assert [name for name in LONGEST_FIRST if name not in defined] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_tests_that_trace_with_dynamo_are_marked_and_run_after_every_other(request) -> None:
    # Checked over the tests collected in this session (each pytest-xdist worker collects them all).
    items = request.session.items
    marked = [item.get_closest_marker("traces_with_dynamo") is not None for item in items]
    unmarked = [
        item.nodeid
        for item, is_marked in zip(items, marked)
        if not is_marked
        and ("litert_files" in getattr(item, "fixturenames", ()) or item.module.__name__.endswith("test_compile"))
    ]
    assert unmarked == [], "these run LiteRT's converter or torch.compile in the test's process: mark them"
    assert marked == sorted(marked), "a test marked traces_with_dynamo is collected before one that is not"
