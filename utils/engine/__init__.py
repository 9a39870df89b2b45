"""The training engine: the run, its epochs and steps, resuming, the time budget and evolution.

train.py turns the command line into a ``TrainConfig`` (config.py) and calls ``run.run``. One module per job:
run.py (a run from its configuration: device, resume, evolution or training), trainer.py (the stages of one
training run), setup.py (data, model and run folder), optimization.py (optimizer, schedule, EMA, warmup),
epoch.py (one epoch of steps), step.py (one optimizer step), resume.py, time_budget.py, tally.py, run_record.py
(results.csv and checkpoints), lr_schedule.py and evolve.py. What differs between model families the engine asks
the run's family (models/families/: the family contract of docs/design.md).
"""
