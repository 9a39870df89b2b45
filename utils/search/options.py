"""The search's command-line options (train.py's ``--evolve*``), defined once, beside the study they configure."""

from __future__ import annotations

import argparse

from utils.search.study import PRUNERS, SAMPLERS


def add_search_options(group: argparse._ArgumentGroup) -> None:
    """--evolve: one Optuna study of N trials, shared by every process given the same storage."""
    group.add_argument(
        "--evolve",
        type=int,
        nargs="?",
        const=300,
        default=None,
        metavar="N",
        help="search hyper-parameters: N trials in total (300 when N is left out), in runs/evolve/exp",
    )
    group.add_argument(
        "--evolve-storage",
        default="",
        metavar="PATH|URL",
        help="the search's study: a journal file (on a shared file system for several machines) or "
        "an SQL database URL; every process given it works on one study (default: "
        "study.journal in a new evolution folder)",
    )
    group.add_argument(
        "--evolve-sampler",
        default="genetic",
        choices=SAMPLERS,
        help="how trials are drawn: YOLOv5's genetic evolution, Optuna's TPE or CMA-ES",
    )
    group.add_argument(
        "--evolve-pruner",
        default="median",
        choices=PRUNERS,
        help="median: stop a trial whose fitness after an epoch is below the median of the "
        "others' (trials validate every epoch); none: train every trial to its end",
    )
    group.add_argument(
        "--resume-evolve",
        "--resume_evolve",
        default=None,
        metavar="PATH",
        help="with --evolve N: continue the study of this evolution folder (or of the folder "
        "holding this evolve.csv) up to N trials in total",
    )
