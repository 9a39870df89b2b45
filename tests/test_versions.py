"""An older Python or torch is refused by every entry point in one line, before its imports can fail."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from utils.versions import unsupported_versions

ROOT = Path(__file__).resolve().parents[1]


def test_the_floors_are_python_3_9_and_torch_2_6() -> None:
    assert unsupported_versions((3, 11, 7), "2.14.1+cpu") is None
    assert unsupported_versions((3, 9, 0), "2.6.0") is None
    assert unsupported_versions((3, 8, 18), "2.14.1") == (
        "unsupported Python 3.8 (needs 3.9 or newer): install the versions in requirements.txt"
    )
    assert "torch 2.5.1+cu121 (needs 2.6 or newer)" in unsupported_versions((3, 11, 7), "2.5.1+cu121")
    assert "torch nightly" in unsupported_versions((3, 11, 7), "nightly")


@pytest.mark.parametrize("script", ["train.py", "val.py", "detect.py", "export.py", "shards.py"])
def test_every_entry_point_refuses_an_old_torch_in_one_line(script, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    monkeypatch.setattr(sys, "argv", [script, "--help"])  # without the check: the help and status 0
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err == "ERROR unsupported torch 2.3.1 (needs 2.6 or newer): install the versions in requirements.txt\n"


def test_an_old_python_is_refused_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 8, 18, "final", 0))
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert exit_.value.code == 1 and capsys.readouterr().err.startswith("ERROR unsupported Python 3.8 ")
