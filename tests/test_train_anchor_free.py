"""train.py and val.py with the anchor-free families (YOLO11, YOLO26): the same features as for YOLOv5.

One tiny yolo11n run (2 epochs at 64 px, an epoch checkpoint kept) is shared by the checks of its outputs, of
exact resume and of test-time augmentation; DDP, --evolve and --image-weights/--quad have runs of their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import main_on_ranks, run_forked
from test_train import relative_l2, results_only, results_rows, weights

import train
import val
from utils.checkpoint import load_checkpoint
from utils.search.records import read_evolve_csv

# yolo11n at 32 px on 16 images of 96 px, batch 8; AutoAnchor left on (it must say that it does not apply).
TINY = ["--imgsz", "32", "--batch-size", "8", "--workers", "0", "--device", "cpu", "--noplots"]


@pytest.fixture(scope="module")
def yolo11_run(rectangles_yaml, tmp_path_factory) -> tuple[Path, str]:
    """A finished 2-epoch yolo11n run (with epoch0.pt) and its log."""
    project = tmp_path_factory.mktemp("yolo11")
    argv = [
        "--data",
        str(rectangles_yaml),
        "--cfg",
        "yolo11n.yaml",
        "--epochs",
        "2",
        "--save-period",
        "1",
        "--deterministic",
        "--seed",
        "1",
        "--project",
        str(project),
        "--name",
        "exp",
        *TINY,
    ]
    codes, outputs = main_on_ranks(train.main, argv, 1, project / "logs")
    assert codes == [0], outputs[0][-3000:]
    return project / "exp", outputs[0]


@pytest.mark.slow
def test_yolo11_trains_with_its_own_loss_terms_hyperparameters_and_no_autoanchor(yolo11_run) -> None:
    run_dir, log = yolo11_run
    rows = results_rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    for column in (
        "train/box_loss",
        "train/cls_loss",
        "train/dfl_loss",
        "val/box_loss",
        "val/cls_loss",
        "val/dfl_loss",
    ):
        assert all(float(r[column]) > 0 for r in rows), column
    assert not any("obj" in column for column in rows[0])
    assert log.count("AutoAnchor does not apply: yolo11 is anchor-free") == 1
    assert "box_loss   cls_loss   dfl_loss" in log
    hyp = yaml.safe_load((run_dir / "hyp.yaml").read_text())
    assert (hyp["box"], hyp["cls"], hyp["dfl"]) == (7.5, 0.5, 1.5)  # data/hyps/hyp.anchor-free.yaml by default
    ckpt = load_checkpoint(run_dir / "weights/last.pt")
    assert "model.23.dfl.conv.weight" in ckpt["model"] and ckpt["model_cfg"]["nc"] == 2


@pytest.mark.slow
def test_yolo11_resume_from_an_epoch_checkpoint_is_bit_exact(yolo11_run, tmp_path) -> None:
    run_dir, _ = yolo11_run
    copy = tmp_path / "exp"
    shutil.copytree(run_dir, copy)
    shutil.copyfile(run_dir / "weights/epoch0.pt", copy / "weights/last.pt")
    assert load_checkpoint(copy / "weights/last.pt")["epoch"] == 0
    codes, outputs = main_on_ranks(train.main, ["--resume", str(copy / "weights/last.pt")], 1, tmp_path / "logs")
    assert codes == [0], outputs[0][-3000:]
    resumed, straight = load_checkpoint(copy / "weights/last.pt"), load_checkpoint(run_dir / "weights/last.pt")
    assert resumed["epoch"] == straight["epoch"] == 1
    for key in ("model", "ema"):
        assert all(torch.equal(resumed[key][k], straight[key][k]) for k in straight[key]), key
    assert results_only(results_rows(copy)[-1]) == results_only(results_rows(run_dir)[-1])


@pytest.mark.slow
def test_val_with_test_time_augmentation_on_an_anchor_free_model(yolo11_run, rectangles_yaml, tmp_path) -> None:
    run_dir, _ = yolo11_run
    r = val.run(
        data=str(rectangles_yaml),
        weights=str(run_dir / "weights/last.pt"),
        imgsz=32,
        batch_size=8,
        workers=0,
        device="cpu",
        augment=True,
        noplots=True,
        project=str(tmp_path),
    )
    assert r.plain is not None and r.n_images == r.plain.n_images == 8
    assert r.n_detections > 0 and r.plain.n_detections > 0


@pytest.mark.slow
def test_yolo26_step_on_two_ranks_with_sync_bn_equals_one_process(rectangles_yaml, tmp_path) -> None:
    common = [
        "--data",
        str(rectangles_yaml),
        "--cfg",
        "yolo26n.yaml",
        "--epochs",
        "2",
        "--noval",
        "--deterministic",
        "--no-amp",
        "--optimizer",
        "SGD",
        "--seed",
        "3",
        "--sync-bn",
        "--name",
        "exp",
        *TINY,
        "--imgsz",
        "32",
    ]
    single = run_forked([(train.main, ([*common, "--project", str(tmp_path / "single")],), {})])
    assert single == [0]
    codes, outputs = main_on_ranks(train.main, [*common, "--project", str(tmp_path / "synced")], 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    reference = weights(tmp_path / "single/exp/weights/last.pt")
    diff = relative_l2(weights(tmp_path / "synced/exp/weights/last.pt"), reference)
    assert diff <= 2e-5
    loss_columns = ("train/box_loss", "train/cls_loss", "train/l1_loss")
    for one, two in zip(results_rows(tmp_path / "single/exp"), results_rows(tmp_path / "synced/exp"), strict=True):
        assert [f"{float(one[c]):.4g}" for c in loss_columns] == [f"{float(two[c]):.4g}" for c in loss_columns]


@pytest.mark.slow
def test_evolve_a_yolo11_over_its_own_hyperparameters(train_here, rectangles_yaml, tmp_path) -> None:
    from models.families import YOLO11

    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--cfg",
        "yolo11n.yaml",
        "--imgsz",
        "32",
        "--epochs",
        "1",
        "--project",
        tmp_path,
        "--name",
        "ev",
        "--evolve",
        "2",
    )
    assert status == 0, log
    keys = YOLO11.evolve_keys(YOLO11.read_hyp(YOLO11.default_hyp_path))
    assert "dfl" in keys and "obj" not in keys and "anchor_t" not in keys
    rows = read_evolve_csv(tmp_path / "ev/evolve.csv", keys, YOLO11.loss_names)
    assert rows.shape[0] == 2 and (rows[0] != rows[1]).any()


@pytest.mark.slow
def test_image_weights_and_quad_train_a_yolo26(train_here, rectangles_yaml, tmp_path) -> None:
    status, log = train_here(
        "--data",
        rectangles_yaml,
        "--cfg",
        "yolo26n.yaml",
        "--imgsz",
        "32",
        "--epochs",
        "2",
        "--project",
        tmp_path,
        "--image-weights",
        "--quad",
    )
    assert status == 0, log
    rows = results_rows(tmp_path / "exp")
    assert len(rows) == 2 and all(float(r["train/l1_loss"]) > 0 for r in rows)


@pytest.mark.slow
def test_fine_tune_from_an_ultralytics_checkpoint(train_here, rectangles_yaml, tmp_path) -> None:
    weights_file = Path(__file__).parent / "fixtures/ultralytics/yolo11-final.pt"
    status, log = train_here(
        "--data", rectangles_yaml, "--weights", weights_file, "--imgsz", "32", "--epochs", "1", "--project", tmp_path
    )
    assert status == 0, log
    assert "Ultralytics yolo11 checkpoint imported" in log and "Transferred" in log
    ckpt = load_checkpoint(tmp_path / "exp/weights/last.pt")
    assert ckpt["model_cfg"]["nc"] == 2 and ckpt["names"] == ["red", "blue"]
    assert float(results_rows(tmp_path / "exp")[0]["train/dfl_loss"]) > 0
