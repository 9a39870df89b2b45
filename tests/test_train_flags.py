"""train.py flags and start-up rules, run in this process on tiny generated data (seconds each).

Each test asserts what the flag does (classes seen, batch shapes, learning rates, files written, where images
were read from), not only that the run ends.
"""

from __future__ import annotations

import csv
import json
import math
import os
import threading
import time
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import write_rectangles_dataset

import train
import utils.data.dataset as dataset_module
import utils.data.image_source as image_source_module
import utils.engine.run_record as run_record_module
import utils.engine.step as step_module
import utils.engine.trainer as trainer_module
from models.families import YOLOV5
from models.loss import ComputeLoss
from utils.checkpoint import load_checkpoint, save_checkpoint, strip_training_state
from utils.data.config import load_data_config
from utils.data.loader import load_labels
from utils.distributed import DistInfo
from utils.engine.config import TrainConfig
from utils.engine.run_record import RunRecord
from utils.engine.setup import freeze_layers, make_loaders
from utils.engine.step import BatchOptions, SavePolicy
from utils.engine.time_budget import fit_to_time, time_budget
from utils.errors import UserError
from utils.results_log import result_columns

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def five_classes(tmp_path_factory) -> Path:
    return write_rectangles_dataset(tmp_path_factory.mktemp("five"), n_classes=5)


def results(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "results.csv") as f:
        return [{k.strip(): float(v) for k, v in row.items()} for row in csv.DictReader(f, skipinitialspace=True)]


def record_calls(monkeypatch, owner, name: str, record) -> None:
    """Wrap ``owner.name`` so that ``record(args, result)`` sees every call."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        record(args, result)
        return result

    monkeypatch.setattr(owner, name, wrapped)


# ---- classes and devices ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_single_cls_keeps_every_image_and_trains_one_class(train_here, five_classes, tmp_path, monkeypatch) -> None:
    classes_seen: set[int] = set()
    record_calls(
        monkeypatch, ComputeLoss, "__call__", lambda args, _: classes_seen.update(args[2][:, 1].long().tolist())
    )
    # --local_rank is what torch.distributed.launch passes; it is accepted and LOCAL_RANK is what counts.
    status, log = train_here(
        "--data", five_classes, "--project", tmp_path, "--epochs", "1", "--single-cls", "--local_rank", "0"
    )
    assert status == 0, log
    summaries = [line for line in log.splitlines() if " corrupt, " in line]
    assert len(summaries) == 2 and all(
        "16 images: 16 labelled" in summaries[0] and ", 0 corrupt, " in line for line in summaries
    ), summaries  # train and val, nothing dropped
    assert classes_seen == {0}  # training (and validation's loss) saw one class
    ckpt = load_checkpoint(tmp_path / "exp/weights/last.pt")
    assert ckpt["model_cfg"]["nc"] == 1 and ckpt["names"] == ["item"]
    assert ckpt["model"]["model.24.m.0.weight"].shape[0] == 3 * (5 + 1)  # one class output per anchor


def test_local_rank_flags_are_accepted_in_both_spellings() -> None:
    for argv in (["--local-rank", "1"], ["--local_rank=2"]):
        opt, explicit = train.parse_opt(argv)
        assert opt.local_rank in (1, 2) and "local_rank" in explicit


def test_a_gpu_list_without_a_launcher_is_refused_with_the_command(train_here, rectangles_yaml, tmp_path) -> None:
    status, log = train_here("--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--device", "0,1")
    assert status == 1
    line = log.splitlines()[-1]
    assert line.startswith("ERROR --device 0,1 names 2 GPUs")
    assert "`python -m torch.distributed.run --nproc_per_node 2 train.py " in line and "--device 0,1" in line
    assert not tmp_path.joinpath("exp").exists()


def test_a_global_batch_that_does_not_divide_by_the_world_size_is_one_line(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    # Rank 0 of a 2-rank launch, as the launcher describes it: every rank checks this before joining the group.
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    status, log = train_here("--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--batch-size", "7")
    assert status == 1
    assert log.splitlines()[-1] == "ERROR --batch-size 7 must be a multiple of WORLD_SIZE 2: try --batch-size 6 or 8"
    assert not tmp_path.joinpath("exp").exists()
    monkeypatch.setenv("RANK", "1")  # the other rank stops alike, without saying it a second time
    status, log = train_here("--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--batch-size", "7")
    assert status == 1 and "--batch-size 7" not in log


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--weights", "missing.pt", "missing.pt: checkpoint not found"),
        ("--data", "nowhere.yaml", "nowhere.yaml"),
        ("--cfg", "models/nothing.yaml", "nothing.yaml"),
    ],
)
def test_a_failed_start_leaves_no_run_folder(train_here, rectangles_yaml, tmp_path, flag, value, message) -> None:
    args = ["--data", rectangles_yaml, "--project", tmp_path / "runs", "--epochs", "1", flag, value]
    status, log = train_here(*args)
    assert status == 1 and message in log.splitlines()[-1] and log.splitlines()[-1].startswith("ERROR ")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_bad_inputs_are_one_line_errors(train_here, rectangles_yaml, tmp_path) -> None:
    status, log = train_here("--data", tmp_path / "nope.yaml", "--project", tmp_path)
    assert status == 1 and "nope.yaml" in log.splitlines()[-1]
    not_ours = tmp_path / "foreign.pt"
    torch.save({"state": torch.zeros(1)}, not_ours)
    status, log = train_here("--data", rectangles_yaml, "--project", tmp_path, "--weights", not_ours)
    assert status == 1 and "not a checkpoint of this project" in log.splitlines()[-1]
    status, log = train_here("--resume", "--project", tmp_path / "empty")
    assert status == 1 and "no last.pt to resume" in log.splitlines()[-1]
    with pytest.raises(SystemExit) as e:  # argparse's error line (tests/test_cli.py)
        train_here("--data", rectangles_yaml, "--project", tmp_path, "--time", "0")
    assert e.value.code == 2 and not (tmp_path / "exp").exists()


@pytest.mark.slow
def test_fine_tune_with_optional_flags(train_here, finished_run, rectangles_yaml, tmp_path) -> None:
    start = finished_run[0]
    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--project",
        tmp_path / "tuned",
        "--weights",
        start,
        "--epochs",
        "2",
        "--single-cls",
        "--multi-scale",
        "--rect",
        "--freeze",
        "2",
        "--cos-lr",
        "--label-smoothing",
        "0.1",
        "--save-period",
        "1",
        "--optimizer",
        "SGD",
    )
    assert status == 0, log
    assert "Transferred" in log and "optimizer: SGD" in log
    run_dir = tmp_path / "tuned/exp"
    assert (run_dir / "weights/epoch0.pt").exists() and (run_dir / "weights/epoch1.pt").exists()
    before = load_checkpoint(start)["ema"]  # --weights starts from the EMA
    after = load_checkpoint(run_dir / "weights/last.pt")["model"]
    assert after["model.24.m.0.weight"].shape[0] == 3 * (1 + 5)  # one class: a new head
    for frozen in ("model.0.conv.weight", "model.1.conv.weight"):
        assert torch.equal(before[frozen], after[frozen]), frozen
    assert not torch.equal(before["model.2.cv1.conv.weight"], after["model.2.cv1.conv.weight"])


# ---- early stopping, validation, saving ------------------------------------------------------------------


def _record(tmp_path: Path, **kwargs) -> RunRecord:
    options = {"patience": 2, "noval": False, "nosave": True, "save_period": -1}
    return RunRecord(tmp_path, result_columns(("box", "obj", "cls")), **{**options, **kwargs})


def _stop_epoch(record: RunRecord, fitnesses: list[float | None]) -> int | None:
    """The epoch at which ``record`` asks to stop, given each epoch's mAP50-95 (None: not validated)."""
    for epoch, fit in enumerate(fitnesses):
        row = None if fit is None else (0.0, 0.0, 0.0, fit, 0.0, 0.0, 0.0)
        record.end_epoch(epoch, np.zeros(3), row, [0.01] * 3, {}, final=False)
        if record.should_stop():
            return epoch
    return None


def test_patience_counts_epochs_without_improvement_and_zero_turns_it_off(tmp_path) -> None:
    flat = [0.5, 0.4, 0.4, 0.3, 0.2, 0.1]
    assert _stop_epoch(_record(tmp_path / "a", patience=2), flat) == 2  # best at 0, two epochs without
    assert _stop_epoch(_record(tmp_path / "b", patience=3), [0.1, 0.2, 0.2, 0.2, 0.3, 0.1, 0.1, 0.1]) == 7
    assert _stop_epoch(_record(tmp_path / "c", patience=0), flat) is None  # YOLOv5's reading of 0
    assert _stop_epoch(_record(tmp_path / "d", patience=1, noval=True), [None] * 6) is None


def test_best_pt_is_the_improving_epochs_last_pt_byte_for_byte_and_stays_through_a_worse_epoch(tmp_path) -> None:
    record = _record(tmp_path, nosave=False)
    for epoch, fit in enumerate([0.2, 0.1]):
        ckpt = {"model_cfg": {}, "model": {"w": torch.full((3,), float(epoch))}, "ema": None, "epoch": epoch}
        record.end_epoch(epoch, np.zeros(3), (0.0, 0.0, 0.0, fit, 0.0, 0.0, 0.0), [0.01] * 3, ckpt, final=False)
        record.close()
        if epoch == 0:
            assert record.best.read_bytes() == record.last.read_bytes()
    assert load_checkpoint(record.last)["epoch"] == 1
    best = load_checkpoint(record.best)
    assert best["epoch"] == 0 and best["best_epoch"] == 0 and torch.equal(best["model"]["w"], torch.zeros(3))
    assert not list(record.weights_dir.glob(".*.tmp"))  # no temporary file left beside them


@pytest.mark.slow
def test_noval_validates_the_last_epoch_and_nosave_writes_only_its_checkpoint(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    written: list[str] = []
    for writer in ("save_checkpoint", "copy_checkpoint"):  # best.pt is a copy of last.pt
        record_calls(monkeypatch, run_record_module, writer, lambda args, _: written.append(Path(args[1]).name))
    status, log = train_here(
        "--data", rectangles_yaml, "--project", tmp_path, "--epochs", "3", "--noval", "--patience", "1", "--nosave"
    )
    assert status == 0, log
    rows = results(tmp_path / "exp")
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert [r["metrics/mAP_0.5"] for r in rows[:2]] == [0.0, 0.0] and rows[2]["val/obj_loss"] > 0
    assert (tmp_path / "exp/weights/best.pt").is_file()
    assert load_checkpoint(tmp_path / "exp/weights/best.pt")["best_epoch"] == 2
    assert written.count("last.pt") == 1 and set(written) <= {"last.pt", "best.pt"}  # --nosave: the final one only
    # The log accounts for the run's time phase by phase (utils/engine/phases.py).
    phases = {line.split(":")[0].removeprefix("phase ") for line in log.splitlines() if line.startswith("phase ")}
    for phase in (
        "imports and process set-up",
        "data scan and caches",
        "model",
        "loaders",
        "first batch",
        "first step",
        "epoch 2 validation",
        "checkpoint last.pt, best.pt (epoch 2) written",
        "checkpoints written",
        "tracker close",
        "exit",
    ):
        assert phase in phases, (phase, sorted(phases))


def test_nosave_writes_the_final_epochs_checkpoint_and_saving_writes_every_epochs(tmp_path) -> None:
    for nosave, expected in ((True, [2]), (False, [0, 1, 2])):
        record = _record(tmp_path / str(nosave), nosave=nosave, patience=0)
        saved = []
        for epoch in range(3):
            ckpt = {"model_cfg": {}, "model": {"w": torch.full((1,), float(epoch))}, "ema": None, "epoch": epoch}
            record.end_epoch(epoch, np.zeros(3), None, [0.01] * 3, ckpt, final=epoch == 2)
            record.close()
            if record.last.exists():
                saved.append(load_checkpoint(record.last)["epoch"])
        assert sorted(set(saved)) == expected, nosave


# ---- what the flags change in training -------------------------------------------------------------------


def _training_batches(data: Path, epochs: int, **options):
    """``(epoch, batch)`` of the training loader the engine builds for these options (utils/engine/setup.py),
    iterated for ``epochs`` without a model: what a flag changes in the batches needs no training."""
    config = TrainConfig(data=str(data), imgsz=64, batch_size=8, workers=0, epochs=epochs, **options)
    data_config = load_data_config(config.data)
    labels = [
        load_labels(data_config[split], nc=data_config["nc"], workers=0, verbose=False) for split in ("train", "val")
    ]
    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    stage = YOLOV5.stage_epoch(epochs, config.close_mosaic, hyp)  # --close-mosaic's
    loader, _, _ = make_loaders(config, DistInfo(rank=-1, local_rank=-1, world_size=1), hyp, 32, labels, stage)
    for epoch in range(epochs):
        loader.set_epoch(epoch, 0)
        for batch in loader:
            yield epoch, batch


def test_rect_batches_keep_the_aspect_ratio(tmp_path) -> None:
    wide = write_rectangles_dataset(tmp_path / "wide", size=48, width=96)  # 2:1 images
    options = BatchOptions(seed=0, imgsz=64, grid=32, multi_scale=False, quad=False)
    for rect, expected in ((True, {(32, 64)}), (False, {(64, 64)})):  # letterboxed to the 2:1 batch shape
        shapes = {
            tuple(step_module.prepare_images(b[0], options, torch.device("cpu"), e, i).shape[2:])
            for i, (e, b) in enumerate(_training_batches(wide, 1, rect=rect))
        }
        assert shapes == expected, rect


def test_multi_scale_draws_stride_aligned_sizes_per_step() -> None:
    images = torch.zeros(8, 3, 64, 64, dtype=torch.uint8)
    for multi_scale in (True, False):
        options = BatchOptions(seed=0, imgsz=64, grid=32, multi_scale=multi_scale, quad=False)
        shapes = [
            tuple(step_module.prepare_images(images, options, torch.device("cpu"), epoch, batch).shape[2:])
            for epoch in range(3)
            for batch in range(2)
        ]  # what 3 epochs of 2 batches draw
        if multi_scale:
            assert all(h == w and h % 32 == 0 and 32 <= h <= 96 + 32 for h, w in shapes), shapes
            assert len(set(shapes)) > 1  # 6 steps, 3 possible sizes
            again = step_module.prepare_images(images, options, torch.device("cpu"), 2, 1)
            assert tuple(again.shape[2:]) == shapes[-1]  # a function of (seed, epoch, batch): a resume redraws it
        else:
            assert set(shapes) == {(64, 64)}


@pytest.mark.slow
def test_cos_lr_makes_the_lr_curve_a_cosine_and_a_stuck_disk_holds_up_no_epoch(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    # The linear curve, the default, is checked in results.csv by the resume and --time tests below.
    # The same run checks the checkpoint writer: its first write sticks (a disk that stops answering) until the
    # run's end waits for it; every epoch must have ended by then.
    release, written, rows_at_close = threading.Event(), [], []
    save, close = run_record_module.save_checkpoint, RunRecord.close

    def stuck_save(ckpt, path):
        if not written:
            assert release.wait(120)
        save(ckpt, path)
        written.append((Path(path).name, ckpt["epoch"]))

    def close_releasing(self, timeout=None):
        rows_at_close.append((len(results(self.save_dir)), list(written)))
        release.set()
        return close(self, timeout)

    monkeypatch.setattr(run_record_module, "save_checkpoint", stuck_save)
    monkeypatch.setattr(RunRecord, "close", close_releasing)
    hyp = yaml.safe_load((ROOT / "data/hyps/hyp.scratch-low.yaml").read_text())
    hyp.update(warmup_epochs=0, lr0=0.01, lrf=0.1)
    (tmp_path / "hyp.yaml").write_text(yaml.safe_dump(hyp))
    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--project",
        tmp_path,
        "--epochs",
        "4",
        "--noval",
        "--optimizer",
        "SGD",
        "--hyp",
        tmp_path / "hyp.yaml",
        "--cos-lr",
    )
    assert status == 0, log
    for row in results(tmp_path / "exp"):
        ramp = (1 - math.cos(math.pi * row["epoch"] / 4)) / 2
        expected = 0.01 * (1 + (0.1 - 1) * ramp)
        assert [row[f"x/lr{j}"] for j in range(3)] == pytest.approx([expected] * 3, rel=1e-5), row  # csv keeps 6 digits
    # All 4 epochs ended while epoch 0's write was stuck; then the newest snapshot (epoch 3) replaced those of
    # epochs 1 and 2, which were never written, and is the newest complete checkpoint.
    assert rows_at_close[0] == (4, [])
    assert written == [("last.pt", 0), ("last.pt", 3)]
    assert load_checkpoint(tmp_path / "exp/weights/last.pt")["epoch"] == 3
    assert f"newest complete checkpoint: {tmp_path / 'exp/weights/last.pt'} (epoch 3)" in log
    assert json.loads((tmp_path / "exp/run.json").read_text())["checkpoint"] == "epoch 3"


def _reads_per_image(monkeypatch) -> Counter:
    reads: Counter = Counter()
    for name in ("read_image", "read_image_region"):
        record_calls(
            monkeypatch,
            image_source_module,
            name,
            lambda args, _: reads.update([f"{Path(args[0]).parent.name}/{Path(args[0]).name}"]),
        )
    return reads


@pytest.mark.parametrize("mode", ["off", "ram", "disk"])
def test_cache_decides_where_images_are_read_from(tmp_path, monkeypatch, mode) -> None:
    data = write_rectangles_dataset(tmp_path / "data", n_train=8, n_val=4)
    reads = _reads_per_image(monkeypatch)
    assert len(list(_training_batches(data, 2, cache=mode))) == 2  # two epochs of one batch
    train_files = {f"train/{i:04d}.jpg" for i in range(8)}
    train_reads = {name: n for name, n in reads.items() if name in train_files}
    npy = sorted((tmp_path / "data/images/train").glob("*.npy"))
    if mode == "off":  # read from the JPEG file every epoch (2 epochs: close-mosaic leaves one image per sample)
        assert train_reads == dict.fromkeys(train_files, 2) and not npy
    elif mode == "ram":  # one read each, to fill the cache
        assert train_reads == dict.fromkeys(train_files, 1) and not npy
    else:  # one read each, to write the .npy file; training reads those
        assert train_reads == dict.fromkeys(train_files, 1) and len(npy) == len(train_files)


# ---- non-finite losses -----------------------------------------------------------------------------------


def _poison_loss(monkeypatch, bad_calls: set[int]) -> None:
    """Make ComputeLoss return a NaN loss on the given calls (0-based, training and validation alike)."""
    original, calls = ComputeLoss.__call__, [0]

    def poisoned(self, preds, targets, norm=None, prepared=None, reduce=None):
        loss, items = original(self, preds, targets, norm, prepared, reduce)
        calls[0] += 1
        if calls[0] - 1 in bad_calls:
            return loss * float("nan"), items * float("nan")
        return loss, items

    monkeypatch.setattr(ComputeLoss, "__call__", poisoned)


@pytest.mark.slow
def test_a_nan_loss_skips_the_step_and_counts_it(train_here, rectangles_yaml, tmp_path, monkeypatch) -> None:
    _poison_loss(monkeypatch, {0})  # the first micro-batch of the first step (an explicit optimizer accumulates)
    status, log = train_here(
        "--data", rectangles_yaml, "--project", tmp_path, "--epochs", "2", "--noval", "--optimizer", "AdamW"
    )
    assert status == 0, log
    # Read back at the epoch's end (its one step): the skipped update is counted on the device, reported there.
    assert "WARNING epoch 0 end: 1 optimizer steps skipped for non-finite gradients since the last read-back" in log
    assert "1 steps skipped (non-finite gradients)" in log
    ckpt = load_checkpoint(tmp_path / "exp/weights/last.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_diverged_training_stops_with_one_line_and_keeps_the_good_checkpoint(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    # An explicit optimizer accumulates up to the nominal batch of 64: one optimizer step per epoch here.
    status, log = train_here(
        "--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--noval", "--optimizer", "AdamW"
    )
    assert status == 0, log
    last = tmp_path / "exp/weights/last.pt"
    good = load_checkpoint(last)
    monkeypatch.setattr(step_module, "MAX_NONFINITE_STEPS", 2)
    _poison_loss(monkeypatch, set(range(1000)))

    # A slow disk: epoch 1's checkpoint is still being written when epoch 2 fails. The error must wait for it.
    def slow_save(ckpt, path):
        time.sleep(1.5)
        save_checkpoint(ckpt, path)

    monkeypatch.setattr(run_record_module, "save_checkpoint", slow_save)
    status, log = train_here("--resume", last, "--epochs", "4")
    assert status == 1
    assert log.splitlines()[-1].startswith("ERROR epoch 2 end: 2 optimizer steps in a row had non-finite")
    # Epoch 1 ended with its one step skipped and was saved: finite, and the EMA (what --weights and val use)
    # is the good one, untouched by the skipped steps.
    kept = load_checkpoint(last)
    assert kept["epoch"] == 1 and all(torch.isfinite(v).all() for v in kept["model"].values())
    assert all(torch.equal(kept["ema"][k], v) for k, v in good["ema"].items())


def test_non_finite_weights_never_replace_a_checkpoint(tmp_path) -> None:
    record = _record(tmp_path, nosave=False)
    good = {"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}}
    record.end_epoch(0, np.zeros(3), (0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0), [0.01] * 3, good, final=False)
    record.close()
    before = (record.last.read_bytes(), record.best.read_bytes())
    bad = {"model": {"w": torch.tensor([1.0, float("inf")])}, "ema": {"w": torch.ones(2)}}
    record.end_epoch(1, np.zeros(3), (0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0), [0.01] * 3, bad, final=True)
    record.close()
    assert (record.last.read_bytes(), record.best.read_bytes()) == before


# ---- resume ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_more_epochs_extends_a_finished_run_in_its_folder(train_here, rectangles_yaml, tmp_path) -> None:
    hyp = yaml.safe_load((ROOT / "data/hyps/hyp.scratch-low.yaml").read_text())
    hyp.update(warmup_epochs=0, lr0=0.01, lrf=0.1)
    (tmp_path / "hyp.yaml").write_text(yaml.safe_dump(hyp))
    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--project",
        tmp_path,
        "--epochs",
        "2",
        "--noval",
        "--optimizer",
        "SGD",
        "--hyp",
        tmp_path / "hyp.yaml",
    )
    assert status == 0, log
    last = tmp_path / "exp/weights/last.pt"
    status, log = train_here("--resume", last)
    assert status == 0 and "already finished its 2 epochs" in log  # nothing to do without --epochs
    status, log = train_here("--resume", last, "--epochs", "4")
    assert status == 0, log
    assert "the learning rate goes on from" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "hyp.yaml"]  # the same run folder
    rows = results(tmp_path / "exp")
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    # Epochs 0-1 ran the 2-epoch schedule (1 -> 0.1 at epoch 2); the extension goes on from where that schedule
    # stood at epoch 2 (0.1) to lrf (0.1) at the new end: a finished run continues at lr0 * lrf.
    lrs = [r["x/lr0"] for r in rows]
    assert lrs == pytest.approx([0.01, 0.01 * (1 - 0.9 / 2), 0.001, 0.001], rel=1e-5)
    assert load_checkpoint(last)["config"]["epochs"] == 4


def test_a_launcher_job_continues_only_its_own_run_folder(train_here, rectangles_yaml, tmp_path, monkeypatch) -> None:
    # Scripts often fix the launcher's run id (--rdzv-id), so an old job's folder can carry the same id.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "nightly")
    args = ("--data", rectangles_yaml, "--project", tmp_path, "--epochs", "1", "--noval", "--noplots")
    assert train_here(*args)[0] == 0
    os.utime(tmp_path / "exp/run_id", (0, 0))  # made by an earlier job: before this launcher started
    status, log = train_here(*args)  # a fresh start (restart count 0) never resumes anything
    assert status == 0 and "Resuming" not in log and (tmp_path / "exp2/weights/last.pt").exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart of this job finds this job's folder
    status, log = train_here(*args)
    assert status == 0 and f"continuing {tmp_path / 'exp2'}" in log, log
    os.utime(tmp_path / "exp2/run_id", (0, 0))  # now no folder is this job's: the restart starts a new one
    status, log = train_here(*args)
    assert status == 0 and "continuing" not in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp2", "exp3"]


@pytest.mark.slow
def test_save_minutes_writes_checkpoints_inside_an_epoch_once_the_time_has_passed(
    train_here, rectangles96_yaml, tmp_path, monkeypatch
) -> None:
    # 96 images, global batch 32: 3 batches, a step each (the automatic choice does not accumulate in a short run).
    # Rank 0's wish goes out with the read-back after step 1 (--log-interval 1) and is read at the next, after step
    # 2: a checkpoint before batch 2 of each epoch.
    saved: list[dict] = []
    record_calls(monkeypatch, RunRecord, "save_mid_epoch", lambda args, result: saved.append(args[1]["mid_epoch"]))
    status, log = train_here(
        "--data",
        rectangles96_yaml,
        "--project",
        tmp_path,
        "--epochs",
        "2",
        "--noval",
        "--batch-size",
        "32",
        "--save-minutes",
        "0.00001",
        "--log-interval",
        "1",
    )
    assert status == 0, log
    assert [(m["epoch"], m["batch"]) for m in saved] == [(0, 2), (1, 2)]


def test_save_minutes_and_save_steps_decide_when_rank_0_wants_a_checkpoint(monkeypatch) -> None:
    stepper = types.SimpleNamespace(steps_done=3, last_save=1000.0)
    monkeypatch.setattr(step_module.time, "monotonic", lambda: 1000.0 + 9.9 * 60)
    assert not SavePolicy(every_steps=0, every_minutes=10).wants_save(stepper)  # 10 minutes have not passed
    assert SavePolicy(every_steps=0, every_minutes=9.9).wants_save(stepper)
    assert SavePolicy(every_steps=3, every_minutes=0).due_by_steps(stepper)  # every 3rd step, known on every rank
    assert not SavePolicy(every_steps=3, every_minutes=0).wants_save(stepper)  # not a wish sent to the others
    assert not SavePolicy(every_steps=2, every_minutes=0).due_by_steps(stepper)
    assert not SavePolicy(every_steps=0, every_minutes=0).due_by_steps(stepper)  # 0: never
    assert not SavePolicy(every_steps=0, every_minutes=0).wants_save(stepper)


def test_an_unfinished_run_extended_continues_its_lr_without_a_jump() -> None:
    from utils.engine.lr_schedule import LrSchedule

    schedule = LrSchedule.for_run(10, 0.01)
    longer = schedule.extended(4, 20, 0.01)
    assert [longer(e) for e in range(5)] == pytest.approx([schedule(e) for e in range(5)])
    assert longer(19) == pytest.approx(0.01 + (schedule(4) - 0.01) / 16)  # linear from epoch 4 to lrf at 20
    assert longer(20) == pytest.approx(0.01)
    shorter = schedule.extended(4, 6, 0.01)
    assert shorter(6) == pytest.approx(0.01) and shorter(5) == pytest.approx((schedule(4) + 0.01) / 2)


@pytest.mark.slow
def test_resume_refuses_a_flag_it_cannot_change_and_names_it(train_here, finished_run, tmp_path) -> None:
    last = finished_run[0]
    for flag, value in (("--imgsz", "96"), ("--cfg", "models/yolov5s.yaml"), ("--single-cls", None)):
        status, log = train_here("--resume", last, flag, *([value] if value else []))
        assert status == 1, log
        line = log.splitlines()[-1]
        assert line.startswith("ERROR ") and flag in line and "cannot change when resuming" in line, line

    stripped = tmp_path / "stripped.pt"
    save_checkpoint(load_checkpoint(last), stripped)
    strip_training_state(stripped)
    status, log = train_here("--resume", stripped)
    assert status == 1
    line = log.splitlines()[-1]
    assert line.startswith(f"ERROR {stripped}: ") and "last.pt" in line and "\n" not in line


# ---- --time ----------------------------------------------------------------------------------------------


def test_time_budget_gives_the_number_of_epochs_after_the_first() -> None:
    config = TrainConfig(time=0.5, close_mosaic=10, epochs=300)  # 1800 s, counted from the first epoch's start
    budget = time_budget(config, process_started=0.0, loop_started=100.0)
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=170.0, epoch_seconds=60.0, config=config) == {"epochs": 30}
    assert fit_to_time(budget, epoch=5, start_epoch=0, now=700.0, epoch_seconds=60.0, config=config) == {}
    assert fit_to_time(budget, epoch=29, start_epoch=0, now=1850.0, epoch_seconds=60.0, config=config) == {"stop": True}
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=101.0, epoch_seconds=1.0, config=config) == {"epochs": 1800}


def test_time_budget_fits_again_to_the_second_epochs_steady_speed() -> None:
    """A first epoch slowed by one-off costs (a busy machine's start-up, the cache filling) fits too few epochs; the
    second epoch's speed refits the run to the budget then left (issue 49: the demo fitted 4 of 22 epochs)."""
    config = TrainConfig(epochs=22, time=270 / 3600, time_includes_startup=True, time_max_epochs=22)
    budget = time_budget(config, process_started=0.0, loop_started=25.0)
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=85.0, epoch_seconds=60.0, config=config) == {"epochs": 4}
    fitted = config.replace(epochs=4)
    # Epoch 1 took 10 s: 175 s are left at 95 s, 17 more epochs, 19 in all.
    assert fit_to_time(budget, epoch=1, start_epoch=0, now=95.0, epoch_seconds=10.0, config=fitted) == {"epochs": 19}
    # Later epochs never refit; a resumed process refits after its own first two.
    assert fit_to_time(budget, epoch=2, start_epoch=0, now=105.0, epoch_seconds=5.0, config=fitted) == {}
    assert fit_to_time(budget, epoch=6, start_epoch=5, now=105.0, epoch_seconds=10.0, config=fitted) == {"epochs": 22}


def test_the_demo_budget_fits_its_epochs_to_the_whole_run_and_never_more_than_its_own() -> None:
    # The demo's: 270 s from the process start, at most 22 epochs (train.py's preset). Start-up took 25 s here.
    config = TrainConfig(epochs=22, time=270 / 3600, time_includes_startup=True, time_max_epochs=22)
    budget = time_budget(config, process_started=0.0, loop_started=25.0)
    assert budget.for_epochs == pytest.approx(245.0)
    # A slow machine (24 s epochs): the 245 s left fit 10 epochs; it stops before an epoch that would overrun.
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=49.0, epoch_seconds=24.0, config=config) == {"epochs": 10}
    assert fit_to_time(budget, epoch=8, start_epoch=0, now=241.0, epoch_seconds=24.0, config=config) == {}
    assert fit_to_time(budget, epoch=8, start_epoch=0, now=247.0, epoch_seconds=24.0, config=config) == {"stop": True}
    # A fast machine (5 s epochs would fit 49): the preset's 22, so nothing to refit; the run is today's.
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=30.0, epoch_seconds=5.0, config=config) == {}
    assert fit_to_time(budget, epoch=21, start_epoch=0, now=135.0, epoch_seconds=5.0, config=config) == {}
    # Just over: 11.1 s epochs fit 22, exactly the preset.
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=36.1, epoch_seconds=11.1, config=config) == {}
    assert fit_to_time(budget, epoch=0, start_epoch=0, now=36.2, epoch_seconds=11.2, config=config) == {"epochs": 21}


@pytest.mark.slow
def test_time_refits_the_schedule_and_close_mosaic(train_here, rectangles_yaml, tmp_path, monkeypatch) -> None:
    # The measured epoch time decides the number of epochs; here that decision is fixed at 3 epochs.
    monkeypatch.setattr(trainer_module, "fit_to_time", lambda budget, epoch, *_: {"epochs": 3} if epoch == 0 else {})
    mosaic_epochs: list[bool] = []
    record_calls(
        monkeypatch,
        dataset_module.YoloDataset,
        "mosaic_enabled",
        lambda args, enabled: mosaic_epochs.append((args[1], enabled)),
    )
    hyp = yaml.safe_load((ROOT / "data/hyps/hyp.scratch-low.yaml").read_text())
    hyp.update(warmup_epochs=0, lr0=0.01, lrf=0.1)
    (tmp_path / "hyp.yaml").write_text(yaml.safe_dump(hyp))
    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--project",
        tmp_path,
        "--epochs",
        "300",
        "--time",
        "1",
        "--close-mosaic",
        "1",
        "--noval",
        "--optimizer",
        "SGD",
        "--hyp",
        tmp_path / "hyp.yaml",
    )
    assert status == 0, log
    rows = results(tmp_path / "exp")
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]  # not 300
    # Epoch 0 ran the 300-epoch schedule; from epoch 1 on, the 3-epoch one: 1 -> 0.1 over 3 epochs.
    assert [r["x/lr0"] for r in rows] == pytest.approx([0.01, 0.01 * (1 - 0.9 / 3), 0.01 * (1 - 0.9 * 2 / 3)], rel=1e-5)
    assert {e for e, enabled in mosaic_epochs if enabled} == {0, 1} and {e for e, on in mosaic_epochs if not on} == {2}
    assert "1 epochs completed" not in log and "3 epochs completed" in log


def test_freeze_keeps_what_the_model_fixes_itself_and_freezes_only_the_layers_asked_for() -> None:
    """The DFL bins take no part in the training loss: made trainable, DDP stops at them (an unused parameter)."""
    from models.yolo import build_model

    model = build_model("yolo11n.yaml", nc=2)
    freeze_layers(model, [0])
    frozen = sorted(name for name, p in model.named_parameters() if not p.requires_grad)
    assert frozen == ["model.23.dfl.conv.weight"]
    freeze_layers(model, [2])
    first_two = {name for name, _ in model.named_parameters() if name.startswith(("model.0.", "model.1."))}
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert first_two and frozen == {"model.23.dfl.conv.weight"} | first_two
    n_layers = 1 + max(int(name.split(".")[1]) for name, _ in model.named_parameters())
    freeze_layers(model, [n_layers])  # every layer: allowed
    for freeze in ([1000], [0, n_layers]):
        with pytest.raises(UserError, match=rf"--freeze .*: the model has {n_layers} layers \(0 to {n_layers - 1}\)"):
            freeze_layers(model, freeze)
