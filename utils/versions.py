"""The Python and torch versions the code needs; entry points refuse older ones in one line before importing more.

The floors are what the code calls, not what it was tested on (the suite runs on Python 3.11 and torch 2.14.1):
- Python 3.9: built-in generics evaluated at import (``tuple[int, ...]`` type aliases); the syntax compiles on 3.8.
- torch 2.6: loading Ultralytics checkpoints through an allow-list (models/families/ultralytics_import.py:
  ``torch.serialization.get_unsafe_globals_in_checkpoint`` and ``safe_globals`` with (stand-in, dotted name)
  pairs); it also has the fused CPU kernels of SGD, Adam and AdamW (utils/optimizer.py; 2.4),
  ``torch.amp.GradScaler`` for every device (2.3) and the typed distributed errors ``DistError``,
  ``DistNetworkError`` and ``DistStoreError`` (utils/distributed.py).

This module is plain enough to import on any Python 3: the check must run where the rest would fail.
"""

import re
import sys
from collections.abc import Sequence
from typing import Any

MIN_PYTHON = (3, 9)
MIN_TORCH = (2, 6)


def unsupported_versions(python: "Sequence[Any]", torch_version: str) -> "str | None":
    """A one-line reason when ``python`` (a version_info) or ``torch_version`` (a string) is too old, else None."""
    problems = []
    if tuple(python[:2]) < MIN_PYTHON:
        problems.append("Python {}.{} (needs {}.{} or newer)".format(python[0], python[1], *MIN_PYTHON))
    match = re.match(r"(\d+)\.(\d+)", str(torch_version))
    if match is None or (int(match.group(1)), int(match.group(2))) < MIN_TORCH:
        problems.append("torch {} (needs {}.{} or newer)".format(torch_version, *MIN_TORCH))
    if not problems:
        return None
    return "unsupported " + " and ".join(problems) + ": install the versions in requirements.txt"


def require_supported_versions() -> None:
    """Exit with one ``ERROR`` line on stderr when this Python or torch is too old (status 1)."""
    torch_version: str  # string annotations only here: this module must load on the old Pythons it refuses
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "(not installed)"
    reason = unsupported_versions(sys.version_info, torch_version)
    if reason:
        sys.stderr.write("ERROR " + reason + "\n")
        raise SystemExit(1)
