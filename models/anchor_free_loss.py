"""Training loss of the anchor-free heads: YOLOv8 / YOLO11 (DFL) and YOLO26 (L1, one-to-many + one-to-one).

Per head, with targets from the task-aligned assigner (models/assigner.py) and ``tss`` the sum of all soft target
scores of the GLOBAL micro-batch (every rank's, through ``reduce``), at least 1:

- cls: BCE-with-logits of every anchor's class logits against the soft targets, summed, / tss;
- box: (1 - CIoU) of each positive's predicted box and its gt, weighted by the positive's target score, / tss;
- dfl (reg_max > 1): distribution focal loss of the 4 side distributions against the gt's distances in strides,
  clamped to [0, reg_max - 1.01] (14.99 for reg_max 16), the two neighbouring bins weighted by proximity, averaged
  over the sides, weighted by the target score, / tss;
- l1 (reg_max == 1, YOLO26): L1 between the predicted and the gt side distances in pixels, the x sides divided by the
  image width and the y sides by its height, averaged over the sides, weighted by the target score, / tss.

The terms times the gains (box, cls, dfl: 7.5, 0.5, 1.5 by default) are the items; the loss is their sum times the
global micro-batch's image count. A rank's terms are its own sums over the global tss, so the ranks' losses and
gradients add up to those of the whole global micro-batch on one process: a step is the same at any world size.

YOLO26 (``End2EndLoss``) trains both heads: the one-to-many head with top-k 10 and the one-to-one head with top-k 7
then 1 (at most one positive per gt: one, unless conflicts gave all its candidates to other gts), weighted lambda
and 1 - lambda, lambda falling linearly from 0.8 in the first epoch to 0.1 in the last (``set_epoch``). Its items are
the one-to-one head's, the head used at inference (as Ultralytics logs them); the loss is the weighted sum of both
heads'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.anchor_free import bbox2dist, dist2bbox, make_anchors
from models.assigner import Assignment, TaskAlignedAssigner
from models.loss import CountsInsideTheCall, LossNorm, smooth_bce_targets
from utils.boxes import bbox_ciou_xyxy, xywh2xyxy
from utils.distributed import de_parallel

Reduce = Callable[[torch.Tensor], torch.Tensor]

TAL_ALPHA = 0.5  # class-score exponent of the alignment metric
TAL_BETA = 6.0  # CIoU exponent of the alignment metric
DFL_TARGET_MARGIN = 0.01  # DFL targets stop this far below the last bin, so bin floor(d) + 1 exists
O2M_WEIGHT_FIRST = 0.8  # YOLO26: one-to-many weight in the first epoch ...
O2M_WEIGHT_LAST = 0.1  # ... and in the last


# ---- pieces shared by both losses ------------------------------------------------------------------------------


class GroundTruth(NamedTuple):
    """A batch's gts padded per image to the largest count M."""

    labels: torch.Tensor  # (B, M) long
    boxes: torch.Tensor  # (B, M, 4) xyxy pixels
    mask: torch.Tensor  # (B, M) bool, False on padding


class HeadTargets(NamedTuple):
    """One head's decoded predictions and their assignment."""

    box_logits: torch.Tensor  # (B, 4 * reg_max, A) with grad
    cls_logits: torch.Tensor  # (B, nc, A) with grad
    anchor_points: torch.Tensor  # (A, 2) grid units
    strides: torch.Tensor  # (A, 1)
    assigned: Assignment  # target boxes in pixels
    score_sum: torch.Tensor  # () this rank's sum of target scores


def pad_targets(targets: torch.Tensor, batch: int, image_hw: tuple[int, int], num: int | None = None) -> GroundTruth:
    """(N, 6) rows [image, class, x, y, w, h] (xywh normalised) -> per-image padded labels and pixel xyxy boxes.

    ``num`` is the most rows of one image, counted by the caller on the host (the training step has the batch's
    rows there before the copy); None counts it here, which makes the host wait for the device.
    A gt keeps its order among its image's rows (the order decides ties in the assignment).
    """
    device = targets.device
    image = targets[:, 0].long()
    counts = torch.zeros(batch, dtype=torch.long, device=device).index_add_(0, image, torch.ones_like(image))
    if num is None:
        num = int(counts.max()) if targets.shape[0] else 0
    order = torch.argsort(image, stable=True)
    image = image[order]
    starts = counts.cumsum(0) - counts
    slot = torch.arange(image.shape[0], device=device) - starts[image]
    h, w = image_hw
    xywh = targets[order, 2:6]  # a copy; scaled by Python numbers: a tensor of them would be a host copy
    xywh[:, 0::2] *= w
    xywh[:, 1::2] *= h
    labels = torch.zeros((batch, num), dtype=torch.long, device=device)
    boxes = torch.zeros((batch, num, 4), dtype=torch.float32, device=device)
    mask = torch.zeros((batch, num), dtype=torch.bool, device=device)
    labels[image, slot] = targets[order, 1].long()
    boxes[image, slot] = xywh2xyxy(xywh)
    mask[image, slot] = torch.ones((), dtype=torch.bool, device=device)  # not True: a host number is a copy
    return GroundTruth(labels, boxes, mask)


def global_sum(local: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    """``local`` summed over all ranks (``reduce``), or as it is on one process."""
    return reduce(local.detach().clone()) if reduce is not None else local.detach()


# ---- the losses ------------------------------------------------------------------------------------------------


class AnchorFreeLoss(CountsInsideTheCall):
    """Loss of an anchor-free Detect head (YOLOv8 / YOLO11; reg_max 1 switches DFL to L1): see the module doc.

    ``loss, items = AnchorFreeLoss(model, hyp)(preds, targets, norm, prepared, reduce)`` with ``preds`` the head's
    training output (one (B, 4 * reg_max + nc, ny, nx) tensor per level). Gains come from ``hyp.box``, ``hyp.cls``,
    ``hyp.dfl``, or ``gains=(box, cls, dfl)``. ``small_object_px`` None turns off the widening of small gts for the
    candidate test (Ultralytics before 8.4). ``label_smoothing`` eps maps the soft targets t to
    t * (1 - eps) + eps / 2 (0 = off; Ultralytics has none).
    """

    def __init__(
        self,
        model: nn.Module,
        hyp: Any = None,
        *,
        tal_topk: int = 10,
        tal_topk2: int | None = None,
        small_object_px: float | None = 16.0,
        label_smoothing: float = 0.0,
        gains: tuple[float, float, float] | None = None,
    ) -> None:
        net: Any = de_parallel(model)  # a Model: its layers are untyped nn.Module attributes
        head = net.model[-1]
        self.strides: list[float] = [float(s) for s in head.stride]  # fixed once the model is built
        self.nc: int = int(head.nc)
        self.reg_max: int = int(head.reg_max)
        self.item_names: tuple[str, ...] = ("box", "cls", "dfl" if self.reg_max > 1 else "l1")
        if gains is None:
            if not all(hasattr(hyp, key) for key in ("box", "cls", "dfl")):
                raise ValueError("AnchorFreeLoss needs the gains box, cls and dfl: in hyp or as gains=(box, cls, dfl)")
            gains = (float(hyp.box), float(hyp.cls), float(hyp.dfl))
        self.gains = gains
        self.assigner = TaskAlignedAssigner(
            self.nc, tal_topk, TAL_ALPHA, TAL_BETA, topk2=tal_topk2, small_object_px=small_object_px
        )
        self.smooth_scale, self.smooth_offset = 1.0 - label_smoothing, smooth_bce_targets(label_smoothing)[1]

    def __call__(
        self,
        preds: Sequence[torch.Tensor],
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        prepared: Any = None,
        reduce: Reduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss (scalar, times the global image count) and its (box, cls, dfl|l1) items, detached."""
        levels = self._levels(preds)
        gt = self._ground_truth(levels, targets, norm)
        head = self.assign(levels, gt, self.assigner)
        tss = global_sum(head.score_sum, reduce).clamp(min=1.0)
        items = self.terms(head, self._image_hw(levels), tss)
        images = norm.images if norm is not None else levels[0].shape[0]
        return items.sum() * images, items.detach()

    # ---- steps, shared with End2EndLoss ----

    @staticmethod
    def _levels(preds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(preds, dict) or not len(preds) or not all(isinstance(p, torch.Tensor) for p in preds):
            raise TypeError("expected the head's training output: one (B, 4 * reg_max + nc, ny, nx) tensor per level")
        return [p.float() for p in preds]

    def _image_hw(self, levels: list[torch.Tensor]) -> tuple[int, int]:
        """The input size, from the finest level's grid (inputs are multiples of the largest stride)."""
        stride = self.strides[0]
        return int(levels[0].shape[2] * stride), int(levels[0].shape[3] * stride)

    def _ground_truth(
        self, levels: list[torch.Tensor], targets: torch.Tensor, norm: LossNorm | None = None
    ) -> GroundTruth:
        targets = targets.to(device=levels[0].device, dtype=torch.float32)
        num = norm.most_per_image if norm is not None else None
        return pad_targets(targets, levels[0].shape[0], self._image_hw(levels), num)

    def assign(self, levels: list[torch.Tensor], gt: GroundTruth, assigner: TaskAlignedAssigner) -> HeadTargets:
        """Decode one head's predictions and assign the gts to its anchors."""
        batch = levels[0].shape[0]
        channels = 4 * self.reg_max + self.nc
        if any(p.shape[1] != channels for p in levels):
            raise ValueError(
                f"head outputs have {[p.shape[1] for p in levels]} channels, expected {channels} "
                f"(4 * reg_max {self.reg_max} + nc {self.nc})"
            )
        # Channels first, as the head makes them: no transposed copy of the whole output.
        flat = torch.cat([p.reshape(batch, channels, -1) for p in levels], 2)  # (B, C, A)
        box_logits, cls_logits = flat.split((4 * self.reg_max, self.nc), 1)
        anchor_points, strides = self._anchors(levels)
        with torch.no_grad():
            if self.reg_max > 1:  # the bins' expectation, softmax along the channels: no transposed copy
                probs = box_logits.detach().view(batch, 4, self.reg_max, -1).softmax(2)
                bins = torch.arange(self.reg_max, device=flat.device, dtype=flat.dtype).view(-1, 1)
                distances = (probs * bins).sum(2)  # (B, 4, A)
            else:
                distances = box_logits.detach()
            pred_boxes = dist2bbox(distances.transpose(1, 2), anchor_points, xywh=False) * strides
        assigned = assigner(
            cls_logits.detach().transpose(1, 2), pred_boxes, anchor_points * strides, gt.labels, gt.boxes, gt.mask
        )
        return HeadTargets(box_logits, cls_logits, anchor_points, strides, assigned, assigned.target_scores.sum())

    def terms(self, head: HeadTargets, image_hw: tuple[int, int], tss: torch.Tensor) -> torch.Tensor:
        """(3,) gained box, cls and dfl|l1 terms of one head, this rank's sums over the global ``tss``.

        Over every anchor, masked: the weights are zero off the positives, which get a harmless unit box as
        target, so no inf or nan reaches a sum. Selecting the positives would make the host wait for the device.
        """
        assigned = head.assigned
        fg = assigned.fg_mask  # (B, A)
        weight = assigned.target_scores.sum(-1)  # (B, A) the positives' target scores, zero elsewhere

        # BCE(x, t) = softplus(x) - t * x, and t is zero but on the positives' assigned class (label smoothing adds
        # eps / 2 to every t).
        logits = head.cls_logits  # (B, nc, A)
        target_dot_logit = (assigned.target_scores.transpose(1, 2) * logits).sum() * self.smooth_scale
        if self.smooth_offset:
            target_dot_logit = target_dot_logit + self.smooth_offset * logits.sum()
        cls = (F.softplus(logits).sum() - target_dot_logit) / tss

        strides = head.strides  # (A, 1)
        box_logits = head.box_logits.transpose(1, 2)  # (B, A, 4 * reg_max)
        anchor_points = head.anchor_points  # (A, 2) grid units
        unit_box = torch.cat((anchor_points - 0.5, anchor_points + 0.5), -1)
        target_boxes = torch.where(fg[..., None], assigned.target_boxes / strides, unit_box)  # grid units
        ciou = bbox_ciou_xyxy(dist2bbox(self._distances(box_logits), anchor_points, xywh=False), target_boxes)
        box = ((1.0 - ciou) * weight).sum() / tss

        target_dist = bbox2dist(anchor_points, target_boxes)  # (B, A, 4) strides, unclamped (DFL clamps its own)
        if self.reg_max > 1:
            side = self._dfl(box_logits.reshape(-1, self.reg_max), target_dist.reshape(-1)).view(*fg.shape, 4)
        else:
            h, w = image_hw
            per_side = torch.ones(4, device=strides.device)  # filled with Python numbers: no host copy
            per_side[0::2] /= w
            per_side[1::2] /= h
            side = ((box_logits - target_dist) * strides * per_side).abs()
        dist = (side.mean(-1) * weight).sum() / tss

        box_gain, cls_gain, dist_gain = self.gains
        return torch.stack((box * box_gain, cls * cls_gain, dist * dist_gain))

    def _anchors(self, levels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return make_anchors(levels, self.strides)

    def _distances(self, box_logits: torch.Tensor) -> torch.Tensor:
        """(..., 4 * reg_max) -> (..., 4) ltrb in strides: the expectation of each side's bins (raw if reg_max 1)."""
        if self.reg_max == 1:
            return box_logits
        bins = torch.arange(self.reg_max, device=box_logits.device, dtype=box_logits.dtype)
        return box_logits.unflatten(-1, (4, self.reg_max)).softmax(-1).matmul(bins)

    def _dfl(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(S,) DFL of S side distributions (S, reg_max) against distances (S,) in strides."""
        target = target.clamp(0, self.reg_max - 1 - DFL_TARGET_MARGIN)
        left = target.long()
        weight_left = (left + 1) - target
        log_p = F.log_softmax(logits, dim=1)
        log_left = log_p.gather(1, left[:, None]).squeeze(1)
        log_right = log_p.gather(1, (left + 1)[:, None]).squeeze(1)
        return -(log_left * weight_left + log_right * (1 - weight_left))


class End2EndLoss(AnchorFreeLoss):
    """YOLO26's loss: its one-to-many head (top-k 10) and one-to-one head (top-k 7, then 1), see the module doc.

    ``preds`` = ``{"one2many": levels, "one2one": levels}``. ``set_epoch(epoch, epochs)`` sets the weights of the
    epoch about to run (0-based); until called, the first epoch's.
    """

    def __init__(
        self,
        model: nn.Module,
        hyp: Any = None,
        *,
        tal_topk: int = 10,
        o2o_topk: int = 7,
        o2o_topk2: int = 1,
        small_object_px: float | None = 16.0,
        label_smoothing: float = 0.0,
        gains: tuple[float, float, float] | None = None,
    ) -> None:
        super().__init__(
            model, hyp, tal_topk=tal_topk, small_object_px=small_object_px, label_smoothing=label_smoothing, gains=gains
        )
        self.o2o_assigner = TaskAlignedAssigner(
            self.nc, o2o_topk, TAL_ALPHA, TAL_BETA, topk2=o2o_topk2, small_object_px=small_object_px
        )
        self.o2m_weight = O2M_WEIGHT_FIRST

    @property
    def o2o_weight(self) -> float:
        return max(1.0 - self.o2m_weight, 0.0)

    def set_epoch(self, epoch: int, epochs: int) -> None:
        progress = max(1.0 - epoch / max(epochs - 1, 1), 0.0)
        self.o2m_weight = progress * (O2M_WEIGHT_FIRST - O2M_WEIGHT_LAST) + O2M_WEIGHT_LAST

    def __call__(
        self,
        preds: Sequence[torch.Tensor] | dict[str, Sequence[torch.Tensor]],
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        prepared: Any = None,
        reduce: Reduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted loss of both heads (times the global image count) and the one-to-one head's items, detached."""
        if not isinstance(preds, dict) or {"one2many", "one2one"} - preds.keys():
            raise TypeError("expected YOLO26's training output: {'one2many': levels, 'one2one': levels}")
        o2m_levels, o2o_levels = self._levels(preds["one2many"]), self._levels(preds["one2one"])
        gt = self._ground_truth(o2m_levels, targets, norm)
        o2m = self.assign(o2m_levels, gt, self.assigner)
        o2o = self.assign(o2o_levels, gt, self.o2o_assigner)
        tss = global_sum(torch.stack((o2m.score_sum, o2o.score_sum)), reduce).clamp(min=1.0)  # one collective
        image_hw = self._image_hw(o2m_levels)
        o2m_items = self.terms(o2m, image_hw, tss[0])
        o2o_items = self.terms(o2o, image_hw, tss[1])
        images = norm.images if norm is not None else o2m_levels[0].shape[0]
        loss = (o2m_items.sum() * self.o2m_weight + o2o_items.sum() * self.o2o_weight) * images
        return loss, o2o_items.detach()
