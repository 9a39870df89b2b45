"""The training recipe: the automatic optimizer choice and closing mosaic for the last epochs."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch.distributed as dist
import yaml
from conftest import fork_ranks, run_forked

from models.families import YOLOV5
from utils.data.loader import create_dataloader
from utils.optimizer import SHORT_RUN_STEPS, choose_optimizer, optimizer_steps

HYP = YOLOV5.read_hyp(YOLOV5.default_hyp_path)


def test_optimizer_steps_counts_accumulated_batches() -> None:
    assert optimizer_steps(epochs=20, n_images=800, batch_size=16, accumulate=4) == 20 * 13
    assert optimizer_steps(epochs=1, n_images=10, batch_size=64, accumulate=1) == 1


def run_of(steps: int, batch_size: int = 16) -> dict:
    """choose_optimizer's run-length arguments for ``steps`` optimizer steps at the nominal batch of 64."""
    return {"epochs": steps, "n_images": 64, "batch_size": batch_size}


def test_auto_picks_adamw_stepping_every_batch_for_short_runs_and_sgd_for_long_runs() -> None:
    short = choose_optimizer("auto", **run_of(260), nc=5, hyp=HYP)
    assert short.name == "AdamW" and short.lr0 == pytest.approx(0.05 / 9, abs=1e-6) and short.momentum == 0.9
    assert short.accumulate == 1 and "short" in short.reason and "a step every batch (1040 steps)" in short.reason
    long = choose_optimizer("auto", **run_of(SHORT_RUN_STEPS + 1), nc=80, hyp=HYP)
    assert (long.name, long.lr0, long.momentum, long.accumulate) == ("SGD", HYP.lr0, HYP.momentum, 4)
    assert choose_optimizer("auto", **run_of(100), nc=80, hyp=HYP).lr0 < short.lr0  # more classes, smaller lr
    assert choose_optimizer("auto", **run_of(100), nc=1, hyp=HYP).lr0 == 0.01  # capped at SGD's rate


def test_explicit_optimizer_always_wins_with_yolov5s_accumulation() -> None:
    for name in ("SGD", "Adam", "AdamW"):
        for steps in (10, 10 * SHORT_RUN_STEPS):
            for batch_size, accumulate in ((16, 4), (8, 8), (64, 1), (128, 1)):
                choice = choose_optimizer(name, **run_of(steps, batch_size), nc=5, hyp=HYP)
                assert (choice.name, choice.lr0, choice.momentum) == (name, HYP.lr0, HYP.momentum)
                assert choice.accumulate == accumulate


# ---- close-mosaic -------------------------------------------------------------------------------------------
# Every image is one flat, unique colour: a mosaic sample shows several colours, a plain one shows one.
N_IMAGES, SIZE, CLOSE_AT, EPOCHS = 8, 64, 2, 4
MOSAIC_ONLY = HYP.replace(
    **dict.fromkeys(
        (
            "hsv_h",
            "hsv_s",
            "hsv_v",
            "degrees",
            "translate",
            "scale",
            "shear",
            "perspective",
            "flipud",
            "fliplr",
            "mixup",
        ),
        0.0,
    ),
    mosaic=1.0,
)


@pytest.fixture(scope="module")
def flat_colour_images(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("flat")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    for i in range(N_IMAGES):
        colour = (20 + 25 * i, 200 - 20 * i, 60 + 10 * i)
        cv2.imwrite(str(root / "images" / f"{i}.png"), np.full((SIZE, SIZE, 3), colour, np.uint8))
        (root / "labels" / f"{i}.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    return str(root / "images")


def _mosaic_per_epoch(
    images: str, workers: int, rank: int = 0, world_size: int = 1, epochs: range = range(EPOCHS)
) -> dict[int, list[bool]]:
    loader, _ = create_dataloader(
        images,
        SIZE,
        2,
        32,
        hyp=MOSAIC_ONLY,
        augment=True,
        shuffle=True,
        workers=workers,
        seed=3,
        close_mosaic_epoch=CLOSE_AT,
        global_rank=rank,
        world_size=world_size,
    )
    seen = {}
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        seen[epoch] = [
            np.unique(img.reshape(3, -1).numpy(), axis=1).shape[1] > 1 for imgs, *_ in loader for img in imgs
        ]
    return seen


def _expected(epochs) -> dict[int, bool]:
    return {e: e < CLOSE_AT for e in epochs}


@pytest.mark.parametrize("workers", [0, 2])
def test_close_mosaic_switches_at_the_right_epoch(flat_colour_images, workers: int) -> None:
    seen = _mosaic_per_epoch(flat_colour_images, workers)
    assert {e: all(v) if e < CLOSE_AT else any(v) for e, v in seen.items()} == _expected(range(EPOCHS))


def test_a_fresh_loader_starting_in_the_closed_epochs_has_no_mosaic(flat_colour_images) -> None:
    # What a resume does: new loader, first epoch already past the switch.
    seen = _mosaic_per_epoch(flat_colour_images, workers=2, epochs=range(CLOSE_AT + 1, EPOCHS))
    assert not any(any(v) for v in seen.values())


def _ddp_worker(rank: int, images: str, out: str) -> None:
    dist.init_process_group("gloo")
    seen = _mosaic_per_epoch(images, workers=2, rank=rank, world_size=2)
    with open(f"{out}.{rank}", "w") as f:
        yaml.safe_dump({e: [bool(x) for x in v] for e, v in seen.items()}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_close_mosaic_under_two_rank_ddp(flat_colour_images, tmp_path) -> None:
    out = str(tmp_path / "seen")
    assert fork_ranks(_ddp_worker, 2, flat_colour_images, out) == [0, 0]
    for rank in range(2):
        seen = yaml.safe_load(open(f"{out}.{rank}"))
        assert {e: all(v) if e < CLOSE_AT else any(v) for e, v in seen.items()} == _expected(range(EPOCHS))


@pytest.mark.slow
def test_short_training_learns_more_with_the_new_defaults_than_with_the_old(tmp_path) -> None:
    import csv

    from conftest import write_rectangles_dataset

    import train

    # 6 epochs of 20 batches (nominal batch 64): 30 optimizer steps. 15 steps, as this test first used, left
    # both runs near 0 mAP, where a one-grey-level change of a few pixels could swing the result several-fold.
    # At 32 px (the 64 px images halved): a quarter of the compute of 64 px, and the same verdict.
    data = write_rectangles_dataset(tmp_path / "data", n_train=320, n_val=16, size=64, seed=2)
    common = [
        "--data",
        str(data),
        "--imgsz",
        "32",
        "--batch-size",
        "16",
        "--epochs",
        "6",
        "--workers",
        "0",
        "--noval",
        "--noautoanchor",
        "--noplots",
        "--device",
        "cpu",
        "--project",
        str(tmp_path),
        "--exist-ok",
    ]
    old_defaults = ["--optimizer", "SGD", "--close-mosaic", "0"]  # YOLOv5's recipe
    # The two runs take one thread each and run side by side (this machine has 2 cores).
    runs = {"new": [], "old": old_defaults}
    statuses = run_forked(
        [(train.main, ([*common, "--name", name, *extra],), {}) for name, extra in runs.items()], timeout=300
    )
    assert statuses == [0, 0]
    final_map50 = {}
    for name in runs:
        with open(tmp_path / name / "results.csv") as f:
            rows = [{k.strip(): float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        final_map50[name] = rows[-1]["metrics/mAP_0.5"]
    # The bounds leave room under what data seeds 0, 1 and 2 gave (docs/benchmarks.md, "The recipe test's bounds").
    assert final_map50["new"] > 0.35 and final_map50["new"] > final_map50["old"] + 0.3, final_map50
