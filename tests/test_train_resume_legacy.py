"""A checkpoint written before the run configuration had its own schema (argparse options stored as ``opt``)
resumes with the current code to the same weights, optimizer state and results as the code that wrote it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from utils.checkpoint import load_checkpoint

FIXTURE = Path(__file__).parent / "fixtures/legacy_resume"
# Where the fixture was made (its README): float kernels give the same bits only on the same torch and CPU kind.
MADE_WITH = ("2.14.1", "AVX2")


def _tensors(obj, where: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {where: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {name: t for key, value in items for name, t in _tensors(value, f"{where}/{key}").items()}


def _columns(csv_file: Path) -> dict[str, list[str]]:
    """results.csv as written (each value's text), column by column."""
    header, *rows = [[cell.strip() for cell in line.split(",")] for line in csv_file.read_text().splitlines()]
    return {name: [row[i] for row in rows] for i, name in enumerate(header)}


@pytest.mark.slow
def test_a_checkpoint_with_the_old_options_resumes_mid_epoch_as_the_old_code_did(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    run_dir = tmp_path / "runs/straight"
    (run_dir / "weights").mkdir(parents=True)
    shutil.copy(FIXTURE / "last.pt", run_dir / "weights/last.pt")
    shutil.copy(FIXTURE / "results.csv", run_dir / "results.csv")
    assert "opt" in load_checkpoint(run_dir / "weights/last.pt") and "config" not in load_checkpoint(
        run_dir / "weights/last.pt"
    )
    (tmp_path / "rect").symlink_to(Path(rectangles_yaml).parent)  # the run's --data: rect/rectangles.yaml
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)  # as the fixture was made (train_here restores the count)
    status, log = train_here("--resume", "runs/straight/weights/last.pt")
    assert status == 0, log
    assert "Resuming training at batch 1 of epoch 1" in log
    resumed = load_checkpoint(run_dir / "weights/last.pt")
    # The run's own options, read from "opt", are now its configuration under schema 1.
    assert resumed["config_schema"] == 1 and "opt" not in resumed
    config = resumed["config"]
    assert (config["cos_lr"], config["close_mosaic"], config["seed"], config["epochs"]) == (True, 1, 1, 2)
    expected = torch.load(FIXTURE / "expected_last.pt", weights_only=True)
    ours, theirs = _tensors(resumed), _tensors(expected)
    assert ours.keys() == theirs.keys()
    environment = (torch.__version__.split("+")[0], torch.backends.cpu.get_cpu_capability())
    if environment == MADE_WITH:  # bit for bit: weights, EMA, optimizer state, RNG state; every results.csv value
        assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
        # Every value of every column the old code wrote; the time split's columns (measurements) come after them.
        ours_csv, theirs_csv = (_columns(f) for f in (run_dir / "results.csv", FIXTURE / "expected_results.csv"))
        assert list(ours_csv)[: len(theirs_csv)] == list(theirs_csv)
        assert all(name.startswith("time/") for name in list(ours_csv)[len(theirs_csv) :])
        assert {name: ours_csv[name] for name in theirs_csv} == theirs_csv
    else:  # other kernels round otherwise: the same run, up to rounding
        for key in ("/model", "/ema"):
            names = [k for k in theirs if k.startswith(key + "/") and theirs[k].is_floating_point()]
            diff = torch.cat([(ours[k] - theirs[k]).double().flatten() for k in names]).norm()
            assert diff <= 1e-3 * torch.cat([theirs[k].double().flatten() for k in names]).norm(), (key, environment)
