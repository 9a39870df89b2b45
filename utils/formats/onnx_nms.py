"""NMS inside an ONNX graph (export.py ``--nms``), for every layout whose family gives ``candidates``.

The exported graph ends as YOLO26's end-to-end output: (B, max_det, 6) = x1 y1 x2 y2 score class, best first,
rows past the last detection all zeros. It decides as the predictor's NMS does at detect.py's settings: each box
takes its best class, boxes scoring above ``conf`` are suppressed per class at ``iou``, and the ``max_det`` best
survivors are kept. The suppression is ONNX's NonMaxSuppression op, one score channel per class (a box's score in
its own class's channel, zero elsewhere), so classes never interact and no box is shifted by a class offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from utils.formats.base import NmsSpec
from utils.nms import nms_kernel


class _NonMaxSuppression(torch.autograd.Function):
    """ONNX NonMaxSuppression: boxes (B, N, 4), scores (B, C, N) -> selected (K, 3) = batch, class, box index.

    Eager, it computes the same selection with torchvision (the exporter runs it while tracing, and the PyTorch
    reference of the export check runs it); exported, it is the single ONNX op."""

    @staticmethod
    def forward(
        ctx: Any,
        boxes: torch.Tensor,
        scores: torch.Tensor,
        max_per_class: torch.Tensor,
        iou: torch.Tensor,
        conf: torch.Tensor,
    ) -> torch.Tensor:
        selected = []
        for b in range(boxes.shape[0]):
            for c in range(scores.shape[1]):
                keep = (scores[b, c] > conf).nonzero().flatten()
                kept = keep[nms_kernel()(boxes[b, keep], scores[b, c, keep], float(iou))]
                kept = kept[: int(max_per_class)]
                selected.append(torch.stack([torch.full_like(kept, b), torch.full_like(kept, c), kept], 1))
        return torch.cat(selected) if selected else torch.zeros((0, 3), dtype=torch.long)

    @staticmethod
    def symbolic(
        g: Any, boxes: Any, scores: Any, max_per_class: Any, iou: Any, conf: Any
    ) -> Any:  # the exporter's graph types
        return g.op("NonMaxSuppression", boxes, scores, max_per_class, iou, conf, center_point_box_i=0)


class InGraphNms(nn.Module):
    """``module``'s output0, then NMS on ``candidates(output0)``: (B, max_det, 6)."""

    def __init__(
        self,
        module: nn.Module,
        candidates: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None],
        spec: NmsSpec,
    ):
        super().__init__()
        self.module, self.candidates, self.spec = module, candidates, spec
        self.train(module.training)  # the exporter restores the wrapper's mode, and with it the detector's

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        found = self.candidates(self.module(images))
        if found is None:
            raise ValueError("--nms: this output is already final (end-to-end); it needs no NMS")
        boxes, scores = found[0].float(), found[1].float()  # NonMaxSuppression takes fp32 only
        batch, n, nc = scores.shape
        best, cls = scores.max(-1)  # (B, N): each box's best class, as NMS without multi-label takes it
        own_channel = cls.unsqueeze(1) == torch.arange(nc, device=cls.device).view(1, nc, 1)  # (B, nc, N)
        per_class = torch.where(own_channel, best.unsqueeze(1), torch.zeros_like(best).unsqueeze(1))
        max_det = self.spec.max_det
        selected = _NonMaxSuppression.apply(
            boxes,
            per_class,
            torch.tensor([max_det], dtype=torch.long),
            torch.tensor([self.spec.iou], dtype=torch.float32),
            torch.tensor([self.spec.conf], dtype=torch.float32),
        )
        image, box = selected[:, 0], selected[:, 2]
        flat = image * n + box  # one gather over (B * N) rows
        rows = torch.cat(
            (
                boxes.reshape(-1, 4)[flat],
                best.reshape(-1)[flat].unsqueeze(1),
                cls.reshape(-1)[flat].unsqueeze(1).float(),
            ),
            1,
        )  # (K, 6)
        # Each image's best max_det rows; max_det blank rows make up for images with fewer detections.
        owner = image.unsqueeze(0) == torch.arange(batch, device=image.device).unsqueeze(1)  # (B, K)
        keyed = torch.where(owner, rows[:, 4].unsqueeze(0), torch.full_like(owner, -1, dtype=rows.dtype))
        keyed = torch.cat((keyed, torch.full((batch, max_det), -1.0, dtype=rows.dtype, device=rows.device)), 1)
        rows = torch.cat((rows, torch.zeros((max_det, 6), dtype=rows.dtype, device=rows.device)))
        top_scores, top = keyed.topk(max_det, dim=1)
        return rows[top] * (top_scores >= 0).unsqueeze(-1).to(rows.dtype)
