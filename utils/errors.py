"""Errors the user can fix: entry points print them as one line and exit non-zero, without a traceback."""

from __future__ import annotations

from collections.abc import Callable

from utils.log import LOGGER


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a dataset): the message names the file and the problem."""


def run_reporting_errors(entry: Callable[[], int | None]) -> int:
    """Call an entry point's body; a UserError becomes one ``ERROR ...`` line and exit status 1."""
    try:
        return entry() or 0
    except UserError as e:
        LOGGER.error(f"ERROR {e}")
        return 1
