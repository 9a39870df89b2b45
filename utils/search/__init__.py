"""Hyper-parameter search on Optuna: one study of N trials shared by any number of workers and machines.

``Search(SearchConfig(...), SearchSpace(...))`` joins (or starts) the study; ``next_trial()`` gives a
``SearchTrial`` (its ``hyp``, ``report`` for pruning, ``complete``/``prune``/``fail``) until N have finished;
``write_records()`` writes YOLOv5's evolve.csv and hyp_evolve.yaml from the completed trials. Samplers: YOLOv5's
genetic evolution (``genetic.py``, the default), Optuna's TPE and CMA-ES. Optuna is imported only here, when a
search starts.
"""

from utils.search.space import SearchSpace
from utils.search.study import PRUNERS, SAMPLERS, Search, SearchConfig, SearchTrial

__all__ = ["PRUNERS", "SAMPLERS", "Search", "SearchConfig", "SearchSpace", "SearchTrial"]
