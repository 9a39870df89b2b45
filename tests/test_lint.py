"""The linter and the formatter (pyproject.toml, [tool.ruff]) find nothing in the tree, so that CI fails on what
they would report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_lint_finds_nothing() -> None:
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_would_change_nothing() -> None:
    result = ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_lint_fails_on_a_planted_defect(tmp_path: Path) -> None:
    """The check can fail: an unused import in a copy of the configuration's reach is reported."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "planted.py").write_text("import os\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 1 and "F401" in result.stdout


def test_mypy_finds_nothing_in_the_library(request, tmp_path: Path) -> None:
    """mypy, configured in pyproject.toml ([tool.mypy]: models/ and utils/, every function annotated), reports
    nothing. Its incremental cache lives in pytest's cache folder: only a fresh clone's first run reads torch's and
    numpy's stubs in full (the slow part); later runs check what changed."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider: a cold run then
    cache_dir = cache.mkdir("mypy") if cache else tmp_path / "mypy"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_mypy_fails_on_a_planted_defect(tmp_path: Path) -> None:
    """The check can fail: with the project's settings, an unannotated function and a wrong return type are
    reported."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "planted.py").write_text('def f(x):\n    return x\n\n\ndef g() -> int:\n    return "1"\n')
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "planted.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout
    assert "[no-untyped-def]" in result.stdout and "[return-value]" in result.stdout
