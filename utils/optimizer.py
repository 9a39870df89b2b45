"""The optimizer: which one the run at hand gets (the length of the schedule decides) and its parameter groups.

YOLOv5's SGD at lr0 0.01 is tuned for ~300-epoch runs on large datasets; over a few thousand optimizer
steps it learns slowly. Short runs get AdamW, whose per-parameter step sizes make progress from the first
iterations, at a learning rate that shrinks with the number of classes (more classes, noisier gradients of
the classification head): lr0 = 0.05 / (4 + nc), at most 0.01. The constant was chosen by training on the
built-in shapes set and checked on a held-out one (docs/benchmarks.md).

A short run also steps the optimizer after every batch instead of accumulating gradients up to YOLOv5's
nominal batch of 64 images: what limits it is the number of steps, not their noise (tests/test_recipe.py
trains both recipes side by side). An explicit ``--optimizer`` keeps YOLOv5's accumulation.

The choice is made once, when a run starts, and stored in its checkpoints (``optimizer_choice``): a resumed or
restarted run keeps its optimizer, lr0, momentum and accumulation whatever ``--epochs`` or ``--time`` say now
(another run length would pick another optimizer, whose state the saved one's is not).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from utils.errors import UserError
from utils.hyp import OptimisationHyp
from utils.log import LOGGER

NOMINAL_BATCH = 64  # YOLOv5's: gradients are accumulated up to this many images per optimizer step
# Below this many optimizer steps (at the nominal batch) a run counts as short.
SHORT_RUN_STEPS = 10_000
ADAMW_LR_PER_CLASS_TERM = 0.05  # lr0 = this / (4 + nc)
ADAMW_MAX_LR = 0.01


@dataclass(frozen=True)
class OptimizerChoice:
    name: str
    lr0: float
    momentum: float
    accumulate: int  # batches per optimizer step
    reason: str
    # The hyp keys this choice sets itself, whatever the hyp says (auto's AdamW: lr0 and momentum): --evolve does
    # not search them.
    hyp_keys_ignored: tuple[str, ...] = ()
    # The hyp file's weight decay scaled to the nominal batch (YOLOv5's); a family's recipe takes it as it is.
    scale_decay: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for the checkpoint."""
        return asdict(self)


def unused_hyp_values(choice: OptimizerChoice, hyp: OptimisationHyp) -> list[str]:
    """The hyp file's values that the choice replaced with its own (``auto``'s AdamW sets lr0 and momentum)."""
    return [
        f"{name} {getattr(hyp, name)}" for name in ("lr0", "momentum") if getattr(choice, name) != getattr(hyp, name)
    ]


def optimizer_steps(epochs: int, n_images: int, batch_size: int, accumulate: int) -> int:
    """Optimizer steps of a whole run: epochs x batches per epoch / accumulation."""
    return epochs * math.ceil(math.ceil(n_images / batch_size) / accumulate)


def choose_optimizer(
    requested: str,
    epochs: int,
    n_images: int,
    batch_size: int,
    nc: int,
    hyp: OptimisationHyp,
    lr_per_class_term: float = ADAMW_LR_PER_CLASS_TERM,
    recipe: str | None = None,
) -> OptimizerChoice:
    """The explicit --optimizer with the hyp file's lr0/momentum and YOLOv5's accumulation, or the automatic
    choice for ``auto``: the length of the run at the nominal batch decides. A short run's AdamW takes
    lr0 = ``lr_per_class_term`` / (4 + nc) (the model family's: ``Family.adamw_lr_per_class_term``).

    A family with a ``recipe`` optimizer (the DETRs' AdamW) gets it for ``auto`` whatever the run's length, at the
    hyp file's lr0 and momentum, a step every batch and the hyp file's weight decay unscaled, as its reference
    trains."""
    accumulate = max(round(NOMINAL_BATCH / batch_size), 1)
    steps = optimizer_steps(epochs, n_images, batch_size, accumulate)
    if requested == "auto" and recipe is not None:
        reason = f"auto: the model family's recipe: {recipe} at the hyp file's lr0, a step every batch"
        return OptimizerChoice(recipe, hyp.lr0, hyp.momentum, 1, reason, scale_decay=False)
    if requested != "auto":
        return OptimizerChoice(requested, hyp.lr0, hyp.momentum, accumulate, f"--optimizer {requested}")
    if steps > SHORT_RUN_STEPS:
        reason = f"auto: {steps} optimizer steps > {SHORT_RUN_STEPS}, a long run: SGD with the hyp file's lr0"
        return OptimizerChoice("SGD", hyp.lr0, hyp.momentum, accumulate, reason)
    lr0 = round(min(lr_per_class_term / (4 + nc), ADAMW_MAX_LR), 6)
    reason = (
        f"auto: {steps} optimizer steps <= {SHORT_RUN_STEPS}, a short run: AdamW, "
        f"lr0 = {lr_per_class_term:g} / (4 + nc), "
        f"a step every batch ({optimizer_steps(epochs, n_images, batch_size, 1)} steps)"
    )
    return OptimizerChoice("AdamW", lr0, 0.9, 1, reason, ("lr0", "momentum"))


def resumed_choice(
    saved: dict[str, Any] | None,
    saved_opt: dict[str, Any],
    n_images: int,
    nc: int,
    hyp: OptimisationHyp,
    optimizer_state: dict[str, Any],
) -> OptimizerChoice:
    """The choice a resumed run was trained with: the checkpoint's own, or for a checkpoint written before it was
    stored, the choice its start made (its saved options: --optimizer, --epochs, --batch-size).

    A derived choice that does not fit the saved optimizer state (a --time run whose epochs changed on the way)
    is a one-line error, not a crash at the first step.
    """
    if saved:
        return OptimizerChoice(**{**saved, "reason": f"the run's own, kept from its checkpoint ({saved['reason']})"})
    choice = choose_optimizer(
        saved_opt.get("optimizer", "auto"), int(saved_opt["epochs"]), n_images, int(saved_opt["batch_size"]), nc, hyp
    )
    groups = optimizer_state.get("param_groups") or [{}]
    adam_state = "betas" in groups[0]
    if adam_state != (choice.name in ("Adam", "AdamW")):
        raise UserError(
            f"the checkpoint does not say which optimizer it was trained with and its optimizer state "
            f"does not fit {choice.name} (derived from its saved options): resume it with the "
            f"project version that wrote it, or fine-tune from it with --weights"
        )
    return OptimizerChoice(
        choice.name,
        choice.lr0,
        choice.momentum,
        choice.accumulate,
        f"the run's own, derived from its saved options ({choice.reason})",
    )


def parameter_groups(model: nn.Module) -> tuple[list, list, list]:
    """Split parameters into (weights with decay, normalisation weights without decay, biases without decay)."""
    decay, norm_weights, biases = [], [], []
    norm_types = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias":
                biases.append(p)
            elif isinstance(module, norm_types):
                norm_weights.append(p)
            else:
                decay.append(p)
    return decay, norm_weights, biases


def build_optimizer(
    model: nn.Module,
    name: str = "SGD",
    lr: float = 0.01,
    momentum: float = 0.937,
    decay: float = 5e-4,
    groups: list[dict[str, Any]] | None = None,
) -> torch.optim.Optimizer:
    """SGD (Nesterov), Adam or AdamW over ``groups`` (a model family's ``parameter_groups``; by default YOLO's
    three: biases, then conv/linear weights with ``decay``, then norm weights). Settings a group leaves out take
    the optimizer's defaults: no weight decay, ``lr``, ``momentum``."""
    if groups is None:
        weights, norm_weights, biases = parameter_groups(model)
        groups = [
            {"params": biases},
            {"params": weights, "weight_decay": decay},
            {"params": norm_weights, "weight_decay": 0.0},
        ]
    # One fused kernel per step instead of a dozen small ops per tensor.
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    groups = [{**g, "lr": lr * g["lr_scale"]} if "lr_scale" in g else g for g in groups]
    first, rest = groups[0], groups[1:]
    optimizer: torch.optim.Optimizer
    if name == "Adam":
        optimizer = torch.optim.Adam([first], lr=lr, betas=(momentum, 0.999), fused=fused)
    elif name == "AdamW":
        optimizer = torch.optim.AdamW([first], lr=lr, betas=(momentum, 0.999), weight_decay=0.0, fused=fused)
    elif name == "SGD":
        optimizer = torch.optim.SGD([first], lr=lr, momentum=momentum, nesterov=True, fused=fused)
    else:
        raise UserError(f"--optimizer {name} is not known: use SGD, Adam or AdamW")
    for group in rest:
        optimizer.add_param_group(group)
    sizes = ", ".join(str(len(g["params"])) for g in optimizer.param_groups)
    decays = ", ".join(f"{g['weight_decay']:g}" for g in optimizer.param_groups)
    LOGGER.info(f"optimizer: {name}(lr={lr}) with parameter groups of {sizes} tensors (weight decay {decays})")
    return optimizer
