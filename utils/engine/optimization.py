"""What updates the weights: the optimizer (utils/optimizer.py chooses it), its learning-rate schedule and warmup,
the gradient scaler and the EMA; made once per run, restored on resume, refitted by a time budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from models.families import Family
from utils.checkpoint import restore_training_state
from utils.distributed import de_parallel
from utils.ema import ModelEMA
from utils.engine.config import TrainConfig, stored_config
from utils.engine.lr_schedule import FlatCosine, LrSchedule, apply_warmup, warmup_iterations
from utils.hyp import OptimisationHyp, StepScheduleHyp
from utils.log import LOGGER
from utils.optimizer import (
    NOMINAL_BATCH,
    OptimizerChoice,
    build_optimizer,
    choose_optimizer,
    resumed_choice,
    unused_hyp_values,
)


@dataclass
class Optimization:
    """The optimizer and what steers it. ``scheduler`` is made once the start epoch is known (``start_schedule``)."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: ModelEMA
    schedule: LrSchedule
    choice: OptimizerChoice
    hyp: OptimisationHyp
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    n_warmup: int = 0  # warmup iterations (batches)
    clip_norm: float = 10.0  # gradients clipped to this total norm
    step_schedule: FlatCosine | None = None  # a recipe's rate at every step (StepScheduleHyp), made at the start

    @property
    def recipe(self) -> StepScheduleHyp | None:
        """The hyp's step schedule, clipping, EMA and stage settings, where its record has them."""
        return self.hyp if isinstance(self.hyp, StepScheduleHyp) else None

    @property
    def accumulate(self) -> int:
        return self.choice.accumulate

    def start_schedule(
        self, start_epoch: int, batches_per_epoch: int, epochs: int = 0, stage: int | None = None
    ) -> None:
        """The scheduler, made at ``start_epoch - 1`` and stepped once on creation, sets this epoch's rates (a fresh
        LambdaLR would restart a resumed run at lr0 * schedule(0)); the warmup length in batches. A recipe's step
        schedule (``recipe``) is made for the run's ``epochs`` and ``stage`` epoch, and sets the rates itself."""
        if self.recipe is not None:  # its rate is set at every step: the per-epoch schedule stays at 1
            self.schedule = LrSchedule.for_run(max(epochs, 1), 1.0, self.schedule.cosine)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda=self.schedule, last_epoch=start_epoch - 1
        )
        self.n_warmup = warmup_iterations(self.hyp.warmup_epochs, batches_per_epoch)
        if self.recipe is not None:
            self.step_schedule = FlatCosine(self.recipe, self.hyp.lrf, epochs, batches_per_epoch, stage)
            self.n_warmup = 0

    def warm_up(self, iteration: int, epoch: int) -> None:
        """The rates of the step ending at batch ``iteration`` (of the run): a recipe's step schedule at every step;
        else during warmup, ramp the learning rates and the momentum."""
        if self.step_schedule is not None:
            self.step_schedule.apply(self.optimizer, iteration)
        elif iteration <= self.n_warmup:
            apply_warmup(self.optimizer, iteration, self.n_warmup, self.schedule(epoch), self.hyp, self.choice.momentum)

    def learning_rates(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def refit(self, epochs: int, stage: int | None = None) -> None:
        """A new run length (a time budget): the schedule from epoch 0 to ``epochs``, the next epoch's rates set."""
        if self.step_schedule is not None:
            self.step_schedule.refit(epochs, stage)
        lrf = 1.0 if self.step_schedule is not None else self.hyp.lrf
        self.schedule = LrSchedule.for_run(epochs, lrf, self.schedule.cosine)
        assert self.scheduler is not None, "refit before start_schedule"
        self.scheduler.lr_lambdas = [self.schedule] * len(self.scheduler.lr_lambdas)
        for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs):  # the next epoch's
            group["lr"] = base_lr * self.schedule(self.scheduler.last_epoch)

    def step(self, model: nn.Module) -> torch.Tensor | None:
        """Clip, step, update the EMA; returns whether the gradients were finite, as a 0-d bool tensor on the
        device, and where they were not the optimizer and the EMA stood still.

        The decision stays on the device: a fused optimizer (utils/optimizer.py) skips its update itself when told
        through ``found_inf``, as it does for the gradient scaler, so the host never waits for the backward pass
        to end. Another optimizer is asked on the host (one wait). The gradients are all-reduced, so every rank
        makes the same decision. With a gradient scaler (fp16) the scaler skips overflowing steps itself, as it
        should early in training; those are not counted (None).
        """
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=self.clip_norm)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
            self.ema.update(model)
            return None
        finite = torch.isfinite(norm)
        if all(group.get("fused") for group in self.optimizer.param_groups):
            optimizer: Any = self.optimizer  # found_inf: an attribute torch's fused kernels read, untyped
            optimizer.found_inf = (~finite).float()  # as GradScaler sets it
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            self.ema.update(model, keep=finite)
        elif bool(finite):
            self.optimizer.step()
            self.ema.update(model)
        self.optimizer.zero_grad()
        return finite


@dataclass(frozen=True)
class OptimizerInputs:
    """What the optimizer's choice depends on besides the configuration."""

    n_images: int
    nc: int
    hyp: OptimisationHyp
    adamw_lr_per_class_term: float  # the family's (utils/optimizer.py)
    recipe_optimizer: str | None = None  # the family's optimizer whatever the run's length (utils/optimizer.py)


def choose(config: TrainConfig, inputs: OptimizerInputs, ckpt: dict[str, Any] | None) -> OptimizerChoice:
    """The run's optimizer: a resumed run's own choice, whatever the length asked now; else chosen for this run."""
    if ckpt:
        choice = resumed_choice(
            ckpt.get("optimizer_choice"),
            stored_config(ckpt, "checkpoint"),
            inputs.n_images,
            inputs.nc,
            inputs.hyp,
            ckpt["optimizer"],
        )
    else:
        choice = choose_optimizer(
            config.optimizer,
            config.epochs,
            inputs.n_images,
            config.batch_size,
            inputs.nc,
            inputs.hyp,
            inputs.adamw_lr_per_class_term,
            inputs.recipe_optimizer,
        )
    LOGGER.info(
        f"optimizer: {choice.name} lr0={choice.lr0} momentum={choice.momentum} accumulate={choice.accumulate} "
        f"({choice.reason})"
    )
    if unused := unused_hyp_values(choice, inputs.hyp):
        LOGGER.info(f"optimizer: the hyp file's {' and '.join(unused)} not used ({choice.name}'s own instead)")
    return choice


def build_optimization(
    model: nn.Module,
    family: Family,
    config: TrainConfig,
    choice: OptimizerChoice,
    hyp: OptimisationHyp,
    needs_scaler: bool,
) -> Optimization:
    """The optimizer over the family's parameter groups of ``model``, the run's schedule, the EMA and the gradient
    scaler."""
    decay = hyp.weight_decay
    if choice.scale_decay:  # YOLOv5's: the decay per nominal batch of 64 images
        decay *= config.batch_size * choice.accumulate / NOMINAL_BATCH
    groups = family.parameter_groups(model, decay, hyp=hyp)
    optimizer = build_optimizer(model, choice.name, choice.lr0, choice.momentum, decay, groups=groups)
    recipe = hyp if isinstance(hyp, StepScheduleHyp) else None
    # A recipe's rate is set at every step (FlatCosine): the per-epoch schedule stays at 1.
    schedule = LrSchedule.for_run(config.epochs, 1.0 if recipe else hyp.lrf, config.cos_lr)
    # On every rank: each validates its part with the same EMA weights.
    ema = ModelEMA(model, recipe.ema_decay, recipe.ema_tau) if recipe else ModelEMA(model)
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=needs_scaler)
    # The losses are summed over the global batch's images (the contract's scale), a recipe's clip norm is for the
    # references' loss, a mean over them: it scales with the images of an optimizer step.
    clip = recipe.clip_norm * config.batch_size * choice.accumulate if recipe else 10.0
    return Optimization(optimizer, scaler, ema, schedule, choice, hyp, clip_norm=clip)


def reload(optim: Optimization, model: nn.Module, ckpt: dict[str, Any]) -> None:
    """A training checkpoint's weights, EMA (with its update count), optimizer and scaler state into the run's live
    ones, in place; not its RNG state: the run's own draws go on."""
    de_parallel(model).load_state_dict(ckpt["model"])
    if ckpt.get("optimizer") is None:  # a finished run's best.pt (stripped at its end), resumed for more epochs
        LOGGER.info("the reloaded checkpoint has no optimizer state (stripped at the run's end): the run's is kept")
        optim.ema.ema.load_state_dict(ckpt["ema"])
        optim.ema.updates = int(ckpt["updates"])
        return
    restore_training_state({**ckpt, "torch_rng": None}, optim.optimizer, optim.scaler, optim.ema)


def restore(optim: Optimization, ckpt: dict[str, Any]) -> None:
    """Load a training checkpoint's optimizer, scaler, EMA and RNG state."""
    restore_training_state(ckpt, optim.optimizer, optim.scaler, optim.ema)
