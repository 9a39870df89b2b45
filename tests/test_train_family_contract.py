"""The engine trains any family that keeps the family contract (docs/design.md), not only YOLO heads.

The family here exists for this test only: a detector that is no YOLO (one pooled feature per image, a few query
slots for boxes and classes) and takes the targets in its training forward pass (each target's box, shifted, is a
denoising query that must give back the true box, as DETR-style detectors train), with a loss of two terms and
its own hyper-parameter record and file (its loss gains; its augmentation preset: no mosaic, no flips). It keeps
to the family contract (a ``Family`` subclass overriding what differs) and is registered by name for the test.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

import models.families as families
from models.loss import UNMARKED
from utils.boxes import xywh2xyxy
from utils.checkpoint import load_checkpoint
from utils.engine.timing import TIME_COLUMNS
from utils.hyp import AugmentationHyp, HypRecord, OptimisationHyp

QUERIES = 4
PRESET = {
    "mosaic": 0.0,
    "mixup": 0.0,
    "fliplr": 0.0,
    "flipud": 0.0,
    "scale": 0.0,
    "translate": 0.0,
    "hsv_h": 0.0,
    "hsv_s": 0.0,
    "hsv_v": 0.0,
    "warmup_epochs": 0.0,
    "lr0": 0.003,
    "lrf": 0.5,
    "denoise": 2.0,
}


@dataclass(frozen=True)
class ToyGains(HypRecord):
    denoise: float = 1.0  # gain of the denoising queries' L1 loss
    presence: float = 1.0  # gain of the per-image class presence BCE


@dataclass(frozen=True)
class ToyHyp(AugmentationHyp, ToyGains, OptimisationHyp):
    """The toy family's hyper-parameters: the shared optimisation and augmentation groups around its own gains."""


class ToyDetector(nn.Module):
    def __init__(self, cfg: dict, nc: int) -> None:
        super().__init__()
        self.yaml, self.nc, self.names = {**cfg, "nc": nc}, nc, [str(i) for i in range(nc)]
        self.trunk = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1),
            nn.BatchNorm2d(8),
            nn.SiLU(),
            nn.Conv2d(8, 16, 3, 4, 1),
            nn.BatchNorm2d(16),
            nn.SiLU(),
        )
        self.slots = nn.Linear(16, QUERIES * (4 + nc))
        self.denoise = nn.Linear(16 + 4, 4)
        self.register_buffer("stride", torch.tensor([32.0]))

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None):
        features = self.trunk(images).mean((2, 3))
        slots = self.slots(features).view(len(images), QUERIES, 4 + self.nc)
        raw = {"boxes": slots[..., :4].sigmoid(), "logits": slots[..., 4:]}
        if targets is not None:  # denoising queries: each target's box, shifted, and its image's feature
            noisy = (targets[:, 2:6] + 0.05).clamp(0, 1)
            raw["denoised"] = self.denoise(torch.cat((features[targets[:, 0].long()], noisy), 1)).sigmoid()
        if self.training:
            return raw
        h, w = images.shape[2:]
        conf, cls = raw["logits"].sigmoid().max(-1)
        boxes = xywh2xyxy(raw["boxes"]) * torch.tensor([w, h, w, h], dtype=images.dtype, device=images.device)
        return torch.cat((boxes, conf[..., None], cls[..., None].to(boxes.dtype)), -1), raw


class ToyLoss:
    item_names = ("denoise", "presence")
    timed_phases: tuple[str, ...] = ()  # no part of its call timed on its own
    marks = UNMARKED

    def __init__(self, nc: int, hyp: ToyHyp) -> None:
        self.nc, self.gains = nc, torch.tensor([hyp.denoise, hyp.presence])

    def prepare(self, targets: torch.Tensor, image_hw) -> None:
        return None

    def counts(self, prepared) -> torch.Tensor:
        return torch.zeros(0)  # nothing to sum over ranks before the forward pass

    def set_epoch(self, epoch: int, epochs: int) -> None:
        pass

    def __call__(self, preds: dict, targets: torch.Tensor, norm=None, prepared=None, reduce=None):
        images = norm.images if norm is not None else len(preds["logits"])
        present = torch.zeros_like(preds["logits"][:, 0])
        present[targets[:, 0].long(), targets[:, 1].long()] = 1.0  # which classes each image holds
        presence = (
            nn.functional.binary_cross_entropy_with_logits(preds["logits"].max(1).values, present, reduction="sum")
            / self.nc
        )
        denoise = (preds["denoised"] - targets[:, 2:6]).abs().sum() if "denoised" in preds else presence * 0
        items = torch.stack((denoise, presence)) * self.gains / images
        return items.sum(), items.detach()


class ToyFamily(families.Family):
    """What differs from the YOLO defaults of the family contract."""

    name = "toy"
    title = "Toy"
    loss_names = ToyLoss.item_names
    hyp_type = ToyHyp
    layouts = ("end2end",)  # (B, k, 6) = x1 y1 x2 y2 score class: final, no NMS
    val_iou = 0.5
    evolve_limits: dict = {}

    def __init__(self, hyp_file: Path) -> None:
        self.default_hyp = str(hyp_file)  # absolute: default_hyp_path is it
        self.targets_seen: list[int] = []

    def build_model(
        self, cfg, *, nc=None, weights=None, transfer=False, keep_anchors=True, anchors=None, names=None
    ) -> ToyDetector:
        config = dict(cfg) if not isinstance(cfg, (str, Path)) else yaml.safe_load(Path(cfg).read_text())
        model = ToyDetector(config, nc or config["nc"])
        if weights is not None:
            model.load_state_dict(weights)
        if names is not None:
            model.names = list(names)
        return model

    def forward_train(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> dict:
        if not self.targets_seen:
            self.denoise_at_start = model.denoise.weight.detach().clone()
        self.targets_seen.append(len(targets))
        return model(images, targets)

    def make_loss(self, model: nn.Module, hyp: ToyHyp, *, imgsz: int, label_smoothing: float = 0.0) -> ToyLoss:
        return ToyLoss(model.module.nc if hasattr(model, "module") else model.nc, hyp)

    def detections(self, pred: torch.Tensor, conf_thres: float, iou_thres: float, **options) -> list[torch.Tensor]:
        kept = [p[p[:, 4] > conf_thres] for p in pred]
        return [p[p[:, 4].argsort(descending=True)] for p in kept]


@pytest.fixture
def toy_family(tmp_path, monkeypatch) -> tuple[ToyFamily, Path]:
    """The toy family registered by name, recognised by ``family: toy`` in its config; its config file."""
    hyp_file = tmp_path / "hyp.toy.yaml"
    hyp_file.write_text(yaml.safe_dump({**ToyHyp().to_dict(), **PRESET}))
    family = ToyFamily(hyp_file)
    monkeypatch.setitem(families.FAMILIES, "toy", family)  # configs saying `family: toy` are its own
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump({"family": "toy", "nc": 2, "backbone": [], "head": []}))
    return family, cfg


@pytest.mark.slow
def test_a_detector_that_takes_the_targets_in_its_forward_pass_trains_through_the_engine(
    train_here, toy_family, rectangles_yaml, tmp_path
) -> None:
    family, cfg = toy_family
    status, log = train_here("--data", rectangles_yaml, "--cfg", cfg, "--epochs", "1", "--project", tmp_path / "runs")
    assert status == 0, log
    run_dir = tmp_path / "runs/exp"
    assert len(family.targets_seen) == 2 and sum(family.targets_seen) > 0  # 16 images, batch 8: two steps
    assert "denoise_loss presence_loss" in " ".join(log.split())  # the progress header follows the loss names
    with open(run_dir / "results.csv") as f:
        rows = [{k.strip(): float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    assert list(rows[0]) == [
        "epoch",
        "train/denoise_loss",
        "train/presence_loss",
        "metrics/precision",
        "metrics/recall",
        "metrics/mAP_0.5",
        "metrics/mAP_0.5:0.95",
        "val/denoise_loss",
        "val/presence_loss",
        "x/lr0",
        "x/lr1",
        "x/lr2",
        *TIME_COLUMNS,
    ]
    assert rows[0]["train/denoise_loss"] > 0 and rows[0]["val/presence_loss"] > 0
    assert rows[0]["val/denoise_loss"] == 0  # no targets in the evaluation forward pass: no denoising queries
    hyp = yaml.safe_load((run_dir / "hyp.yaml").read_text())
    assert {k: hyp[k] for k in PRESET} == PRESET  # the family's own hyper-parameters and augmentation preset
    assert list(hyp) == ToyHyp.field_names()  # in its own record: no other family's keys
    ckpt = load_checkpoint(run_dir / "weights/last.pt")
    assert ckpt["model_cfg"]["family"] == "toy" and "denoise.weight" in ckpt["model"]
    assert family.read_hyp(ckpt["hyp"]) == family.read_hyp(family.default_hyp_path)  # what a resume reads back
    # The denoising queries' layer, used only when the targets are in the forward pass, was trained.
    assert not torch.equal(family.denoise_at_start, ckpt["model"]["denoise.weight"])
