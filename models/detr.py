"""The real-time DETR networks (D-FINE, RT-DETRv2): transformers' modules inside this project's model interface.

The hybrid encoder, the deformable decoder and D-FINE's distribution refinement are transformers' own
(``DFineForObjectDetection``, ``RTDetrV2ForObjectDetection``; an optional package, imported only here and only when
a DETR model is built). :class:`DetrDetector` gives them what every model here has: images (B, 3, H, W) in [0, 1]
(as the references take them: no mean or std), ``yaml``, ``names``, ``stride``, and in eval mode
``(output0, raw)`` with ``output0`` (B, 300, 6) = x1 y1 x2 y2 score class in input pixels: the top 300 over
queries x classes of the sigmoid scores, as the references' post-processors take them (no NMS).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from utils.errors import UserError
from utils.log import LOGGER

# transformers' class names of each model type a DETR family builds: its config and its detector.
MODEL_CLASSES = {
    "d_fine": ("DFineConfig", "DFineForObjectDetection"),
    "rt_detr_v2": ("RTDetrV2Config", "RTDetrV2ForObjectDetection"),
}
INVERSE_SIGMOID_EPS = 1e-5  # the references' clamp of a denoising box before its inverse sigmoid
# The score heads' starting probability in both official decoders (bias_init_with_prob(0.01)), whatever the class
# count. transformers starts them at 1 / (classes + 1) where its config names none: 0.17 for 5 classes, 0.33 for 2, so
# a model trained from scratch or given new class heads first spends its steps pushing 300 queries' scores down.
OFFICIAL_SCORE_PRIOR = 0.01


def transformers_module() -> Any:
    """transformers, or one line naming the package (the YOLO families never need it)."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise UserError("the DETR families (dfine, rtdetrv2) need transformers: pip install transformers") from e


def transformers_config(model_type: str, values: Mapping[str, Any], nc: int) -> Any:
    """transformers' config of ``model_type`` from its fields (``backbone_config`` a dict of its own), ``nc`` labels;
    the score heads' prior is the official one where the fields name none (OFFICIAL_SCORE_PRIOR)."""
    lib = transformers_module()
    config_class = getattr(lib, MODEL_CLASSES[model_type][0])
    fields = {k: v for k, v in values.items() if k not in ("id2label", "label2id", "num_labels")}
    if fields.get("initializer_bias_prior_prob") is None:
        fields["initializer_bias_prior_prob"] = OFFICIAL_SCORE_PRIOR
    labels = {i: str(i) for i in range(nc)}
    return config_class(**fields, id2label=labels, label2id={v: k for k, v in labels.items()})


def min_tokens_size(strides: list[int], queries: int) -> int:
    """The smallest square image size, a multiple of the largest stride, whose encoder holds ``queries`` tokens."""
    step = max(strides)
    size = step
    while sum((size // s) ** 2 for s in strides) < queries:
        size += step
    return size


def top_detections(logits: torch.Tensor, boxes: torch.Tensor, hw: tuple[int, int], k: int) -> torch.Tensor:
    """(B, k, 6) = x1 y1 x2 y2 score class in pixels of an ``hw`` image: the top ``k`` over queries x classes of
    the sigmoid scores of ``logits`` (B, Q, nc), each with its query's box (B, Q, 4: centre, size, in [0, 1])."""
    nc = logits.shape[-1]
    scores, index = logits.sigmoid().flatten(1).topk(k, dim=1)
    labels = index % nc
    query = torch.div(index, nc, rounding_mode="floor")
    picked = boxes.gather(1, query.unsqueeze(-1).expand(-1, -1, 4))
    centre, size = picked[..., :2], picked[..., 2:]
    h, w = hw
    scale = torch.tensor([w, h, w, h], dtype=boxes.dtype, device=boxes.device)
    corners = torch.cat((centre - size / 2, centre + size / 2), -1) * scale
    return torch.cat((corners, scores.unsqueeze(-1), labels.unsqueeze(-1).to(boxes.dtype)), -1)


DENOISING_STREAM = 0x646E  # in each image's noise entropy: apart from the dataset's (seed, epoch, index) draws


@dataclass(frozen=True)
class DenoisingPlan:
    """What a training pass's denoising queries are made of besides the targets, each the same at any world size:
    the boxes of each image (counted on the host), the groups' size (the most boxes of one image over every rank's
    micro-batch) and each image's noise entropy (the run's seed, the epoch and the sample: ``sample_entropy``)."""

    per_image: tuple[int, ...]
    slots: int
    entropy: tuple[tuple[int, ...], ...]


def sample_entropy(seed: int, epoch: int, sample: str) -> tuple[int, ...]:
    """The noise entropy of one image: the run's seed, the epoch and a 64-bit hash of the sample's name, which do
    not depend on the rank, the image's place in a batch or what else drew random numbers. The name is the file's
    folder and file name (``images/0001.jpg`` of ``/data/coco/images/0001.jpg``): a dataset moved, or mounted at
    another path on another node, draws the same noise, and folders per class (``cat/1.jpg``, ``dog/1.jpg``) stay
    apart."""
    name = "/".join(PurePath(sample).parts[-2:])
    key = int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")
    return (DENOISING_STREAM, int(seed), int(epoch), key)


def denoising_noise(plan: DenoisingPlan, groups: int, label_noise: float, nc: int) -> np.ndarray:
    """Every image's noise, drawn on the host from its own entropy, as one float32 array: the box shifts
    (B, 2G, M, 4), in units of half the box's size (a sign and a magnitude in [0, 1) for the positive query of each
    group, [1, 2) for the negative), then the new labels (B, 2G, M) (-1 where the label stays); query
    (2g + h) M + j of an image stands for its box j (h: 0 positive, 1 negative)."""
    batch, slots = len(plan.per_image), plan.slots
    shift = np.zeros((batch, 2 * groups, slots, 4), np.float32)
    relabel = np.full((batch, 2 * groups, slots), -1.0, np.float32)
    for i, n in enumerate(plan.per_image):
        if not n:
            continue
        rng = np.random.default_rng(plan.entropy[i])
        flip = rng.random((2 * groups, n)) < label_noise * 0.5
        new = rng.integers(0, nc, (2 * groups, n))
        sign = rng.integers(0, 2, (2 * groups, n, 4)) * 2.0 - 1.0
        part = rng.random((2 * groups, n, 4))
        part[1::2] += 1.0  # the negative query of each group: farther from its box than any positive
        shift[i, :, :n] = sign * part
        relabel[i, :, :n] = np.where(flip, new, -1)
    return np.concatenate((shift.reshape(-1), relabel.reshape(-1)))


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` in one copy (pinned on CUDA: queued without waiting for the device)."""
    flat = torch.from_numpy(array)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return flat.to(device, non_blocking=True)


def denoising_attention(dn: int, queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """The decoder's self-attention mask (0 or -inf): the matching queries do not see the denoising ones, and each
    denoising group sees only itself."""
    rows = torch.arange(dn + queries, device=device)
    denoising = rows < dn
    group = torch.div(rows, 2 * slots, rounding_mode="floor")
    other_group = denoising[:, None] & denoising[None, :] & (group[:, None] != group[None, :])
    blocked = (~denoising[:, None] & denoising[None, :]) | other_group
    return torch.where(blocked, float("-inf"), 0.0)


def denoising_queries(plan: DenoisingPlan, targets: torch.Tensor, config: Any, class_embed: nn.Module) -> Any:
    """The denoising queries as transformers' model takes them (its ``get_contrastive_denoising_training_group``'s
    results: class embeddings, boxes before the sigmoid, the attention mask, the layout), or None without boxes in
    any rank's micro-batch. The references' construction (``num_denoising`` // M groups, each a positive and a
    negative query per box, labels replaced at ``label_noise_ratio`` / 2, corners moved by up to
    ``box_noise_scale`` times half the box's size, farther for the negatives), with M and the noise from ``plan``."""
    slots, batch, device = plan.slots, len(plan.per_image), targets.device
    if slots == 0:
        return None
    nc, queries = int(config.num_labels), int(config.num_queries)
    groups = max(int(config.num_denoising) // slots, 1)
    width = 2 * groups * slots
    rows = np.concatenate([np.arange(n) for n in plan.per_image]).astype(np.float32)
    image_of_row = np.repeat(np.arange(batch), plan.per_image).astype(np.float32)
    noise = denoising_noise(plan, groups, float(config.label_noise_ratio), nc)
    flat = host_to_device(np.concatenate((noise, image_of_row, rows)), device)
    shift, relabel, image, slot = flat.split([batch * width * 4, batch * width, len(rows), len(rows)])
    image, slot = image.long(), slot.long()
    labels = torch.full((batch, slots), nc, dtype=torch.long, device=device)
    boxes = torch.zeros((batch, slots, 4), device=device)
    present = torch.zeros((batch, slots), dtype=torch.bool, device=device)
    labels[image, slot] = targets[:, 1].long()
    boxes[image, slot] = targets[:, 2:6].float()
    present[image, slot] = present.new_ones(())  # not True: a host value is a copy to the device
    labels, present = labels.repeat(1, 2 * groups), present.repeat(1, 2 * groups)
    boxes = boxes.repeat(1, 2 * groups, 1)
    relabel = relabel.view(batch, width).long()
    if float(config.label_noise_ratio) > 0:
        labels = torch.where((relabel >= 0) & present, relabel, labels)
    if float(config.box_noise_scale) > 0:
        half = boxes[..., 2:] / 2
        corners = torch.cat((boxes[..., :2] - half, boxes[..., :2] + half), -1)
        moved = corners + shift.view(batch, width, 4) * half.repeat(1, 1, 2) * float(config.box_noise_scale)
        moved = moved.clamp(0, 1)
        boxes = torch.cat(((moved[..., :2] + moved[..., 2:]) / 2, moved[..., 2:] - moved[..., :2]), -1)
    inside = boxes.clamp(0, 1)
    unact = torch.log(inside.clamp(min=INVERSE_SIGMOID_EPS) / (1 - inside).clamp(min=INVERSE_SIGMOID_EPS))
    meta = {"dn_positive_idx": None, "dn_num_group": groups, "dn_num_split": [width, queries]}
    return class_embed(labels), unact, denoising_attention(width, queries, slots, device), meta


@contextlib.contextmanager
def transformers_denoising(model: nn.Module, made: Any) -> Iterator[None]:
    """transformers' model with ``made`` as its denoising queries: its module's group maker, which draws from the
    process's global generator and sizes the groups by the rank's own batch, answers ``made`` for this pass."""
    if made is None:
        yield
        return
    module = sys.modules[type(model).__module__]
    name = "get_contrastive_denoising_training_group"
    if not hasattr(module, name):
        raise UserError(f"transformers {transformers_module().__version__}: {module.__name__} has no {name}")
    original = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: made)
    try:
        yield
    finally:
        setattr(module, name, original)


class DetrDetector(nn.Module):
    """A DETR of transformers with this project's model interface.

    ``cfg`` is the model config a checkpoint stores: ``family``, ``model_type`` (transformers' ``d_fine`` or
    ``rt_detr_v2``), ``transformers`` (its config's fields) and ``nc``; the weights live under ``detr.``, in
    transformers' names.
    """

    def __init__(self, cfg: Mapping[str, Any], nc: int, names: list[str] | None = None):
        super().__init__()
        lib = transformers_module()
        self.yaml = {**cfg, "nc": nc}
        config = transformers_config(cfg["model_type"], cfg["transformers"], nc)
        self.detr = getattr(lib, MODEL_CLASSES[cfg["model_type"]][1])(config)
        self.nc = nc
        self.names = list(names) if names is not None else [str(i) for i in range(nc)]
        self.strides = [int(s) for s in config.feat_strides]
        self.queries = int(config.num_queries)
        self.register_buffer("stride", torch.tensor([float(max(self.strides))]), persistent=False)
        self.training_passes = 0  # the noise of denoising queries made without a plan (local_plan)

    def check_size(self, h: int, w: int) -> None:
        """One line for an image whose encoder holds fewer tokens than the decoder has queries."""
        tokens = sum(math.ceil(h / s) * math.ceil(w / s) for s in self.strides)
        if tokens < self.queries:
            smallest = min_tokens_size(self.strides, self.queries)
            raise UserError(
                f"image size {w}x{h}: the encoder of {self.yaml.get('yaml_file', 'this model')} holds {tokens} "
                f"tokens, fewer than its {self.queries} queries; the smallest size that works is {smallest}"
            )

    def forward(
        self, images: torch.Tensor, targets: torch.Tensor | None = None, plan: DenoisingPlan | None = None
    ) -> Any:
        """Training: what ``models/detr_loss.py: DetrLoss`` takes, with ``targets`` (N, 6: image, class, cx, cy, w, h
        normalised, rows grouped by image) and ``plan`` making the denoising queries. Eval: ``(output0, raw)``, output0
        (B, 300, 6) in input pixels, raw the logits and boxes of the last layer (and D-FINE's edge distributions)."""
        h, w = images.shape[2:]
        if not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            self.check_size(int(h), int(w))
        if self.training:
            return self.training_pass(images, targets, plan)
        out = self.inference_pass(images)
        raw = {"logits": out.logits, "pred_boxes": out.pred_boxes}
        if out.intermediate_predicted_corners is not None:
            raw["pred_corners"] = out.intermediate_predicted_corners[:, -1]
            raw["ref_points"] = out.initial_reference_points[:, -1]
        return top_detections(out.logits, out.pred_boxes, (h, w), self.queries), raw

    def training_pass(
        self, images: torch.Tensor, targets: torch.Tensor | None, plan: DenoisingPlan | None = None
    ) -> dict[str, Any]:
        """transformers' model with this project's denoising queries (``denoising_queries``, made from the targets and
        ``plan``), every decoder layer's logits, boxes (and D-FINE's edge distributions and reference points), the
        encoder's top-k, and the denoising layout. Without a plan (a direct call, not the engine's step) the boxes per
        image are read on the host and the noise follows the count of training passes."""
        made = None
        if targets is not None and self.detr.config.num_denoising > 0:
            plan = plan if plan is not None else self.local_plan(targets, images.shape[0])
            made = denoising_queries(plan, targets, self.detr.config, self.detr.model.denoising_class_embed)
        self.training_passes += 1
        with transformers_denoising(self.detr.model, made):
            out = self.detr.model(pixel_values=images, labels=[] if made is not None else None)
        meta = out.denoising_meta_values
        dn_queries = int(meta["dn_num_split"][0]) if meta is not None else 0
        zero = None
        embed = getattr(self.detr.model, "denoising_class_embed", None)
        if meta is None and embed is not None:  # no denoising queries: the embedding still needs its (zero) gradient
            zero = embed.weight.sum() * 0.0
        return {
            "logits": out.intermediate_logits,
            "boxes": out.intermediate_reference_points,
            "corners": out.intermediate_predicted_corners,
            "refs": out.initial_reference_points,
            "enc_logits": out.enc_topk_logits,
            "enc_boxes": out.enc_topk_bboxes,
            "dn_queries": dn_queries,
            "dn_groups": int(meta["dn_num_group"]) if meta is not None else 0,
            "per_image": list(plan.per_image) if plan is not None else None,
            "zero": zero,
        }

    def local_plan(self, targets: torch.Tensor, batch: int) -> DenoisingPlan:
        """A plan from this call alone: the boxes per image read on the host (a wait for the device), the groups
        sized by this batch, the noise drawn by image position and the count of training passes."""
        image = targets[:, 0].long()
        counts = torch.zeros(batch, dtype=torch.long, device=targets.device)
        per_image = tuple(int(n) for n in counts.index_add_(0, image, torch.ones_like(image)).tolist())
        entropy = tuple((DENOISING_STREAM, self.training_passes, i) for i in range(batch))
        return DenoisingPlan(per_image, max(per_image, default=0), entropy)

    def get_extra_state(self) -> torch.Tensor:
        """The count of training passes (the noise of direct calls without a plan), kept by checkpoints."""
        return torch.full((), self.training_passes, dtype=torch.int64)

    def set_extra_state(self, state: Any) -> None:
        self.training_passes = int(state)

    def inference_pass(self, images: torch.Tensor) -> Any:
        """transformers' forward pass, through the first ``eval_layers`` decoder layers where the config asks (the
        official RT-DETRv2-M trains 6 and infers with 3: its ``eval_idx``); transformers runs them all."""
        keep = self.yaml.get("eval_layers")
        decoder = self.detr.model.decoder
        if not keep:
            return self.detr(pixel_values=images)
        every = decoder.layers
        decoder.layers = every[:keep]
        try:
            return self.detr(pixel_values=images)
        finally:
            decoder.layers = every

    def fuse(self) -> DetrDetector:
        """Nothing to fold: transformers' modules keep their normalisations (the contract asks every model)."""
        return self

    def info(self, verbose: bool = False, imgsz: int = 640) -> None:
        """Parameter count in the log (what ``Model.info`` gives the YOLO families)."""
        params = sum(p.numel() for p in self.parameters())
        LOGGER.info(f"{self.yaml.get('yaml_file', type(self.detr).__name__)}: {params:,} parameters")
