"""val.py end to end on a generated dataset: an oracle model, a real random model, and user errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn
import yaml

import val
from models.families import YOLOV5
from models.yolo import Model
from utils.checkpoint import model_state, save_checkpoint
from utils.data.loader import create_dataloader
from utils.errors import UserError
from utils.log import LOGGER
from utils.validation import OutputOptions, PredictOptions, validate

ROOT = Path(__file__).resolve().parents[1]
# class 0 red, class 1 green (RGB) rectangles on black
CLASS_RGB = ((255, 0, 0), (0, 255, 0))
IMAGE_SIZES = ((90, 140), (120, 80), (100, 100), (64, 200), (150, 120), (80, 96))  # (h, w)


def make_dataset(root: Path, with_test: bool = False) -> Path:
    """Six images of different shapes with 0-3 coloured boxes each (one image without boxes)."""
    rng = np.random.default_rng(0)
    images, labels = root / "images" / "val", root / "labels" / "val"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)
    for i, (h, w) in enumerate(IMAGE_SIZES):
        img = np.zeros((h, w, 3), dtype=np.uint8)
        lines = []
        n_boxes = 0 if i == 2 else int(rng.integers(1, 4))
        x = 2
        for _ in range(n_boxes):  # side by side so they never overlap
            bw, bh = int(rng.integers(14, w // 3 - 2)), int(rng.integers(14, h - 4))
            y = int(rng.integers(2, h - bh - 1))
            cls = int(rng.integers(0, 2))
            img[y : y + bh, x : x + bw] = CLASS_RGB[cls][::-1]  # BGR on disk
            lines.append(f"{cls} {(x + bw / 2) / w:.6f} {(y + bh / 2) / h:.6f} {bw / w:.6f} {bh / h:.6f}")
            x += bw + 4
        cv2.imwrite(str(images / f"im{i}.png"), img)
        (labels / f"im{i}.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
    config = {"path": str(root), "train": "images/val", "val": "images/val", "names": ["red", "green"]}
    if with_test:
        config["test"] = "images/val"
    yaml_file = root / "data.yaml"
    yaml_file.write_text(yaml.safe_dump(config))
    return yaml_file


class ColourOracle(nn.Module):
    """Finds the coloured rectangles of the letterboxed batch, so every metric must come out near perfect."""

    def __init__(self, nc: int = 2, max_boxes: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))  # validate reads the parameter dtype
        self.nc, self.max_boxes = nc, max_boxes

    def forward(self, imgs: torch.Tensor):
        pred = torch.zeros((imgs.shape[0], self.max_boxes, 5 + self.nc))
        for b, img in enumerate(imgs.float().cpu()):
            n = 0
            for cls, rgb in enumerate(CLASS_RGB):
                mask = np.ones(img.shape[1:], dtype=bool)
                for ch, v in enumerate(rgb):
                    mask &= (img[ch].numpy() > 0.5) if v else (img[ch].numpy() < 0.3)
                count, _, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8))
                for x, y, w, h, _ in stats[1:count]:
                    pred[b, n, :4] = torch.tensor([x + w / 2, y + h / 2, w, h], dtype=torch.float32)
                    pred[b, n, 4] = 0.9 - 0.01 * n
                    pred[b, n, 5 + cls] = 1.0
                    n += 1
        return pred.to(imgs.device), []


class FourTermLoss:
    """A loss of four terms, each batch giving 1, 2, 3, 4 whatever the predictions."""

    item_names = ("a", "b", "c", "d")

    def __call__(self, preds, targets):
        items = torch.arange(1.0, 5.0)
        return items.sum(), items


def test_validation_averages_as_many_loss_terms_as_the_loss_names(dataset):
    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 64, 4, 32, rect=True, pad=0.5, workers=0)
    r = validate(
        ColourOracle(), loader, names=["red", "green"], device="cpu", family=YOLOV5, compute_loss=FourTermLoss()
    )
    assert r.losses.tolist() == [1.0, 2.0, 3.0, 4.0] and r.as_row()[4:] == (1.0, 2.0, 3.0, 4.0)


def original_boxes(yaml_file: Path) -> dict[str, np.ndarray]:
    """Label rows (cls, x1, y1, x2, y2) in pixels of each original image, by stem."""
    out = {}
    for i, (h, w) in enumerate(IMAGE_SIZES):
        text = (yaml_file.parent / "labels" / "val" / f"im{i}.txt").read_text().split()
        rows = np.array(text, dtype=np.float64).reshape(-1, 5)
        xyxy = np.stack(
            [
                (rows[:, 1] - rows[:, 3] / 2) * w,
                (rows[:, 2] - rows[:, 4] / 2) * h,
                (rows[:, 1] + rows[:, 3] / 2) * w,
                (rows[:, 2] + rows[:, 4] / 2) * h,
            ],
            1,
        )
        out[f"im{i}"] = np.concatenate([rows[:, :1], xyxy], 1)
    return out


@pytest.fixture()
def dataset(tmp_path) -> Path:
    return make_dataset(tmp_path / "data", with_test=False)


def test_oracle_scores_perfect_and_writes_outputs(dataset, tmp_path):
    # imgsz 128 shrinks some images and enlarges none: boxes come back through a real letterbox
    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 128, 4, 32, rect=True, pad=0.5, workers=0)
    save_dir = tmp_path / "run"
    r = validate(
        ColourOracle(),
        loader,
        names=["red", "green"],
        device="cpu",
        family=YOLOV5,
        outputs=OutputOptions(
            save_dir=save_dir, plots=True, save_json=True, save_txt=True, save_conf=True, verbose=True
        ),
    )
    assert r.n_images == 6 and r.n_instances > 5
    assert r.map50 == pytest.approx(1.0) and r.map > 0.8
    assert r.p > 0.99 and r.r > 0.99
    assert r.losses.tolist() == [] and len(r.as_row()) == 4  # no loss, no loss terms
    assert r.maps.shape == (2,) and len(r.speed) == 3
    assert r.fitness == pytest.approx(0.1 * r.map50 + 0.9 * r.map)
    # confusion matrix: every box found with its own class, nothing else
    assert np.trace(r.confusion[:2, :2]) == r.n_instances and r.confusion.sum() == r.n_instances

    # the COCO files load in pycocotools and COCOeval agrees with our figures (< 100 dets per image)
    from pycocotools.coco import COCO

    gt = COCO(str(save_dir / "ground_truth.json"))
    dt = gt.loadRes(str(save_dir / "predictions.json"))
    assert len(dt.getAnnIds()) == r.n_instances and len(gt.getImgIds()) == 6
    assert abs(r.coco_stats[0] - r.map) <= 0.001 and abs(r.coco_stats[1] - r.map50) <= 0.001

    # --save-txt boxes are in the original image's normalised coordinates: compare with the labels
    truth = original_boxes(dataset)
    for stem, rows in truth.items():
        txt = save_dir / "labels" / f"{stem}.txt"
        pred = np.loadtxt(txt, ndmin=2).reshape(-1, 6) if txt.stat().st_size else np.zeros((0, 6))
        assert len(pred) == len(rows)
        h, w = IMAGE_SIZES[int(stem[2:])]
        centres = pred[:, 1:3] * [w, h]
        for row in rows:
            distance = np.abs(centres - [(row[1] + row[3]) / 2, (row[2] + row[4]) / 2]).max(1)
            assert distance.min() < 2.0  # pixels, after a down-and-up letterbox round trip
        assert (pred[:, 5] > 0.5).all()  # --save-conf column

    for name in (
        "confusion_matrix.png",
        "PR_curve.png",
        "F1_curve.png",
        "val_batch0_labels.jpg",
        "val_batch0_pred.jpg",
    ):
        assert (save_dir / name).stat().st_size > 0


def test_no_detections_and_eval_mode(dataset):
    class Blind(ColourOracle):
        def forward(self, imgs):
            return torch.zeros((imgs.shape[0], 4, 7)), []

    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 64, 2, 32, rect=True, pad=0.5, workers=0)
    model = Blind().train()
    r = validate(model, loader, names=["red", "green"], device="cpu", family=YOLOV5)
    assert not model.training
    assert (r.p, r.r, r.map50, r.map) == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="need a save_dir"):
        OutputOptions(plots=True)
    with pytest.raises(ValueError, match="Blind is not a Model of this project: pass its family"):
        validate(model, loader, names=["red", "green"], device="cpu")


def _random_checkpoint(path: Path, nc: int = 2) -> Path:
    torch.manual_seed(0)
    model = Model(ROOT / "models" / "yolov5n.yaml", nc=nc)
    with torch.no_grad():  # zero the head's prior biases so a random model emits boxes at conf 0.001
        for conv in model.model[-1].m:
            conv.bias.zero_()
    save_checkpoint(model_state(model), path)
    return path


@pytest.mark.slow
def test_run_with_a_random_model_and_loss(dataset, tmp_path):
    weights = _random_checkpoint(tmp_path / "rand.pt")
    kwargs = {
        "data": str(dataset),
        "weights": str(weights),
        "imgsz": 64,
        "batch_size": 4,
        "device": "cpu",
        "workers": 0,
        "project": str(tmp_path / "runs"),
        "noplots": True,
    }
    r = val.run(**kwargs, max_det=50)
    assert r.save_dir == tmp_path / "runs" / "exp"
    assert r.n_images == 6 and 0.0 <= r.map <= r.map50 <= 1.0
    assert val.run(**kwargs, single_cls=True, task="speed").save_dir == tmp_path / "runs" / "exp2"

    # the training path: validate with the loss object on an already-built loader
    from models.loading import load_model
    from models.loss import ComputeLoss

    model, _ = load_model(weights, "cpu")
    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 64, 4, 32, rect=True, pad=0.5, workers=0)
    r = validate(
        model.train(),
        loader,
        names=["red", "green"],
        device="cpu",
        compute_loss=ComputeLoss(model, hyp),
        predict=PredictOptions(max_det=50),
    )
    assert r.losses.shape == (3,) and (r.losses > 0).all()


def test_run_user_errors(dataset, tmp_path):
    with pytest.raises(UserError, match="weights file not found"):
        val.run(data=str(dataset), weights=str(tmp_path / "missing.pt"), device="cpu")
    weights = _random_checkpoint(tmp_path / "rand3.pt", nc=3)
    with pytest.raises(UserError, match="3 classes"):
        val.run(data=str(dataset), weights=str(weights), device="cpu", imgsz=64, project=str(tmp_path / "r"))
    with pytest.raises(UserError, match="'test'"):
        val.run(data=str(dataset), weights=str(weights), device="cpu", task="test")


class _Pickled:  # a non-tensor object: loading it needs arbitrary unpickling
    pass


@pytest.mark.slow
def test_cli_errors_are_one_line_and_exit_non_zero(dataset, tmp_path):
    pickled = tmp_path / "pickled.pt"
    torch.save({"model": _Pickled()}, pickled)
    good = _random_checkpoint(tmp_path / "good.pt")
    cases = [
        (["--weights", str(tmp_path / "nope.pt")], "nope.pt"),
        (["--weights", str(pickled)], "pickled.pt"),
        (["--weights", str(good), "--task", "test"], "data.yaml"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # One case as a real process (no traceback reaches the terminal); the others in this process.
    for args, named_file in cases[1:]:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        LOGGER.addHandler(handler)
        try:
            status = val.main(["--data", str(dataset), "--device", "cpu", "--project", str(tmp_path / "r"), *args])
        finally:
            LOGGER.removeHandler(handler)
        assert status == 1 and lines[-1].startswith("ERROR") and named_file in lines[-1], lines
    for args, named_file in cases[:1]:
        proc = subprocess.run(
            [
                sys.executable,
                "val.py",
                "--data",
                str(dataset),
                "--device",
                "cpu",
                "--project",
                str(tmp_path / "r"),
                *args,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = proc.stdout + proc.stderr
        error_lines = [line for line in output.splitlines() if line.startswith("ERROR")]
        assert proc.returncode == 1, output
        assert len(error_lines) == 1 and named_file in error_lines[0], output
        assert "Traceback" not in output


def test_validate_folds_batchnorm_into_a_copy_with_the_same_outputs(dataset):
    from models.loss import ComputeLoss

    torch.manual_seed(0)
    model = Model(ROOT / "models" / "yolov5n.yaml", nc=2)
    for m in model.modules():  # BN statistics far from the identity, so that a wrong fold would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
    model = model.to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class Opaque(nn.Module):  # not a Model: validated as it is, BatchNorm and all
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 64, 3, 32, rect=True, pad=0.5, workers=0)
    folded = validate(model, loader, names=["red", "green"], device="cpu", compute_loss=ComputeLoss(model, hyp))
    as_is = validate(
        Opaque(model), loader, names=["red", "green"], device="cpu", family=YOLOV5, compute_loss=ComputeLoss(model, hyp)
    )
    # The caller's model keeps its BatchNorms and its weights (training goes on with it).
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 57
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    np.testing.assert_allclose(folded.losses, as_is.losses, rtol=1e-4)
    assert abs(folded.map50 - as_is.map50) < 1e-3 and folded.n_images == as_is.n_images == 6


def test_validation_runs_without_cudnn_benchmark_and_restores_it(dataset, monkeypatch):
    """Rectangular batches come in many shapes: cuDNN's benchmark would time each one again (utils/validation.py)."""
    seen = []

    class Recording(ColourOracle):
        def forward(self, imgs):
            seen.append(torch.backends.cudnn.benchmark)
            return super().forward(imgs)

    loader, _ = create_dataloader(str(dataset.parent / "images" / "val"), 128, 4, 32, rect=True, pad=0.5, workers=0)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    r = validate(Recording(), loader, names=["red", "green"], device="cpu", family=YOLOV5)
    assert r.n_images == 6 and seen and not any(seen)
    assert torch.backends.cudnn.benchmark is True
