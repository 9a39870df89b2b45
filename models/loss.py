"""Training loss of the detection head: CIoU box loss, objectness and classification BCE.

Target assignment is vectorised and free of host-device synchronisation: every (target, anchor, cell)
candidate of a level is kept in a fixed-size tensor together with a ``valid`` mask, and masked sums
replace the boolean indexing that would force the device to report how many candidates survived.
When several candidates land on one (image, anchor, cell), the objectness target is the largest of their
CIoUs (deterministic), where YOLOv5 keeps whichever write happens last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.heads import Detect
from utils.boxes import bbox_ciou
from utils.distributed import de_parallel

# Objectness weight of each level, finest first: small-object levels have many more cells (and negatives).
LEVEL_BALANCE = {3: (4.0, 1.0, 0.4)}
LEVEL_BALANCE_FALLBACK = (4.0, 1.0, 0.25, 0.06, 0.02)


class LossNorm(NamedTuple):
    """What the means of a micro-batch divide by, counted over the whole global micro-batch (all ranks)."""

    positives: torch.Tensor  # (nl,) target-anchor-cell assignments per level
    images: int  # images
    most_per_image: int | None = None  # this micro-batch's most label rows of one image, counted on the host


class PhaseMarks(Protocol):
    """Where a loss marks the parts of its call it times (``DetectionLoss.timed_phases``): the training step's phase
    marks (utils/engine/timing.py), whose ``mark(phase)`` ends ``phase`` now; neither waits for the device."""

    def mark(self, phase: str) -> None: ...


class Unmarked:
    """The marks of a loss outside the training step's timing (validation, tests): nothing is recorded."""

    def mark(self, phase: str) -> None:
        return None


UNMARKED = Unmarked()


class DetectionLoss(Protocol):
    """What the training step and validation call for every model family (``Family.make_loss`` makes it).

    ``prepare`` runs before the forward pass (YOLOv5: the anchor assignment; anchor-free losses: nothing),
    ``counts`` gives the 1-D float counts that are summed over ranks before the forward pass and come back as
    ``norm.positives`` (empty for losses that need none), ``__call__`` returns the loss (scaled by the global
    micro-batch's image count) and its weighted terms (any number), named by ``item_names``, detached. ``reduce``
    sums a tensor over all ranks (None: one process). ``set_epoch`` is called at the start of every epoch.

    ``timed_phases`` names the parts of its call the loss times itself, each a phase of the step's time split of
    its own (the DETRs': the matcher); while the step times an epoch, ``marks`` is the step's, and the loss marks
    ``forward`` where such a part begins and the part's name where it ends. A loss that names none marks nothing.
    """

    item_names: tuple[str, ...]
    timed_phases: tuple[str, ...]
    marks: PhaseMarks

    def prepare(self, targets: torch.Tensor, image_hw: tuple[int, ...]) -> Any: ...

    def counts(self, prepared: Any) -> torch.Tensor: ...

    def __call__(
        self,
        preds: Any,
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        prepared: Any = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_epoch(self, epoch: int, epochs: int) -> None: ...


class CountsInsideTheCall:
    """The ``DetectionLoss`` methods of a loss that prepares nothing before the forward pass and gives no counts to
    sum then (its assignment or matching needs the predictions; any global counts it needs it sums in its call), and
    does not change with the epoch: the anchor-free losses and the DETRs'. It times no part of its call unless the
    loss names some (``timed_phases``)."""

    timed_phases: tuple[str, ...] = ()
    marks: PhaseMarks = UNMARKED

    def prepare(self, targets: torch.Tensor, image_hw: tuple[int, ...]) -> None:
        return None

    def counts(self, prepared: Any) -> torch.Tensor:
        return torch.zeros(0)

    def set_epoch(self, epoch: int, epochs: int) -> None:
        return None


class LevelTargets(NamedTuple):
    """Candidate assignments of one level, flattened over (cell kind, anchor, target): length M = 3 * na * nt.

    Only rows with ``valid`` set are assignments; the others hold safe in-range placeholders.
    """

    image: torch.Tensor  # (M,) long, image index in the batch
    anchor: torch.Tensor  # (M,) long, anchor index within the level
    gy: torch.Tensor  # (M,) long, grid row
    gx: torch.Tensor  # (M,) long, grid column
    target: torch.Tensor  # (M,) long, row of the target in the ``targets`` tensor
    tbox: torch.Tensor  # (M, 4) float, xy relative to the cell corner, wh in grid units
    tcls: torch.Tensor  # (M,) long, class
    anchor_wh: torch.Tensor  # (M, 2) float, anchor size in grid units
    valid: torch.Tensor  # (M,) bool


def smooth_bce_targets(eps: float = 0.0) -> tuple[float, float]:
    """Positive and negative class targets under label smoothing ``eps``."""
    return 1.0 - 0.5 * eps, 0.5 * eps


def bce_with_logits(
    logits: torch.Tensor, target: torch.Tensor, pos_weight: torch.Tensor, gamma: float = 0.0, alpha: float = 0.25
) -> torch.Tensor:
    """Element-wise BCE on logits with a positive weight; ``gamma`` > 0 applies focal modulation."""
    loss = F.binary_cross_entropy_with_logits(logits, target, pos_weight=pos_weight, reduction="none")
    if gamma > 0:
        p = logits.sigmoid()
        p_true = target * p + (1 - target) * (1 - p)
        alpha_factor = target * alpha + (1 - target) * (1 - alpha)
        loss = loss * alpha_factor * (1.0 - p_true) ** gamma
    return loss


class ComputeLoss:
    """Loss of a YOLO Detect head: ``loss, items = ComputeLoss(model, hyp)(preds, targets)``.

    ``hyp`` supplies the gains ``box``, ``obj``, ``cls``, the BCE positive weights ``cls_pw``, ``obj_pw``, the
    anchor matching threshold ``anchor_t`` and ``fl_gamma`` (focal loss when > 0). The gains are used as given:
    scaling them for the number of levels, classes and the image size (box *= 3/nl, cls *= nc/80 * 3/nl,
    obj *= (imgsz/640)**2 * 3/nl) is the training script's job and must happen before this is built.

    The returned loss is (mean box + mean obj + mean cls loss) * batch_size, as in YOLOv5. The box and class
    terms are means over positive assignments, the objectness term a mean over grid cells. Given ``norm`` (the
    counts of the whole global micro-batch, from ``positives`` summed over ranks), a rank's loss divides its own
    sums by those global counts: the ranks' losses then add up to the loss of the global micro-batch, and so do
    their gradients (train.py scales by the world size, as DDP averages). Without ``norm`` the counts are this
    call's own. ``items`` holds the three weighted terms, detached, for logging: summed over ranks they are the
    global micro-batch's means.

    Everything is computed in fp32, so predictions from an autocast (bf16/fp16) forward are safe.
    """

    gr = 1.0  # objectness target = (1 - gr) + gr * CIoU; 1.0 uses the CIoU itself
    item_names: tuple[str, ...] = ("box", "obj", "cls")
    timed_phases: tuple[str, ...] = ()  # no part of the call timed on its own: its whole is the step's forward
    marks: PhaseMarks = UNMARKED

    def __init__(self, model: nn.Module, hyp: Any, label_smoothing: float = 0.0) -> None:
        net: Any = de_parallel(model)  # a Model: its layers are untyped nn.Module attributes
        self.detect = cast(Detect, net.model[-1])  # read anchors at call time: they follow .to() and AutoAnchor
        self.nl: int = self.detect.nl
        self.na: int = self.detect.na
        self.nc: int = self.detect.nc
        self.hyp = hyp
        self.anchor_t = hyp.anchor_t
        self.fl_gamma = hyp.fl_gamma
        self.cls_pw = hyp.cls_pw
        self.obj_pw = hyp.obj_pw
        self.cls_positive, self.cls_negative = smooth_bce_targets(label_smoothing)
        self.balance = LEVEL_BALANCE.get(self.nl, LEVEL_BALANCE_FALLBACK[: self.nl])
        # Python numbers, read once: reading the device's stride tensor at every step would wait for the device.
        self.strides = [int(s) for s in self.detect.stride.tolist()]

    def prepare(self, targets: torch.Tensor, image_hw: tuple[int, ...]) -> list[LevelTargets]:
        """The target assignments of a batch of images of size ``image_hw``, before any forward pass."""
        grids = [(image_hw[0] // s, image_hw[1] // s) for s in self.strides]
        return self.build_targets(grids, targets.to(dtype=torch.float32))

    @staticmethod
    def counts(prepared: list[LevelTargets]) -> torch.Tensor:
        """(nl,) float: the positive assignments per level."""
        return torch.stack([lt.valid.sum() for lt in prepared]).float()

    def positives(self, targets: torch.Tensor, image_hw: tuple[int, int]) -> torch.Tensor:
        """(nl,) float: the positive assignments per level of ``targets`` in images of size ``image_hw``."""
        return self.counts(self.prepare(targets, image_hw))

    def set_epoch(self, epoch: int, epochs: int) -> None:
        """Nothing changes over the epochs."""

    def __call__(
        self,
        preds: list[torch.Tensor],
        targets: torch.Tensor,
        norm: LossNorm | None = None,
        prepared: list[LevelTargets] | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and its (box, obj, cls) items; ``prepared`` (from ``prepare``, same targets) saves redoing it.

        ``reduce`` is not needed: ``norm`` already carries the global counts this loss divides by.
        """
        preds = [p.float() for p in preds]
        device = preds[0].device
        targets = targets.to(device=device, dtype=torch.float32)
        local_images = preds[0].shape[0]
        batch_size = norm.images if norm is not None else local_images
        cls_pw = torch.full((1,), self.cls_pw, device=device)  # filled on the device: no host copy
        obj_pw = torch.full((1,), self.obj_pw, device=device)

        lbox = torch.zeros((), device=device)
        lobj = torch.zeros((), device=device)
        lcls = torch.zeros((), device=device)
        grids = [(p.shape[2], p.shape[3]) for p in preds]
        if prepared is None:
            prepared = self.build_targets(grids, targets)
        for level, (pi, lt) in enumerate(zip(preds, prepared)):
            tobj = torch.zeros(pi.shape[:4], device=device)
            if lt.valid.numel():
                weight = lt.valid.float()
                count = (norm.positives[level].to(device) if norm is not None else weight.sum()).clamp(min=1.0)
                ps = pi[lt.image, lt.anchor, lt.gy, lt.gx]  # (M, no)

                pxy = ps[:, :2].sigmoid() * 2 - 0.5
                pwh = (ps[:, 2:4].sigmoid() * 2) ** 2 * lt.anchor_wh
                ciou = bbox_ciou(torch.cat((pxy, pwh), 1), lt.tbox)
                lbox = lbox + ((1.0 - ciou) * weight).sum() / count

                # Several candidates can land on one (image, anchor, cell); the best overlap wins.
                score = (1.0 - self.gr) + self.gr * ciou.detach().clamp(min=0)
                _, na, ny, nx = tobj.shape
                flat = ((lt.image * na + lt.anchor) * ny + lt.gy) * nx + lt.gx
                tobj.view(-1).scatter_reduce_(0, flat, score * weight, reduce="amax", include_self=True)

                if self.nc > 1:  # a single class is learnt through objectness alone
                    tcls = torch.full_like(ps[:, 5:], self.cls_negative)
                    tcls.scatter_(1, lt.tcls[:, None], self.cls_positive)
                    cls_loss = bce_with_logits(ps[:, 5:], tcls, cls_pw, self.fl_gamma)
                    lcls = lcls + (cls_loss * weight[:, None]).sum() / (count * self.nc)

            # A mean over the global micro-batch's cells: this rank's sum over its cells / all cells.
            obj_loss = bce_with_logits(pi[..., 4], tobj, obj_pw, self.fl_gamma).sum() / (tobj[0].numel() * batch_size)
            lobj = lobj + obj_loss * self.balance[level]

        lbox = lbox * self.hyp.box
        lobj = lobj * self.hyp.obj
        lcls = lcls * self.hyp.cls
        return (lbox + lobj + lcls) * batch_size, torch.stack((lbox, lobj, lcls)).detach()

    @torch.no_grad()
    def build_targets(self, grids: list[tuple[int, int]], targets: torch.Tensor) -> list[LevelTargets]:
        """Assign each target (N, 6) [image, cls, x, y, w, h] to anchors and cells of every level's (ny, nx) grid.

        A target matches an anchor when max(r, 1/r) < anchor_t over both of r = target wh / anchor wh. Each
        match is assigned to the target's own cell and to the neighbour in x and in y on the side of the cell
        half the centre lies in (fraction < 0.5: the lower neighbour, otherwise the upper one), when that
        neighbour lies on the grid. The decoded centre range (-0.5, 1.5) reaches those neighbours.
        """
        device = targets.device
        nt = targets.shape[0]
        na = self.na
        anchors_all = self.detect.anchors.to(device=device, dtype=torch.float32)
        target_index = torch.arange(nt, device=device)
        image = targets[:, 0].long()
        tcls = targets[:, 1].long()

        result = []
        for level, (ny, nx) in enumerate(grids):
            anchors = anchors_all[level]  # (na, 2) grid units
            # Python scalars only: a small tensor made on the host and copied to CUDA would sync the stream.
            gxy = torch.stack((targets[:, 2] * nx, targets[:, 3] * ny), 1)  # (nt, 2) grid units
            gwh = torch.stack((targets[:, 4] * nx, targets[:, 5] * ny), 1)

            ratio = gwh[None] / anchors[:, None]  # (na, nt, 2)
            anchor_ok = torch.max(ratio, 1 / ratio).amax(2) < self.anchor_t  # (na, nt)

            cell = gxy.floor()
            cell = torch.stack((cell[:, 0].clamp(0, nx - 1), cell[:, 1].clamp(0, ny - 1)), 1)  # on the grid
            step = torch.where(gxy - cell < 0.5, -1.0, 1.0)  # towards the nearer neighbour, per axis
            neighbour = cell + step
            x_ok = (neighbour[:, 0] >= 0) & (neighbour[:, 0] <= nx - 1)
            y_ok = (neighbour[:, 1] >= 0) & (neighbour[:, 1] <= ny - 1)
            on_grid = torch.stack((x_ok, y_ok), 1)  # (nt, 2)
            neighbour = torch.where(on_grid, neighbour, cell)  # keep masked rows indexable

            # Cells of the 3 kinds (3, nt, 2) and whether each exists (3, nt).
            cells = torch.stack(
                (
                    cell,
                    torch.stack((neighbour[:, 0], cell[:, 1]), 1),
                    torch.stack((cell[:, 0], neighbour[:, 1]), 1),
                )
            )
            cell_ok = torch.stack((torch.ones_like(on_grid[:, 0]), on_grid[:, 0], on_grid[:, 1]))

            valid = cell_ok[:, None, :] & anchor_ok[None]  # (3, na, nt)
            shape = valid.shape
            cells = cells[:, None].expand(3, na, nt, 2)
            txy = gxy[None, None] - cells
            twh = gwh[None, None].expand(3, na, nt, 2)
            tbox = torch.cat((txy, twh), -1).reshape(-1, 4)
            valid = valid.reshape(-1)
            # Invalid rows get a harmless unit box so no inf/nan can reach the (masked) loss terms.
            tbox = torch.where(valid[:, None], tbox, 1.0)

            anchor_index = torch.arange(na, device=device)[None, :, None].expand(shape).reshape(-1)
            cells = cells.reshape(-1, 2).long()
            result.append(
                LevelTargets(
                    image=image[None, None].expand(shape).reshape(-1),
                    anchor=anchor_index,
                    gy=cells[:, 1],
                    gx=cells[:, 0],
                    target=target_index[None, None].expand(shape).reshape(-1),
                    tbox=tbox,
                    tcls=tcls[None, None].expand(shape).reshape(-1),
                    anchor_wh=anchors[anchor_index],
                    valid=valid,
                )
            )
        return result
