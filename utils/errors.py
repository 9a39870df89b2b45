"""Errors the user can fix: entry points print them as one line and exit non-zero, without a traceback."""

from __future__ import annotations

import os
from collections.abc import Callable

from utils.log import LOGGER


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a dataset): the message names the file and the problem."""


class EveryRankError(UserError):
    """A UserError every rank of a distributed run raises alike (a check of the options they share): only global
    rank 0 prints it, so that the user reads it once."""


def shown(text: object) -> str:
    """A path or name from a user's file as an error line shows it: as it is, or quoted with its escapes where it holds
    a line break or another unprintable character (so that the error stays one line)."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def excerpt(value: object, limit: int = 40) -> str:
    """At most ``limit`` characters of a value from a user's file, as an error line shows it (``shown``): a string
    holding a line break is quoted with its escapes."""
    return shown(str(value)[:limit])


def first_line(e: BaseException) -> str:
    """The first non-blank line of an exception's message, or its class name when it has none (``EOFError()``):
    what an error line quotes of another library's exception, which may be empty or many lines long."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def describe(e: BaseException) -> str:
    """``ClassName: first line`` of an exception (only the class name when its message is empty)."""
    line = first_line(e)
    return line if line == type(e).__name__ else f"{type(e).__name__}: {line}"


def run_reporting_errors(entry: Callable[[], int | None]) -> int:
    """Call an entry point's body; a UserError becomes one ``ERROR ...`` line and exit status 1."""
    try:
        return entry() or 0
    except UserError as e:
        if not isinstance(e, EveryRankError) or os.environ.get("RANK", "0") == "0":
            LOGGER.error(f"ERROR {e}")
        return 1
