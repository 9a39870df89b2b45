"""The loss of the real-time DETRs (RT-DETRv2, D-FINE), a ``models/loss.py: DetectionLoss``.

Output sets: every decoder layer's queries, D-FINE's pre-head (its boxes before the first layer's refinement), the
encoder's top-k (its proposals) and, in training, the same layers' denoising queries. Each matched set (layers,
pre-head, encoder) is matched to the boxes by the Hungarian matcher (``models/detr_matcher.py``); a denoising query
is matched by construction to the box it was made from (group g's positive j to box j of its image). On each set:

- vfl: varifocal BCE of every logit against the target score (the IoU of the matched query's box with its box, at
  the box's class; 0 elsewhere), weighted ``alpha p^gamma`` off the targets and by the target score on them
  (alpha 0.75, gamma 2), summed over the set's own matches; or, with ``class_loss="mal"``, DEIM's matchability-aware
  loss (item ``mal``): BCE against IoU^1.5 at the box's class, weighted ``p^1.5`` off the targets and 1 on them;
- box, giou: L1 of the matched boxes (centre and size in [0, 1]) and 1 - GIoU, summed;
- fgl (D-FINE, every decoder layer): fine-grained localisation: each matched query's 4 edge distributions
  (max_num_bins + 1 bins) against its box's edge distances from the query's reference point through D-FINE's
  weighting function W(n), the two bins around the distance weighted by proximity, cross-entropy weighted by the
  pair's IoU, summed;
- ddf (D-FINE, every decoder layer but the last): decoupled distillation of the last layer's edge distributions
  into the layer's, KL at temperature 5 times T^2, weighted by the pair's IoU on matched queries and by the
  teacher's best score elsewhere; the mean over matched edges and the mean over the others, weighted by the square
  roots of their counts.

D-FINE's box terms (box, giou, fgl, ddf) of the matched sets take the union of every matched set's matches (each
query matched anywhere, with the box it is matched to most often: the official criterion's "go" indices), divided
by the union's size; RT-DETRv2's take each set's own matches.

Normalisation: the terms divide by global counts (every rank's): vfl by the boxes, the box terms by their pairs,
the denoising sets' by their positive queries, ddf's means by their edges. The sums are this rank's, the counts
global (one all-reduce of a few numbers through ``reduce``), so the ranks' losses and gradients add up to those of
the global micro-batch on one process. The gains are transformers' config fields (``weight_loss_vfl`` 1,
``weight_loss_bbox`` 5, ``weight_loss_giou`` 2, ``weight_loss_fgl`` 0.15, ``weight_loss_ddf`` 1.5), replaced by a
run's hyper-parameters where its record has them (``DetrLossConfig.with_hyp``); an item is a term
summed over the sets, times its gain; the loss is the items' sum times the global image count (the contract's
scale). A batch without boxes has a loss (every query a negative) and a gradient for every parameter.

The matching (its costs on the device, the assignment on the host, the matches back) is a phase of the step's time
split of its own (``timed_phases``): the loss marks where it begins and ends on the step's marks.

Each term of a set, given the same pairs, is transformers' (``DFineLoss``, ``RTDetrLoss``: the suite checks it term
by term). Where the sets differ from transformers' criterion (5.24), the official ones are followed: transformers
pairs D-FINE's auxiliary logits and boxes with the edge distributions of the layer after (the pre-head's with the
first layer's), so the second-to-last layer's logits and boxes and the last denoising layer go without a loss and the
last layer without fgl, and it uses each set's own matches for the box terms. As transformers (and unlike the official criterion, which reuses the matched layers' counts), ddf weighs a
denoising layer's two means by that layer's own counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models.detr_matcher import HostMatches, MatchCosts, cxcywh_to_xyxy, hungarian, union_of_matches
from models.loss import CountsInsideTheCall, LossNorm
from utils.distributed import de_parallel

Reduce = Callable[[torch.Tensor], torch.Tensor]
Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (image, query, box row) on the device

DDF_TEMPERATURE = 5.0
MAL_GAMMA = 1.5  # DEIM's (its configs/base/deim.yml)
FGL_EDGE_MARGIN = 0.1  # an edge's bin position stops this far below the last bin (the references' eps)
BOX_EPS = 1e-16  # the reference point's width in the edge distance's divisor, as the references


@dataclass(frozen=True)
class DetrLossConfig:
    """What the loss reads from transformers' model config."""

    nc: int
    vfl: float = 1.0
    bbox: float = 5.0
    giou: float = 2.0
    fgl: float = 0.15
    ddf: float = 1.5
    alpha: float = 0.75  # focal_loss_alpha, of the varifocal weight
    gamma: float = 2.0
    bins: int = 0  # max_num_bins (D-FINE: 32); 0: no edge distributions (RT-DETRv2)
    reg_scale: float = 4.0
    up: float = 0.5
    clamp_boxes: bool = False  # D-FINE's loss takes the boxes clamped to [0, 1]
    union: bool = False  # D-FINE's box terms take the union of the sets' matches
    costs: MatchCosts = field(default_factory=MatchCosts)

    @classmethod
    def of(cls, config: Any, distributions: bool) -> DetrLossConfig:
        costs = MatchCosts(
            float(config.matcher_class_cost),
            float(config.matcher_bbox_cost),
            float(config.matcher_giou_cost),
            float(config.matcher_alpha),
            float(config.matcher_gamma),
        )
        return cls(
            nc=int(config.num_labels),
            vfl=float(config.weight_loss_vfl),
            bbox=float(config.weight_loss_bbox),
            giou=float(config.weight_loss_giou),
            fgl=float(getattr(config, "weight_loss_fgl", 0.0)),
            ddf=float(getattr(config, "weight_loss_ddf", 0.0)),
            alpha=float(config.focal_loss_alpha),
            gamma=float(config.focal_loss_gamma),
            bins=int(config.max_num_bins) if distributions else 0,
            reg_scale=float(getattr(config, "reg_scale", 4.0)),
            up=float(getattr(config, "up", 0.5)),
            clamp_boxes=distributions,
            union=distributions,
            costs=costs,
        )

    def with_hyp(self, hyp: Any) -> DetrLossConfig:
        """The gains and matching costs a run's hyper-parameters set (the family's record: ``vfl`` or ``mal``, ``bbox``, ``giou``,
        ``fgl``, ``ddf``, ``focal_alpha``, ``focal_gamma``, ``cost_class``, ``cost_bbox``, ``cost_giou``,
        ``matcher_alpha``, ``matcher_gamma``), in place of the model config's; a record without them changes nothing."""
        if hyp is None:
            return self
        names = {"vfl": "vfl", "bbox": "bbox", "giou": "giou", "fgl": "fgl", "ddf": "ddf"}
        values: dict[str, Any] = {
            ours: float(getattr(hyp, theirs)) for ours, theirs in names.items() if hasattr(hyp, theirs)
        }
        if float(getattr(hyp, "mal", 0.0)) > 0:  # DEIM's MAL in the varifocal loss's place, at its own gain
            values["vfl"] = float(hyp.mal)
        if hasattr(hyp, "focal_alpha"):
            values["alpha"] = float(hyp.focal_alpha)
        if hasattr(hyp, "focal_gamma"):
            values["gamma"] = float(hyp.focal_gamma)
        if not self.bins:  # fgl and ddf exist with the distributions only (D-FINE)
            values.pop("fgl", None)
            values.pop("ddf", None)
        c = self.costs
        costs = MatchCosts(
            float(getattr(hyp, "cost_class", c.class_weight)),
            float(getattr(hyp, "cost_bbox", c.bbox_weight)),
            float(getattr(hyp, "cost_giou", c.giou_weight)),
            float(getattr(hyp, "matcher_alpha", c.alpha)),
            float(getattr(hyp, "matcher_gamma", c.gamma)),
        )
        return replace(self, costs=costs, **values)


class OutputSet(NamedTuple):
    """One set of queries: (B, Q, nc) logits, (B, Q, 4) boxes; D-FINE's (B, Q, 4 (bins + 1)) edge distributions and
    (B, Q, 4) reference points, and the teacher's (the last layer's) distributions and logits for ddf."""

    logits: torch.Tensor
    boxes: torch.Tensor
    corners: torch.Tensor | None = None
    refs: torch.Tensor | None = None
    teacher_corners: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None


class DetrOutputs(NamedTuple):
    """A forward pass's sets: matched (the decoder layers, last one last; the encoder's top-k) and denoising."""

    matched: list[OutputSet]
    denoising: list[OutputSet]
    dn_groups: int  # G: denoising groups, each 2 M queries (M positives, then M negatives)
    dn_slots: int  # M: the batch's most boxes of one image
    per_image: list[int] | None  # boxes per image, when the forward pass counted them
    zero: torch.Tensor | None  # zero-weighted sum of the parameters the pass did not use (DDP needs every gradient)


def split_outputs(raw: Mapping[str, Any], clamp: bool) -> DetrOutputs:
    """``raw`` as ``models/detr.py: DetrDetector`` gives it: in training (``logits`` (B, L, Qdn + Q, nc), ...)
    or in eval (``logits`` (B, Q, nc) and ``pred_boxes`` of the last layer)."""

    def box(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(0, 1) if clamp else t

    if "pred_boxes" in raw:  # eval: the last layer alone, its distributions where D-FINE has them
        last = OutputSet(raw["logits"], box(raw["pred_boxes"]), raw.get("pred_corners"), raw.get("ref_points"))
        return DetrOutputs([last], [], 0, 0, None, None)
    logits, boxes, corners, refs = (raw[k] for k in ("logits", "boxes", "corners", "refs"))
    # D-FINE's first logits and boxes are its pre-head's (before the first layer's refinement), without distributions
    layers = corners.shape[1] if corners is not None else logits.shape[1]
    first = logits.shape[1] - layers
    dn = int(raw["dn_queries"])

    def layer_set(i: int, part: slice) -> OutputSet:
        if i < 0:  # the pre-head
            return OutputSet(logits[:, 0, part], box(boxes[:, 0, part]))
        has = corners is not None and refs is not None
        teacher = has and i < layers - 1
        return OutputSet(
            logits[:, first + i, part],
            box(boxes[:, first + i, part]),
            corners[:, i, part] if has else None,
            refs[:, i, part].detach() if has else None,
            corners[:, -1, part].detach() if teacher else None,
            logits[:, -1, part].detach() if teacher else None,
        )

    order = list(range(layers)) + ([-1] if first else [])
    matched = [layer_set(i, slice(dn, None)) for i in order]
    matched.append(OutputSet(raw["enc_logits"], box(raw["enc_boxes"])))
    denoising = [layer_set(i, slice(0, dn)) for i in order] if dn else []
    slots = dn // (2 * raw["dn_groups"]) if dn else 0
    return DetrOutputs(matched, denoising, int(raw["dn_groups"]), slots, raw.get("per_image"), raw.get("zero"))


def set_names(out: DetrOutputs) -> tuple[list[str], list[str]]:
    """The names of the matched sets (``layer{i}``, ``pre``, ``encoder``) and of the denoising ones (``dn_`` ...)."""
    layers = sum(1 for s in out.matched if s.corners is not None) or len(out.matched) - 1
    names = [f"layer{i}" for i in range(layers)] + ["pre"] * (len(out.matched) - 1 - layers) + ["encoder"]
    if len(out.matched) == 1:
        names = ["layer0"]
    return names, [f"dn_{n}" for n in names[: len(out.denoising)]]


def denoising_pairs(per_image: list[int], groups: int, slots: int) -> list[np.ndarray]:
    """(image, query, box row) of every denoising positive: group g's query g 2M + j stands for box j of its image."""
    if not groups:
        return [np.zeros(0, dtype=np.int64)] * 3
    starts = np.concatenate(([0], np.cumsum(per_image)))[:-1]
    image = np.repeat(np.arange(len(per_image)), per_image)
    within = np.arange(len(image)) - starts[image]
    offsets = np.arange(groups)[:, None] * 2 * slots
    return [
        np.tile(image, groups).astype(np.int64),
        (offsets + within[None]).reshape(-1).astype(np.int64),
        np.tile(np.arange(len(image)), groups).astype(np.int64),
    ]


def weighting_function(bins: int, up: float, reg_scale: float, device: torch.device) -> torch.Tensor:
    """D-FINE's W(n), n = 0 .. bins: the edge offsets of the bins, in units of the reference box's size over
    reg_scale (filled on the device from Python numbers: nothing is copied to it)."""
    bound = abs(up) * abs(reg_scale)
    step = (bound + 1) ** (2 / (bins - 2))
    half = bins // 2
    left = 1 - torch.pow(step, torch.arange(half - 1, 0, -1, device=device, dtype=torch.float32))
    right = torch.pow(step, torch.arange(1, half, device=device, dtype=torch.float32)) - 1
    ends = torch.full((1,), 2 * bound, device=device)
    return torch.cat((-ends, left, torch.zeros(1, device=device), right, ends))


def edge_targets(
    refs: torch.Tensor, boxes_xyxy: torch.Tensor, values: torch.Tensor, reg_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (P * 4,) left bin of each edge's distance (left, top, right, bottom of ``boxes_xyxy`` from the reference
    points ``refs`` cxcywh) and the weights of that bin and the next."""
    scale = abs(reg_scale)
    w = refs[:, 2] / scale + BOX_EPS
    h = refs[:, 3] / scale + BOX_EPS
    distance = torch.stack(
        (
            (refs[:, 0] - boxes_xyxy[:, 0]) / w,
            (refs[:, 1] - boxes_xyxy[:, 1]) / h,
            (boxes_xyxy[:, 2] - refs[:, 0]) / w,
            (boxes_xyxy[:, 3] - refs[:, 1]) / h,
        ),
        -1,
    ).reshape(-1) - (0.5 * scale)
    bins = values.shape[0] - 1
    left = (values[None] <= distance[:, None]).sum(1) - 1
    inside = (left >= 0) & (left < bins)
    safe = left.clamp(0, bins - 1)
    to_left = (distance - values[safe]).abs()
    to_right = (values[safe + 1] - distance).abs()
    below = left < 0
    weight_right = torch.where(inside, to_left / (to_left + to_right), torch.where(below, 0.0, 1.0))
    position = torch.where(below, 0.0, torch.where(left >= bins, bins - FGL_EDGE_MARGIN, left.float()))
    position = position.clamp(0, bins - FGL_EDGE_MARGIN)
    return position.long(), 1.0 - weight_right, weight_right


def pair_iou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU and GIoU of each pair of xyxy boxes (P, 4)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    inter = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    iou = inter / union
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).clamp(min=0).prod(-1)
    return iou, iou - (hull - union) / hull


class SetNorm(NamedTuple):
    """The global counts one kind of set's terms divide by."""

    boxes: torch.Tensor  # () boxes (vfl), at least 1
    box_pairs: torch.Tensor  # () pairs of the box terms (D-FINE: the union of the matches), at least 1
    matched_edges: torch.Tensor  # () 4 x pairs of the box terms
    other_edges: torch.Tensor  # () 4 x queries - matched edges
    images: float


class DetrLoss(CountsInsideTheCall):
    """``loss, items = DetrLoss(model, distributions)(raw, targets, norm, reduce=...)``: see the module doc.

    ``distributions``: D-FINE's edge distributions (fgl and ddf terms; boxes clamped to [0, 1]) or not
    (RT-DETRv2). ``targets`` (N, 6) = image, class, cx, cy, w, h normalised, rows grouped by image."""

    timed_phases: tuple[str, ...] = ("matcher",)

    def __init__(self, model: nn.Module, distributions: bool, class_loss: str = "vfl", hyp: Any = None) -> None:
        if class_loss not in ("vfl", "mal"):
            raise ValueError(f"class_loss {class_loss!r}: 'vfl' (the references') or 'mal' (DEIM's)")
        net: Any = de_parallel(model)
        self.cfg = DetrLossConfig.of(net.detr.config, distributions).with_hyp(hyp)
        self.class_loss = class_loss
        self.item_names: tuple[str, ...] = (class_loss, "box", "giou", "fgl", "ddf")[: 5 if distributions else 3]
        self._values: dict[torch.device, torch.Tensor] = {}
        self._batch = 0  # the last call's images and unused parameters' zero term
        self._zero: torch.Tensor | None = None

    def __call__(
        self,
        preds: Mapping[str, Any],
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        prepared: Any = None,
        reduce: Reduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss (times the global image count) and its items, detached."""
        terms = self.set_terms(preds, targets, norm, reduce)
        items = torch.stack([sum(t[i] for t in terms.values()) for i in range(len(self.item_names))])  # type: ignore[misc]
        loss = items.sum() * (norm.images if norm is not None else self._batch)
        if self._zero is not None:
            loss = loss + self._zero
        return loss, items.detach()

    def set_terms(
        self,
        preds: Mapping[str, Any],
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        reduce: Reduce | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each set's gained terms ((len(item_names),) each), keyed ``layer{i}``, ``pre``, ``encoder``, ``dn_...``."""
        out = split_outputs(preds, self.cfg.clamp_boxes)
        targets = targets.to(device=out.matched[0].logits.device, dtype=torch.float32)
        self._batch = out.matched[0].logits.shape[0]
        self._zero = out.zero
        logits = torch.stack([s.logits for s in out.matched])
        boxes = torch.stack([s.boxes for s in out.matched])
        union_size = [0]

        def fixed_pairs(per_image: list[int], found: list[HostMatches]) -> list[np.ndarray]:
            union = list(union_of_matches(found)) if self.cfg.union else []
            union_size[0] = len(union[0]) if union else 0
            return denoising_pairs(per_image, out.dn_groups, out.dn_slots) + union

        self.marks.mark("forward")
        matches, per_image, fixed = hungarian(logits, boxes, targets, self.cfg.costs, out.per_image, fixed_pairs)
        self.marks.mark("matcher")
        dn: Pairs = (fixed[0], fixed[1], fixed[2])
        union: Pairs | None = (fixed[3], fixed[4], fixed[5]) if self.cfg.union else None
        counts = self.global_counts(out, per_image, union_size[0] if union else None, norm, reduce)
        names, dn_names = set_names(out)
        terms = {}
        for k, (name, s) in enumerate(zip(names, out.matched)):
            own = (matches.image[k], matches.query[k], matches.box[k])
            terms[name] = self.terms(s, own, union or own, targets, counts[0])
        for name, s in zip(dn_names, out.denoising):
            terms[name] = self.terms(s, dn, dn, targets, counts[1])
        return terms

    def global_counts(
        self, out: DetrOutputs, per_image: list[int], union: int | None, norm: LossNorm | None, reduce: Reduce | None
    ) -> tuple[SetNorm, SetNorm]:
        """The counts of the matched sets and of the denoising sets, summed over ranks in one all-reduce."""
        batch, queries = out.matched[0].logits.shape[:2]
        boxes = sum(per_image)  # the references' count (an image with more boxes than queries has some unmatched)
        dn_pairs = boxes * out.dn_groups
        dn_queries = 2 * out.dn_slots * out.dn_groups
        local = (boxes, boxes if union is None else union, batch * queries, dn_pairs, batch * dn_queries)
        stats = torch.zeros(len(local), device=out.matched[0].logits.device)
        for i, v in enumerate(local):
            stats[i].fill_(float(v))  # a fill from a Python number (``stats[i] = v`` would copy a host tensor)
        if reduce is not None:
            stats = reduce(stats)
        images = float(norm.images if norm is not None else batch)

        def set_norm(pairs: torch.Tensor, box_pairs: torch.Tensor, slots: torch.Tensor) -> SetNorm:
            return SetNorm(
                pairs.clamp(min=1.0), box_pairs.clamp(min=1.0), 4 * box_pairs, 4 * (slots - box_pairs), images
            )

        return set_norm(stats[0], stats[1], stats[2]), set_norm(stats[3], stats[3], stats[4])

    def terms(self, s: OutputSet, own: Pairs, boxed: Pairs, targets: torch.Tensor, n: SetNorm) -> torch.Tensor:
        """(len(item_names),) gained terms of one set, this rank's sums over the global counts: vfl on the set's
        own matches, the box terms on ``boxed`` (D-FINE: the union of the matches; otherwise the same)."""
        cfg = self.cfg
        iou = self.matched_boxes(s, own, targets)[2]
        classify = self.varifocal if self.class_loss == "vfl" else self.matchability
        vfl = classify(s.logits, own, targets[own[2], 1].long(), iou.detach()) / n.boxes
        pred, gt, iou, giou = self.matched_boxes(s, boxed, targets)
        box = (pred - gt).abs().sum() / n.box_pairs
        giou_term = (1 - giou).sum() / n.box_pairs
        found = [vfl * cfg.vfl, box * cfg.bbox, giou_term * cfg.giou]
        if cfg.bins:
            zero = s.logits.new_zeros(()).float()
            gt_xyxy = cxcywh_to_xyxy(gt)
            fgl = self.fine_grained(s, boxed, gt_xyxy, iou.detach()) / n.box_pairs if s.corners is not None else zero
            ddf = self.distillation(s, boxed, iou.detach(), n) if s.teacher_corners is not None else zero
            found += [fgl * cfg.fgl, ddf * cfg.ddf]
        return torch.stack(found)

    @staticmethod
    def matched_boxes(
        s: OutputSet, pairs: Pairs, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs' predicted and target boxes (cxcywh), their IoU and GIoU."""
        image, query, row = pairs
        pred = s.boxes[image, query].float()
        gt = targets[row, 2:6]
        iou, giou = pair_iou(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(gt))
        return pred, gt, iou, giou

    def varifocal(self, logits: torch.Tensor, pairs: Pairs, labels: torch.Tensor, iou: torch.Tensor) -> torch.Tensor:
        """The varifocal BCE summed over every query and class of the set."""
        image, query, _ = pairs
        logits = logits.float()
        onehot = torch.zeros_like(logits)
        onehot[image, query, labels] = onehot.new_ones(())  # not 1.0: a host number is a copy to the device
        score = torch.zeros_like(logits)
        score[image, query, labels] = iou
        weight = self.cfg.alpha * logits.detach().sigmoid().pow(self.cfg.gamma) * (1 - onehot) + score
        return F.binary_cross_entropy_with_logits(logits, score, weight=weight, reduction="sum")

    def matchability(self, logits: torch.Tensor, pairs: Pairs, labels: torch.Tensor, iou: torch.Tensor) -> torch.Tensor:
        """DEIM's matchability-aware loss, summed: BCE against IoU^gamma at the matched class (gamma 1.5), weighted
        ``p^gamma`` off the targets and 1 on them."""
        image, query, _ = pairs
        logits = logits.float()
        onehot = torch.zeros_like(logits)
        onehot[image, query, labels] = onehot.new_ones(())  # not 1.0: a host number is a copy to the device
        score = torch.zeros_like(logits)
        score[image, query, labels] = iou.pow(MAL_GAMMA)
        weight = logits.detach().sigmoid().pow(MAL_GAMMA) * (1 - onehot) + onehot
        return F.binary_cross_entropy_with_logits(logits, score, weight=weight, reduction="sum")

    def edge_values(self, device: torch.device) -> torch.Tensor:
        if device not in self._values:
            self._values[device] = weighting_function(self.cfg.bins, self.cfg.up, self.cfg.reg_scale, device)
        return self._values[device]

    def fine_grained(self, s: OutputSet, pairs: Pairs, gt_xyxy: torch.Tensor, iou: torch.Tensor) -> torch.Tensor:
        """fgl summed over the matched queries' edges."""
        image, query, _ = pairs
        assert s.corners is not None and s.refs is not None
        bins = self.cfg.bins + 1
        corners = s.corners[image, query].float().reshape(-1, bins)
        with torch.no_grad():
            left, w_left, w_right = edge_targets(
                s.refs[image, query].float(), gt_xyxy, self.edge_values(corners.device), self.cfg.reg_scale
            )
        log_p = F.log_softmax(corners, -1)
        loss = -(
            log_p.gather(1, left[:, None]).squeeze(1) * w_left
            + log_p.gather(1, (left + 1)[:, None]).squeeze(1) * w_right
        )
        return (loss * iou[:, None].expand(-1, 4).reshape(-1)).sum()

    def distillation(
        self, s: OutputSet, pairs: tuple[torch.Tensor, ...], iou: torch.Tensor, n: SetNorm
    ) -> torch.Tensor:
        """ddf: the matched edges' mean and the other edges' mean, weighted by the square roots of their counts per
        image (global counts)."""
        image, query, _ = pairs
        assert s.corners is not None and s.teacher_corners is not None and s.teacher_logits is not None
        bins = self.cfg.bins + 1
        t = DDF_TEMPERATURE
        with torch.no_grad():
            weight = s.teacher_logits.float().sigmoid().amax(-1)  # (B, Q)
            weight[image, query] = iou
            matched = torch.zeros_like(weight)
            matched[image, query] = matched.new_ones(())
        student = F.log_softmax(s.corners.float().reshape(-1, bins) / t, -1)
        teacher = F.softmax(s.teacher_corners.float().reshape(-1, bins) / t, -1)
        kl = F.kl_div(student, teacher, reduction="none").sum(-1).view(*weight.shape, 4)
        per_edge = kl * (weight * t * t)[..., None]
        on = (per_edge * matched[..., None]).sum()
        off = per_edge.sum() - on
        w_on = (n.matched_edges / n.images).sqrt()
        w_off = (n.other_edges / n.images).sqrt()
        mean_on = on / n.matched_edges.clamp(min=1.0)
        mean_off = off / n.other_edges.clamp(min=1.0)
        return (mean_on * w_on + mean_off * w_off) / (w_on + w_off).clamp(min=math.ulp(1.0))
