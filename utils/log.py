"""The project's logger. Entry points call ``setup_logging``; library code only calls ``LOGGER``."""

from __future__ import annotations

import logging
import os
import sys

LOGGER = logging.getLogger("yolo")


class _ConsoleHandler(logging.StreamHandler):
    """The handler ``setup_logging`` installs (told apart from handlers that others add to the logger)."""


def setup_logging(rank: int = -1, verbose: bool = True) -> None:
    """Log INFO to stdout on the main process (rank -1 or 0); only warnings and errors elsewhere.

    ``YOLO_LOG_LEVEL`` (e.g. ``DEBUG``) sets the level of every rank instead; at DEBUG training logs the files of
    each batch it trains on, which shows what every rank saw (a bad batch, a resume, a sharding question).
    """
    level = logging.INFO if verbose and rank in (-1, 0) else logging.WARNING
    asked = os.environ.get("YOLO_LOG_LEVEL", "").upper()
    known = isinstance(logging.getLevelName(asked), int)
    LOGGER.setLevel(logging.getLevelName(asked) if known else level)
    # Idempotent: an earlier call's handler (bound to the stdout of then) is replaced, never added to.
    for handler in [h for h in LOGGER.handlers if isinstance(h, _ConsoleHandler)]:
        LOGGER.removeHandler(handler)
    handler = _ConsoleHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.propagate = False
    if asked and not known:
        LOGGER.warning(f"WARNING YOLO_LOG_LEVEL={asked} is not a logging level (DEBUG, INFO, WARNING, ERROR): ignored")


def colorstr(text: str, colour: str = "bold") -> str:
    """Wrap ``text`` in an ANSI colour when stdout is a terminal."""
    codes = {"bold": "\033[1m", "blue": "\033[34m", "red": "\033[31m", "green": "\033[32m", "yellow": "\033[33m"}
    if not sys.stdout.isatty():
        return text
    return f"{codes.get(colour, '')}{text}\033[0m"
