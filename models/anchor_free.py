"""The anchor-free detection head of YOLOv8, YOLO11 and YOLO26, and the anchor-point geometry it predicts on.

Every feature-map cell is an anchor point (its centre, in grid units); the head predicts for each point the distances
to the four box sides (left, top, right, bottom, in strides) and one logit per class. YOLOv8/11 predict each
distance as a distribution over ``reg_max`` = 16 bins (DFL: its expectation is the distance); YOLO26 predicts the
four distances directly (``reg_max`` = 1) and has a second, one-to-one head whose top-k output needs no NMS.

Tensor layout (shared with the loss, validation and export):
- training: per level ``(B, 4 * reg_max + nc, ny, nx)``, box channels first (side-major: 16 bins of left, then
  top, ...); YOLO26 returns ``{"one2many": [...], "one2one": [...]}`` of such lists.
- eval: ``(pred, raw)``, raw being the training output and pred ``(B, 4 + nc, A)``: box centre x, y, width, height
  in input pixels, then sigmoid class scores; A counts anchor points over levels (P3 first, row-major).
  With ``end2end_output`` (YOLO26) pred is ``(B, min(max_det, A), 6)``: x1 y1 x2 y2 score class, from the
  one-to-one head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any, cast

import torch
import torch.nn as nn

from models.blocks import DWConv
from models.common import Conv
from models.heads import PROBE_SIZE, DetectionHead, probe_input

# Blocks whose presence in a config gives the head the depthwise class branch (YOLO11 and later); without them
# (YOLOv8) the class branch keeps two full 3x3 convs, as Ultralytics builds both.
DEPTHWISE_CLASS_BRANCH_BLOCKS = frozenset({"C3k2", "A2C2f"})


def make_anchors(
    feats_or_shapes: Sequence[torch.Tensor] | Sequence[Sequence[int]] | torch.Tensor,
    strides: Sequence[float] | torch.Tensor,
    offset: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor points ``(A, 2)`` as (x, y) in grid units and their strides ``(A, 1)``.

    ``feats_or_shapes`` is a list of feature maps ``(B, C, ny, nx)`` or of ``(ny, nx)`` sizes, one per level.
    Points take the dtype and device of the feature maps (float32 on the CPU for sizes).
    """
    if len(feats_or_shapes) and isinstance(feats_or_shapes[0], torch.Tensor) and feats_or_shapes[0].dim() == 4:
        sizes = [tuple(f.shape[2:]) for f in cast("Sequence[torch.Tensor]", feats_or_shapes)]
        dtype, device = feats_or_shapes[0].dtype, feats_or_shapes[0].device
    else:
        sizes = [(int(s[0]), int(s[1])) for s in feats_or_shapes]
        dtype, device = torch.float32, torch.device("cpu")
    points, point_strides = [], []
    for (ny, nx), stride in zip(sizes, strides):
        # arange in fp32, then cast: the ONNX exporter cannot infer a Range of fp16 (an --half export fails).
        xs = torch.arange(nx, device=device, dtype=torch.float32).to(dtype) + offset
        ys = torch.arange(ny, device=device, dtype=torch.float32).to(dtype) + offset
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        points.append(torch.stack((grid_x, grid_y), -1).view(-1, 2))
        # A tensor stride stays a tensor and a number is filled in on the device: a tensor made of a host number
        # would be copied from pageable memory, which makes a GPU's host wait.
        if isinstance(stride, torch.Tensor):
            level_stride = stride.to(device=device, dtype=dtype).reshape(1, 1)
        else:
            level_stride = torch.full((1, 1), float(stride), device=device, dtype=dtype)
        point_strides.append(level_stride.expand(ny * nx, 1))
    return torch.cat(points), torch.cat(point_strides)


def dist2bbox(distance: torch.Tensor, anchor_points: torch.Tensor, xywh: bool = True, dim: int = -1) -> torch.Tensor:
    """Boxes from (left, top, right, bottom) distances to ``anchor_points``: xywh (centre, size) or xyxy."""
    lt, rb = distance.chunk(2, dim)
    top_left = anchor_points - lt
    bottom_right = anchor_points + rb
    if xywh:
        return torch.cat(((top_left + bottom_right) / 2, bottom_right - top_left), dim)
    return torch.cat((top_left, bottom_right), dim)


def bbox2dist(anchor_points: torch.Tensor, bbox_xyxy: torch.Tensor, reg_max: int | None = None) -> torch.Tensor:
    """(left, top, right, bottom) distances from ``anchor_points`` to the sides of xyxy boxes.

    With ``reg_max`` (DFL heads) they are clamped to [0, reg_max - 0.01], the range the bins can express.
    """
    top_left, bottom_right = bbox_xyxy.chunk(2, -1)
    dist = torch.cat((anchor_points - top_left, bottom_right - anchor_points), -1)
    return dist.clamp(0, reg_max - 0.01) if reg_max is not None else dist


class DFL(nn.Module):
    """Distribution focal loss' decoder: the expected bin index of a softmax over ``c1`` bins, per box side.

    The bin values 0..c1-1 are the weight of a frozen 1x1 conv (``conv.weight``, as the checkpoints store it).
    """

    def __init__(self, c1: int = 16):
        super().__init__()
        self.c1 = c1
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            # Made on the CPU whatever the default device (arange on 'meta' is slow to set up), then copied.
            self.conv.weight.copy_(torch.arange(c1, dtype=torch.float32, device="cpu").view(1, c1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 4 * c1, A)`` logits -> ``(B, 4, A)`` distances in strides."""
        b, _, a = x.shape
        probs = x.view(b, 4, self.c1, a).softmax(2)
        return (probs * self.conv.weight.view(1, 1, self.c1, 1).to(probs.dtype)).sum(2)


def _box_branch(c_in: int, c_hidden: int, reg_max: int) -> nn.Sequential:
    return nn.Sequential(Conv(c_in, c_hidden, 3), Conv(c_hidden, c_hidden, 3), nn.Conv2d(c_hidden, 4 * reg_max, 1))


def _class_branch(c_in: int, c_hidden: int, nc: int, legacy: bool) -> nn.Sequential:
    if legacy:  # YOLOv8: two full 3x3 convs
        return nn.Sequential(Conv(c_in, c_hidden, 3), Conv(c_hidden, c_hidden, 3), nn.Conv2d(c_hidden, nc, 1))
    # YOLO11/26: depthwise 3x3 then pointwise 1x1, twice
    return nn.Sequential(
        nn.Sequential(DWConv(c_in, c_in, 3), Conv(c_in, c_hidden, 1)),
        nn.Sequential(DWConv(c_hidden, c_hidden, 3), Conv(c_hidden, c_hidden, 1)),
        nn.Conv2d(c_hidden, nc, 1),
    )


class AnchorFreeDetect(DetectionHead):
    """Anchor-free head: per level a box branch (``cv2``) and a class branch (``cv3``); see the module docstring.

    ``legacy`` picks YOLOv8's plain class branch; ``end2end`` adds YOLO26's one-to-one branches
    (``one2one_cv2``/``one2one_cv3``, fed detached features while training). ``end2end_output`` makes eval
    forwards return the one-to-one top-k detections instead of the one-to-many predictions.
    """

    max_det = 300

    def __init__(
        self,
        nc: int = 80,
        reg_max: int = 16,
        end2end: bool = False,
        ch: Sequence[int] = (),
        legacy: bool = False,
        class_width: int | None = None,
    ):
        super().__init__()
        self.nc = nc
        self.nl = len(ch)
        self.reg_max = reg_max
        self.no = nc + 4 * reg_max
        self.legacy = legacy
        self.end2end = bool(end2end)
        self.end2end_output = False
        # Not saved (Ultralytics' state_dicts have no such entry): the model recomputes it when it is built.
        self.register_buffer("stride", torch.zeros(self.nl), persistent=False)
        c_box = max(16, ch[0] // 4, 4 * reg_max)
        # class_width (model config key head_class_width) keeps a source model's hidden width when fine-tuning
        # to another class count, so the class branch's hidden layers transfer (see models.yolo.build_model).
        c_cls = class_width or max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(_box_branch(c, c_box, reg_max) for c in ch)
        self.cv3 = nn.ModuleList(_class_branch(c, c_cls, nc, legacy) for c in ch)
        if reg_max > 1:
            self.dfl = DFL(reg_max)
        if self.end2end:
            # Same structure and same starting weights as the one-to-many branches.
            self.one2one_cv2 = deepcopy(self.cv2)
            self.one2one_cv3 = deepcopy(self.cv3)

    @classmethod
    def accepts(cls, cfg: Mapping[str, Any]) -> bool:
        return "anchors" not in cfg

    @classmethod
    def yaml_args(cls, args: list, cfg: Mapping[str, Any], channels: list[int]) -> list:
        """(nc, reg_max, end2end, channels, legacy, class_width) from the row's [nc] and the config's keys."""
        rows = list(cfg.get("backbone") or []) + list(cfg.get("head") or [])
        legacy = not any(len(row) > 2 and row[2] in DEPTHWISE_CLASS_BRANCH_BLOCKS for row in rows)
        return [
            args[0],
            cfg.get("reg_max", 16),
            bool(cfg.get("end2end", False)),
            channels,
            legacy,
            cfg.get("head_class_width"),
        ]

    @classmethod
    def fine_tune_config(cls, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The source's class-branch hidden width (input channels of its last layer; by default it follows nc)."""
        for key, tensor in weights.items():
            if key.endswith(".cv3.0.2.weight") and tensor.ndim == 4:
                return {"head_class_width": int(tensor.shape[1])}
        return {}

    def setup(self, model: nn.Module) -> None:
        """Strides from a probe forward in eval mode (the BatchNorm statistics stay as they are), then the biases."""
        model.eval()
        with torch.no_grad():
            _, raw = model(probe_input(model))
        model.train()
        levels = raw["one2many"] if isinstance(raw, dict) else raw
        self.stride.copy_(torch.tensor([PROBE_SIZE / level.shape[-2] for level in levels]))
        self.bias_init()

    def _branches(self, x: list[torch.Tensor], box: nn.ModuleList, cls: nn.ModuleList) -> list[torch.Tensor]:
        return [torch.cat((box[i](x[i]), cls[i](x[i])), 1) for i in range(self.nl)]

    def forward(self, x: list[torch.Tensor]) -> Any:
        raw: Any = self._branches(  # levels, or with the one-to-one head a dict of both heads' levels
            x, self.cv2, self.cv3
        )
        if self.end2end:
            # The one-to-one loss must not shape the backbone: only its own branches learn from it.
            features = [f.detach() for f in x] if self.training else x
            raw = {"one2many": raw, "one2one": self._branches(features, self.one2one_cv2, self.one2one_cv3)}
        if self.training:
            return raw
        if self.end2end and self.end2end_output:
            return self.topk_detections(self.decode(raw["one2one"], xywh=False)), raw
        return self.decode(raw["one2many"] if self.end2end else raw), raw

    def box_distances(self, box_logits: torch.Tensor) -> torch.Tensor:
        """``(B, 4 * reg_max, A)`` box channels -> ``(B, 4, A)`` ltrb distances in strides."""
        return self.dfl(box_logits) if self.reg_max > 1 else box_logits

    def decode(self, levels: list[torch.Tensor], xywh: bool = True) -> torch.Tensor:
        """Per-level raw outputs -> ``(B, 4 + nc, A)``: boxes in input pixels (xywh or xyxy), sigmoid scores."""
        b = levels[0].shape[0]
        flat = torch.cat([level.reshape(b, self.no, -1) for level in levels], 2)
        box_logits, cls_logits = flat.split((4 * self.reg_max, self.nc), 1)
        points, strides = make_anchors(levels, self.stride)
        boxes = dist2bbox(self.box_distances(box_logits), points.T.unsqueeze(0), xywh=xywh, dim=1) * strides.T
        return torch.cat((boxes, cls_logits.sigmoid()), 1)

    def topk_detections(self, pred: torch.Tensor) -> torch.Tensor:
        """``(B, 4 + nc, A)`` xyxy predictions -> ``(B, k, 6)`` x1 y1 x2 y2 score class, k = min(max_det, A).

        First the k anchor points with the best class score, then the k best (point, class) pairs among them,
        so one point may appear with two classes.
        """
        boxes, scores = pred.transpose(1, 2).split((4, self.nc), 2)
        k = min(self.max_det, scores.shape[1])
        point_index = scores.amax(2).topk(k, dim=1).indices
        scores = scores.gather(1, point_index.unsqueeze(-1).expand(-1, -1, self.nc))
        best, pair_index = scores.flatten(1).topk(k, dim=1)
        point_index = point_index.gather(1, pair_index // self.nc)
        boxes = boxes.gather(1, point_index.unsqueeze(-1).expand(-1, -1, 4))
        classes = (pair_index % self.nc).to(boxes.dtype)
        return torch.cat((boxes, best.unsqueeze(-1), classes.unsqueeze(-1)), 2)

    def bias_init(self) -> None:
        """Box bias 2.0; class bias log(5 / nc / (640 / stride)^2), about 5 objects per 640 image (strides needed)."""
        pairs = [(self.cv2, self.cv3)] + ([(self.one2one_cv2, self.one2one_cv3)] if self.end2end else [])
        box: Any  # each a branch's nn.Sequential
        cls: Any
        with torch.no_grad():
            for box_branches, cls_branches in pairs:
                for box, cls, stride in zip(box_branches, cls_branches, self.stride.tolist()):
                    box[-1].bias.fill_(2.0)
                    cls[-1].bias[: self.nc] = math.log(5 / self.nc / (640 / stride) ** 2)
