"""Task-aligned label assignment (TOOD) for the anchor-free heads of YOLOv8, YOLO11 and YOLO26.

For every ground-truth box (gt) and anchor point the assigner scores how well the anchor's current prediction
already fits the gt: ``t = s**alpha * CIoU**beta``, with ``s`` the predicted probability of the gt's class and
CIoU (clamped at 0) between the predicted and the gt box. A gt's positives are its ``topk`` anchors by ``t`` among
the anchors whose centres lie inside it; an anchor claimed by several gts keeps the one it overlaps most. The
class target of a positive is a soft score: ``t`` rescaled per gt so that its best anchor gets the gt's best IoU.

Small objects: a gt side shorter than ``small_object_px`` is widened to it about the centre for the "inside" test
only, so tiny objects still find candidate anchors (Ultralytics 8.4 does so with its second stride, 16 px; older
releases, with which the published v8/11 weights were trained, did not: ``small_object_px=None``).

Everything is batched over (image, gt, anchor), dense and masked (no ``nonzero``: the host never waits for the
device); gts are padded per image to the batch's largest count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from utils.boxes import bbox_ciou_xyxy, xywh2xyxy, xyxy2xywh


class Assignment(NamedTuple):
    """Targets of every anchor of a batch: B images, A anchors, nc classes."""

    fg_mask: torch.Tensor  # (B, A) bool, positive anchors
    target_gt: torch.Tensor  # (B, A) long, index of the assigned gt within its image (0 where not positive)
    target_boxes: torch.Tensor  # (B, A, 4) xyxy in the units of the gt boxes given
    target_labels: torch.Tensor  # (B, A) long
    target_scores: torch.Tensor  # (B, A, nc) soft class targets (0 off the assigned class and off positives)


class TaskAlignedAssigner:
    """``assign = TaskAlignedAssigner(nc)(class_logits, boxes, anchor_points, gt_labels, gt_boxes, gt_mask)``.

    ``topk2`` (the one-to-one head of YOLO26 uses topk 7, topk2 1) keeps, after conflicts are resolved, only each
    gt's best ``topk2`` positives by alignment. ``eps`` guards the soft-target normalisation.
    """

    def __init__(
        self,
        nc: int,
        topk: int = 10,
        alpha: float = 0.5,
        beta: float = 6.0,
        *,
        topk2: int | None = None,
        small_object_px: float | None = 16.0,
        eps: float = 1e-9,
    ) -> None:
        self.nc = nc
        self.topk = topk
        self.topk2 = topk2 if topk2 is not None else topk
        self.alpha = alpha
        self.beta = beta
        self.small_object_px = small_object_px
        self.eps = eps

    @torch.no_grad()
    def __call__(
        self,
        pred_logits: torch.Tensor,
        pred_boxes: torch.Tensor,
        anchor_points: torch.Tensor,
        gt_labels: torch.Tensor,
        gt_boxes: torch.Tensor,
        gt_mask: torch.Tensor,
    ) -> Assignment:
        """Assign a batch.

        pred_logits (B, A, nc) class logits (any memory layout; the sigmoid is taken only where needed);
        pred_boxes (B, A, 4) xyxy; anchor_points (A, 2) xy in the same units (pixels); gt_labels (B, M) long;
        gt_boxes (B, M, 4) xyxy; gt_mask (B, M) bool, False on padding rows.
        """
        batch, num_anchors, _ = pred_logits.shape
        num_gt = gt_boxes.shape[1]
        device = pred_logits.device
        if num_gt == 0:
            return Assignment(
                fg_mask=torch.zeros((batch, num_anchors), dtype=torch.bool, device=device),
                target_gt=torch.zeros((batch, num_anchors), dtype=torch.long, device=device),
                target_boxes=torch.zeros_like(pred_boxes),
                target_labels=torch.zeros((batch, num_anchors), dtype=torch.long, device=device),
                target_scores=torch.zeros((batch, num_anchors, self.nc), device=device),
            )

        in_gt = self.anchors_inside(anchor_points, gt_boxes) & gt_mask[..., None]  # (B, M, A)
        align, overlaps = self.alignment(pred_logits, pred_boxes, gt_labels, gt_boxes, in_gt)

        # Each gt's top-k anchors by alignment, among all anchors; only those inside it count.
        k = min(self.topk, num_anchors)
        top = align.topk(k, dim=-1).indices  # (B, M, k)
        positive = torch.zeros_like(in_gt).scatter_(-1, top, True) & in_gt

        # An anchor claimed by several gts goes to the gt it overlaps most (among all gts it lies inside).
        claims = positive.sum(1)  # (B, A)
        best_gt = overlaps.max(1).indices  # (B, A)
        best = torch.zeros_like(positive).scatter_(1, best_gt[:, None], True)
        positive = torch.where((claims > 1)[:, None], best, positive)

        if self.topk2 != self.topk:
            k2 = min(self.topk2, num_anchors)
            top2 = (align * positive).topk(k2, dim=-1).indices
            positive &= torch.zeros_like(positive).scatter_(-1, top2, True)

        fg_mask, target_gt = positive.max(1)  # at most one gt per anchor now; index 0 where none
        target_labels = gt_labels.gather(1, target_gt).clamp(min=0)  # (B, A)
        target_boxes = gt_boxes.gather(1, target_gt[..., None].expand(-1, -1, 4))  # (B, A, 4)

        # Soft scores: per gt, t * (its best IoU) / (its best t), over its positives; per anchor, its gt's value.
        align = align * positive
        overlaps = overlaps * positive
        best_align = align.amax(-1, keepdim=True)
        best_overlap = overlaps.amax(-1, keepdim=True)
        score = (align * best_overlap / (best_align + self.eps)).amax(1)  # (B, A)
        target_scores = torch.zeros((batch, num_anchors, self.nc), device=device)
        target_scores.scatter_(-1, target_labels[..., None], (score * fg_mask)[..., None])
        return Assignment(fg_mask, target_gt, target_boxes, target_labels, target_scores)

    def anchors_inside(self, anchor_points: torch.Tensor, gt_boxes: torch.Tensor, margin: float = 1e-9) -> torch.Tensor:
        """(B, M, A) bool: anchor centres strictly inside each gt box (small gts widened, see the module doc)."""
        if self.small_object_px is not None:
            xywh = xyxy2xywh(gt_boxes)
            xywh[..., 2:] = xywh[..., 2:].clamp(min=self.small_object_px)
            gt_boxes = xywh2xyxy(xywh)
        x = anchor_points[:, 0]
        y = anchor_points[:, 1]
        x1, y1, x2, y2 = (gt_boxes[..., i, None] for i in range(4))  # (B, M, 1) each
        return (x - x1 > margin) & (y - y1 > margin) & (x2 - x > margin) & (y2 - y > margin)

    def alignment(
        self,
        pred_logits: torch.Tensor,
        pred_boxes: torch.Tensor,
        gt_labels: torch.Tensor,
        gt_boxes: torch.Tensor,
        in_gt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, M, A) alignment metric and CIoU (clamped at 0), zero outside the (gt, anchor) pairs ``in_gt``.

        Dense over every pair, masked: selecting the pairs (``nonzero``) would make the host wait for the device
        to say how many there are, and the elementwise CIoU of a pair is the same either way.
        """
        overlap = bbox_ciou_xyxy(gt_boxes[:, :, None], pred_boxes[:, None]).clamp(min=0)  # (B, M, A)
        labels = gt_labels[:, None, :].expand(-1, pred_logits.shape[1], -1)  # (B, A, M)
        score = pred_logits.gather(2, labels).transpose(1, 2).sigmoid()  # (B, M, A) the gt's class
        zero = overlap.new_zeros(())
        overlaps = torch.where(in_gt, overlap, zero)
        align = torch.where(in_gt, score.pow(self.alpha) * overlap.pow(self.beta), zero.to(score.dtype))
        return align, overlaps
