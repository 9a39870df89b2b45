"""A resumed run keeps the optimizer, lr0, momentum and accumulation it started with (issue 30, defect 1)."""

from __future__ import annotations

import shutil

import pytest

from models.families import YOLOV5
from utils.checkpoint import load_checkpoint, save_checkpoint
from utils.optimizer import choose_optimizer, unused_hyp_values

HYP = YOLOV5.read_hyp(YOLOV5.default_hyp_path)


def _optimizer_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("optimizer: ")]


@pytest.mark.slow
def test_a_resume_with_many_more_epochs_or_a_time_budget_keeps_the_runs_optimizer(
    train_here, finished_run, tmp_path
) -> None:
    # 16 images, batch 8, 1 epoch: auto picks AdamW (a short run). 10002 epochs would pick SGD (> 10,000 steps);
    # the resumed run must still be AdamW (SGD loading AdamW's state died with KeyError 'momentum'). --time with a
    # budget spent after one epoch keeps the resumed run short.
    run_dir, log = finished_run[0].parents[1], finished_run[1]
    shutil.copytree(run_dir, tmp_path / "exp")
    assert "optimizer: AdamW" in log
    # auto set lr0 and momentum itself: the log names the hyp file's values it did not use
    assert (
        f"optimizer: the hyp file's lr0 {HYP.lr0} and momentum {HYP.momentum} not used (AdamW's own instead)"
        in _optimizer_lines(log)
    ), log
    last = tmp_path / "exp/weights/last.pt"
    saved = load_checkpoint(last)["optimizer_choice"]
    assert (saved["name"], saved["accumulate"], saved["momentum"]) == ("AdamW", 1, 0.9)
    first_lr0 = saved["lr0"]

    status, log = train_here("--resume", last, "--epochs", "10002", "--time", "0.000001")
    assert status == 0, log
    line = _optimizer_lines(log)[0]
    assert line.startswith(f"optimizer: AdamW lr0={first_lr0} momentum=0.9 accumulate=1 (the run's own"), line
    resumed = load_checkpoint(last)
    assert resumed["optimizer_choice"]["name"] == "AdamW" and resumed["epoch"] == 1

    # A checkpoint written before the choice was stored: derived from its saved options (1 epoch), not from now.
    old = tmp_path / "old/weights/last.pt"
    old.parent.mkdir(parents=True)
    ckpt = load_checkpoint(last)
    ckpt["config"]["epochs"], ckpt["config"]["time"] = 2, None
    del ckpt["optimizer_choice"]
    save_checkpoint(ckpt, old)
    status, log = train_here("--resume", old, "--epochs", "10002", "--time", "0.000001")
    assert status == 0, log
    line = _optimizer_lines(log)[0]
    assert line.startswith(f"optimizer: AdamW lr0={first_lr0} momentum=0.9 accumulate=1 (the run's own, derived"), line


def test_auto_says_which_hyp_values_it_did_not_use() -> None:
    short = choose_optimizer("auto", epochs=1, n_images=16, batch_size=8, nc=2, hyp=HYP)
    assert short.name == "AdamW"
    assert unused_hyp_values(short, HYP) == [f"lr0 {HYP.lr0}", f"momentum {HYP.momentum}"]
    long = choose_optimizer("auto", epochs=100_000, n_images=16, batch_size=8, nc=2, hyp=HYP)
    assert long.name == "SGD" and unused_hyp_values(long, HYP) == []
    assert unused_hyp_values(choose_optimizer("AdamW", 1, 16, 8, 2, HYP), HYP) == []
