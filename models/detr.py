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
import importlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from utils.errors import UserError
from utils.log import LOGGER

# transformers' class names of each model type a DETR family builds: its config and its detector.
MODEL_CLASSES = {
    "d_fine": ("DFineConfig", "DFineForObjectDetection"),
    "rt_detr_v2": ("RTDetrV2Config", "RTDetrV2ForObjectDetection"),
}


def transformers_module() -> Any:
    """transformers, or one line naming the package (the YOLO families never need it)."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise UserError("the DETR families (dfine, rtdetrv2) need transformers: pip install transformers") from e


def transformers_config(model_type: str, values: Mapping[str, Any], nc: int) -> Any:
    """transformers' config of ``model_type`` from its fields (``backbone_config`` a dict of its own), ``nc`` labels."""
    lib = transformers_module()
    config_class = getattr(lib, MODEL_CLASSES[model_type][0])
    fields = {k: v for k, v in values.items() if k not in ("id2label", "label2id", "num_labels")}
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
        self.training_passes = 0  # the denoising noise's seed: see denoising_generator

    def check_size(self, h: int, w: int) -> None:
        """One line for an image whose encoder holds fewer tokens than the decoder has queries."""
        tokens = sum(math.ceil(h / s) * math.ceil(w / s) for s in self.strides)
        if tokens < self.queries:
            smallest = min_tokens_size(self.strides, self.queries)
            raise UserError(
                f"image size {w}x{h}: the encoder of {self.yaml.get('yaml_file', 'this model')} holds {tokens} "
                f"tokens, fewer than its {self.queries} queries; the smallest size that works is {smallest}"
            )

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """Training: what ``models/detr_loss.py: DetrLoss`` takes, with ``targets`` (N, 6: image, class, cx, cy, w, h
        normalised, rows grouped by image) making the denoising queries. Eval: ``(output0, raw)``, output0 (B, 300, 6)
        in input pixels, raw the logits and boxes of the last layer (and D-FINE's edge distributions)."""
        h, w = images.shape[2:]
        if not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            self.check_size(int(h), int(w))
        if self.training:
            return self.training_pass(images, targets)
        out = self.inference_pass(images)
        raw = {"logits": out.logits, "pred_boxes": out.pred_boxes}
        if out.intermediate_predicted_corners is not None:
            raw["pred_corners"] = out.intermediate_predicted_corners[:, -1]
            raw["ref_points"] = out.initial_reference_points[:, -1]
        return top_detections(out.logits, out.pred_boxes, (h, w), self.queries), raw

    def training_pass(self, images: torch.Tensor, targets: torch.Tensor | None) -> dict[str, Any]:
        """transformers' model with the targets as its ``labels`` (one dict per image: its denoising queries), every
        decoder layer's logits, boxes (and D-FINE's edge distributions and reference points), the encoder's top-k,
        and the denoising layout. The boxes per image are read on the host here (transformers takes one tensor per
        image): one of the step's waits for the device (docs/design.md)."""
        batch = images.shape[0]
        labels, per_image = None, None
        if targets is not None:
            image = targets[:, 0].long()
            counts = torch.zeros(batch, dtype=torch.long, device=targets.device)
            per_image = counts.index_add_(0, image, torch.ones_like(image)).tolist()
            starts = [sum(per_image[:i]) for i in range(batch)]
            labels = [
                {"class_labels": targets[s : s + n, 1].long(), "boxes": targets[s : s + n, 2:6].float()}
                for s, n in zip(starts, per_image)
            ]
        with self.denoising_generator(images.device):
            out = self.detr.model(pixel_values=images, labels=labels)
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
            "per_image": per_image,
            "zero": zero,
        }

    @contextlib.contextmanager
    def denoising_generator(self, device: torch.device) -> Iterator[None]:
        """transformers draws the denoising queries' noise from the global generator: here it is seeded for each
        training pass from the process's seed, the rank and the count of training passes (which checkpoints keep:
        ``get_extra_state``), so the noise does not depend on what else draws from the generator (a resumed run's
        fresh loader does) and a resumed run draws what the run it continues would have. The global generator is
        left as it was."""
        rank = (
            torch.distributed.get_rank()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0
        )
        seed = (torch.initial_seed() * 1_000_003 + rank * 7_919 + self.training_passes) % 2**63
        self.training_passes += 1
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(seed)
            yield

    def get_extra_state(self) -> torch.Tensor:
        """The count of training passes (the denoising noise's seed), kept by checkpoints."""
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
