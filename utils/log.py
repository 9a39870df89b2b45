"""The project's logger. Entry points call ``setup_logging``; library code only calls ``LOGGER``."""
from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("yolo")


def setup_logging(rank: int = -1, verbose: bool = True) -> None:
    """Log INFO to stdout on the main process (rank -1 or 0); only warnings and errors elsewhere."""
    level = logging.INFO if verbose and rank in (-1, 0) else logging.WARNING
    LOGGER.setLevel(level)
    if not LOGGER.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
    LOGGER.propagate = False


def colorstr(text: str, colour: str = "bold") -> str:
    """Wrap ``text`` in an ANSI colour when stdout is a terminal."""
    codes = {"bold": "\033[1m", "blue": "\033[34m", "red": "\033[31m", "green": "\033[32m", "yellow": "\033[33m"}
    if not sys.stdout.isatty():
        return text
    return f"{codes.get(colour, '')}{text}\033[0m"
