"""One training run, stage by stage: its parts (setup.py), the optimizer (optimization.py), the epochs
(epoch.py), what follows each epoch (validation, the record, the decisions all ranks take together) and the final
validation of the best weights."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from utils.checkpoint import RunPosition, load_checkpoint, model_weights, strip_training_state, training_checkpoint
from utils.data.image_weights import (
    class_weights_from_maps,
    draw_digest,
    labels_to_class_weights,
    labels_to_image_weights,
)
from utils.data.loader import end_workers
from utils.distributed import DistInfo, broadcast_object, collective, rank_zero_decides
from utils.engine.config import CONFIG_SCHEMA, TrainConfig
from utils.engine.epoch import EpochHooks, train_one_epoch
from utils.engine.interrupt import STOP, Interrupted, stop_on_signals
from utils.engine.optimization import Optimization, OptimizerInputs, build_optimization, choose, reload, restore
from utils.engine.parallel import compile_forward, share_buffers, wrap_ddp
from utils.engine.phases import PhaseClock
from utils.engine.resume import Resumed, ResumePosition, resumed_position
from utils.engine.run_record import RunRecord
from utils.engine.run_upload import remove_staging
from utils.engine.setup import RunSetup, set_up
from utils.engine.step import BatchOptions, SavePolicy, Stepper
from utils.engine.tally import LossTally
from utils.engine.time_budget import TimeBudget, fit_to_time, time_budget
from utils.engine.timing import (
    EpochTime,
    RunProgress,
    RunTime,
    StepProfiler,
    data_advice,
    new_marks,
    step_phases,
    time_columns,
)
from utils.errors import UserError
from utils.hyp import HypRecord, OptimisationHyp
from utils.log import LOGGER, colorstr
from utils.metrics import RECALL_POINTS
from utils.results_log import result_columns
from utils.storage import join
from utils.trackers import FAILED, KILLED, TrackerRun, check_trackers, open_trackers, plot_files, run_params
from utils.trackers import preload as preload_trackers
from utils.validation import (
    CONF_THRES,
    MAX_DET,
    OutputOptions,
    PredictOptions,
    ValOptions,
    ValResults,
    validate,
)

# Called on rank 0 after each validated epoch with its results; True stops the run (a search's pruner).
OnValidated = Callable[[int, tuple[float, ...]], bool]


@dataclass
class TrainResult:
    save_dir: Path
    results: tuple[float, ...]  # the last validation's P, R, mAP50, mAP50-95 and validation losses


def train(
    config: TrainConfig,
    device: torch.device,
    info: DistInfo,
    resumed: Resumed | None = None,
    hyp: HypRecord | None = None,
    process_started: float | None = None,
    on_validated: OnValidated | None = None,
    clock: PhaseClock | None = None,
) -> TrainResult:
    """One training run. ``hyp`` (a search's trial) replaces reading --hyp; ``process_started`` (the monotonic
    clock at the process start) is where a budget that includes start-up counts from; ``on_validated`` may stop
    the run after a validated epoch (rank 0 decides); ``clock`` stamps the run's phases on the log."""
    clock = clock or PhaseClock(process_started)
    check_trackers(config.loggers)  # a resumed run's own, on every rank: a missing package stops all of them
    if info.is_main:
        preload_trackers(config.loggers)  # their packages load while the data and the model are made
    run = set_up(config, device, info, resumed, hyp, clock)
    try:
        trainer = Trainer(run, resumed, device, info, process_started, clock)
        trainer.on_validated = on_validated
        try:
            with stop_on_signals():
                epoch = trainer.train_epochs()
                if trainer.stepper.stopped:
                    raise trainer.interrupted()
            return trainer.finish(epoch)
        except BaseException as e:
            trainer.stop_reporting(KILLED if isinstance(e, (KeyboardInterrupt, Interrupted)) else FAILED)
            raise
    finally:
        end_staging(run)


def end_staging(run: RunSetup) -> None:
    """A run folder on object storage: what is not uploaded yet is tried once more (a run that finished has sent
    everything already), then the local staging folder is removed."""
    if run.upload is not None:
        run.upload.close(finished=False)
    if run.staging:
        remove_staging(run.save_dir)


class Trainer:
    """A run's state between its setup and its end; rank 0 keeps the record (results.csv, checkpoints)."""

    def __init__(
        self,
        run: RunSetup,
        resumed: Resumed | None,
        device: torch.device,
        info: DistInfo,
        process_started: float | None = None,
        clock: PhaseClock | None = None,
    ) -> None:
        self.run, self.config, self.info, self.device = run, run.config, info, device
        self.process_started = process_started
        self.clock = clock or PhaseClock(process_started)
        ckpt = resumed.ckpt if resumed else None
        self.optim, self.position, best = start_optimization(run, ckpt, len(run.family.loss_names))
        model = compile_forward(wrap_ddp(run.model, device) if info.is_distributed else run.model, self.config.compile)
        loss = run.family.make_loss(
            model, run.hyp, imgsz=self.config.imgsz, label_smoothing=self.config.label_smoothing
        )
        # The loss's own terms: the family's loss_names, or where the hyp chooses another term (a DETR's DEIM
        # classification loss, mal, in the varifocal loss's place) that name in the columns and the log.
        self.loss_names = tuple(loss.item_names)
        batch = BatchOptions(self.config.seed, self.config.imgsz, run.grid, self.config.multi_scale, self.config.quad)
        self.stepper = Stepper(
            model,
            run.family,
            loss,
            self.optim,
            run.precision,
            device,
            info,
            batch,
            len(self.loss_names),
            log_interval=self.config.log_interval,
            marks=new_marks(device),
        )
        times = time_columns(step_phases(loss.timed_phases))
        self.columns = (*result_columns(self.loss_names, len(self.optim.optimizer.param_groups)), *times)
        self.run_time = RunTime()
        self.on_validated: OnValidated | None = None
        self.profiler: StepProfiler | None = None
        # --image-weights: the class weights of the next epoch's draw (on every rank; rank 0 updates them).
        self.base_class_weights = labels_to_class_weights(run.dataset.labels, run.nc)
        self.class_weights = (
            np.array(ckpt["class_weights"])
            if ckpt and ckpt.get("class_weights") is not None
            else self.base_class_weights
        )
        self.results: tuple[float, ...] = (0.0,) * (4 + len(self.loss_names))
        self.last_val: ValResults | None = None  # the last validation's
        self.record: RunRecord | None = None
        self.hooks = EpochHooks(
            self.config.epochs,
            self.config.batch_size,
            self.loss_names,
            SavePolicy(self.config.save_steps, self.config.save_minutes),
        )
        # The workers start now, at the batch training begins with, and prepare it while the rest is set up.
        start_stream = getattr(run.train_loader, "start", None)
        if start_stream is not None:
            start_stream(self.position.start_epoch, self.position.start_batch)
        if info.is_main:
            self.start_record(best, ckpt)

    # ---- rank 0's record ---------------------------------------------------------------------------------

    def start_record(self, best: tuple[float, int], ckpt: dict | None) -> None:
        """results.csv and the checkpoints from the epoch training starts in (its own row, written before a kill
        inside it, goes: the epoch is trained again), the trackers, the progress line and --profile."""
        config, run, first_run = self.config, self.run, ckpt is None
        self.record = RunRecord(
            run.save_dir,
            self.columns,
            patience=config.patience,
            noval=config.noval,
            nosave=config.nosave,
            save_period=config.save_period,
            best_fitness=best[0],
            best_epoch=best[1],
            start_epoch=self.position.start_epoch,
            clock=self.clock,
        )
        if run.upload is not None:
            self.record.upload_to(run.upload)
            run.upload.start()
        tracked = TrackerRun(
            run.save_dir,
            config.loggers,
            resumed=not first_run or self.info.restart_count > 0,
            saved=ckpt.get("trackers") if ckpt else None,
        )
        self.hooks.logger = open_trackers(tracked, True)
        self.hooks.logger.log_params(run_params(config.to_dict(), run.hyp.to_dict()))
        self.hooks.save_mid_epoch = self.save_mid_epoch
        self.hooks.progress = RunProgress(config.epochs)
        if config.profile > 0:
            self.profiler = StepProfiler(config.profile, run.save_dir / "profile.json", self.device)
        if first_run and not config.noplots:
            from utils.plots import plot_labels

            plot_labels(
                np.concatenate([lb for lb in run.dataset.labels if len(lb)] or [np.zeros((0, 5))]),
                run.names,
                run.save_dir,
            )

    def checkpoint(self, epoch: int, mid_epoch: dict | None) -> dict:
        """Everything a resume needs, after ``epoch`` (and inside the next one with ``mid_epoch``)."""
        assert self.record is not None, "only rank 0 keeps the record"
        position = RunPosition(epoch, mid_epoch, self.record.best_fitness, self.record.best_epoch)
        run = {
            "lr_schedule": self.optim.schedule.segments,
            "optimizer_choice": self.optim.choice.to_dict(),
            "config": self.config.to_dict(),
            "config_schema": CONFIG_SCHEMA,
            "hyp": self.run.hyp.to_dict(),
            "world_size": self.info.world_size,
            "run_id": self.info.run_id,
            "trackers": self.hooks.logger.state(),
            # The weights of the epoch after `epoch` (the one a resume draws next), set before this is called.
            "class_weights": [float(w) for w in self.class_weights] if self.config.image_weights else None,
        }
        return training_checkpoint(
            self.stepper.model, self.optim.ema, self.optim.optimizer, self.optim.scaler, position, run
        )

    def save_mid_epoch(self, epoch: int, batch: int, tally: LossTally) -> None:
        assert self.record is not None, "only rank 0 keeps the record"
        self.record.save_mid_epoch(self.checkpoint(epoch - 1, {"epoch": epoch, "batch": batch, **tally.state()}))

    # ---- the epochs --------------------------------------------------------------------------------------

    def train_epochs(self) -> int:
        """Train until the run's length, early stopping or the time budget ends it; returns the last epoch."""
        config, run = self.config, self.run
        workers = getattr(run.train_loader, "loader", run.train_loader).num_workers  # --workers capped by cores
        self.loader_workers = workers
        LOGGER.info(
            f"Image sizes {config.imgsz} train, {config.imgsz} val; {workers} dataloader workers per rank; "
            f"logging to {colorstr(str(run.save_dir))}\nStarting training for {config.epochs} epochs..."
        )
        self.loop_started = time.monotonic()
        budget = time_budget(config, self.process_started or self.loop_started, self.loop_started)
        start, epoch, tally = self.position.start_epoch, self.position.start_epoch, self.position.tally
        self.hooks.after_step = FirstStepStamp(self.clock, self.profiler.step if self.profiler else None)
        self.clock.stamp("set-up before the first epoch")
        # On an error, the checkpoint being written in the background is finished first (rank 0 writes them).
        with self.record.kept_on_error() if self.record is not None else contextlib.nullcontext():
            for epoch in itertools.count(start):  # a time budget may change the run's length on the way
                t_epoch = time.monotonic()
                self.draw_images(epoch)
                self.stepper.loss.set_epoch(epoch, self.config.epochs)
                self.hooks.epochs = self.config.epochs
                if self.hooks.progress is not None:
                    self.hooks.progress.epochs = self.config.epochs
                self.hooks.plots_dir = (
                    run.save_dir if epoch == start and self.info.is_main and not config.noplots else None
                )
                start_batch = self.position.start_batch if epoch == start else 0
                self.start_stage(epoch, start_batch)
                loader = FirstBatchStamp(run.train_loader, self.clock) if epoch == start else run.train_loader
                tally, timing = train_one_epoch(self.stepper, loader, epoch, start_batch, tally, self.hooks)
                self.clock.stamp(f"epoch {epoch} steps")
                self.run_time.add(timing)
                if self.stepper.stopped == "inside":  # its checkpoint is written: no validation, no row
                    break
                decision = self.end_epoch(epoch, tally, budget, t_epoch, timing)
                if self.hooks.progress is not None:
                    self.hooks.progress.epoch_seconds.append(time.monotonic() - t_epoch)
                if decision.get("stop") or epoch + 1 >= self.config.epochs:
                    self.stepper.stopped = ""  # the run ends here anyway: it finishes as usual
                    break
                if self.stepper.stopped:
                    break
                tally = LossTally(len(self.loss_names))
        end_stream = getattr(run.train_loader, "close", None)
        if end_stream is not None:  # no batches of an epoch that will not run
            end_stream()
        return epoch

    def draw_images(self, epoch: int) -> None:
        """--image-weights: the epoch's weighted draw, checked to be the same on every rank."""
        if not self.config.image_weights:
            return
        loader = self.run.train_loader
        loader.set_image_weights(labels_to_image_weights(self.run.dataset.labels, self.class_weights))
        check_same_draw(self.info, loader.sampler.global_draw(epoch), epoch, self.device)

    def end_epoch(
        self, epoch: int, tally: LossTally, budget: TimeBudget | None, t_epoch: float, timing: EpochTime
    ) -> dict:
        """Validation, the record, and what every rank decides together: stop, refit the length, class weights."""
        config, optim = self.config, self.optim
        lrs = optim.learning_rates()  # the epoch's own rates, for results.csv
        assert optim.scheduler is not None, "the schedule starts before the first epoch"
        optim.scheduler.step()
        final = epoch + 1 == config.epochs
        validated = not config.noval or final
        optim.ema.update_attributes(self.stepper.model)
        if validated:
            share_buffers(optim.ema.ema, self.info)  # every rank validates the EMA rank 0 saves
            self.last_val = self.validate(optim.ema.ema, plots=final and not config.noplots, verbose=final)
            self.results = self.last_val.as_row()
            self.clock.stamp(f"epoch {epoch} validation")
        decision: dict = {}
        if self.info.is_main:
            assert self.record is not None, "only rank 0 keeps the record"
            if config.image_weights and validated:
                assert self.last_val is not None  # validated above
                self.class_weights = class_weights_from_maps(self.base_class_weights, self.last_val.maps)
                decision["class_weights"] = [float(w) for w in self.class_weights]  # repr round-trips exactly
            row = self.record.end_epoch(
                epoch,
                tally.means(),
                self.results if validated else None,
                lrs,
                self.checkpoint(epoch, None),
                final,
                extra=timing.row(),
            )
            self.clock.stamp(f"epoch {epoch} record (checkpoint handed to the writer)")
            decision["stop"] = self.record.should_stop()
            self.hooks.logger.log_epoch(epoch, dict(zip(self.columns[1:], row[1:])))
            if self.run.upload is not None:  # results.csv and the rest, in the upload's thread
                self.run.upload.request()
            if validated and self.on_validated is not None and self.on_validated(epoch, self.results):
                decision["stop"] = True
            if budget is not None:
                decision.update(
                    fit_to_time(
                        budget, epoch, self.position.start_epoch, time.monotonic(), time.monotonic() - t_epoch, config
                    )
                )
        decision = json.loads(rank_zero_decides(self.info, json.dumps(decision)))  # the others wait on the store
        if decision.get("class_weights") is not None:
            self.class_weights = np.array(decision["class_weights"], dtype=np.float64)
        if decision.get("epochs"):
            self.refit(decision["epochs"])
        return decision

    def refit(self, epochs: int) -> None:
        """A time budget's run length: the schedule, the stage (close-mosaic) epoch and the mosaic window follow it."""
        self.config = self.config.replace(epochs=epochs)
        stage = self.stage_epoch()
        self.optim.refit(epochs, stage)
        window = self.run.family.mosaic_epochs(epochs, self.run.hyp)
        self.run.train_loader.update_dataset(close_mosaic_epoch=stage, mosaic_epochs=window)

    def stage_epoch(self) -> int | None:
        """The epoch from which the run trains without its strongest augmentation (the family's rule)."""
        return self.run.family.stage_epoch(self.config.epochs, self.config.close_mosaic, self.run.hyp)

    def start_stage(self, epoch: int, start_batch: int) -> None:
        """At the stage epoch's first batch, where the recipe asks (``Optimization.recipe``), the run goes on from
        stage 1's best epoch, as the official trainers reload their best_stg1: weights/best.pt's weights, EMA (with
        its update count), optimizer and scaler state, rank 0's file on every rank. Then, with the recipe's
        ``stage_ema_restart`` (the default), the EMA starts again from those weights, its decay's ramp from its
        beginning, so that the stage's weights are averaged over the stage alone; the official trainers mean to
        refresh it there ("Refresh EMA") but change a decay their ramp does not read, so theirs goes on
        (``stage_ema_restart: 0``). Where no epoch of stage 1 was validated, or none saved, the EMA starts again
        from the model's weights. A run resumed inside the stage has all of it in its checkpoint; one resumed at
        the stage's first batch reloads the same best.pt."""
        recipe = self.optim.recipe
        if recipe is None or start_batch != 0 or epoch != self.stage_epoch():
            return
        best = broadcast_object(self.record.best_checkpoint() if self.record is not None else None, self.info)
        if best is None:
            self.optim.ema.restart(self.stepper.model)
            LOGGER.info(
                f"epoch {epoch}: the no-augmentation stage begins; no best epoch of stage 1 to reload (none validated "
                "or saved): the EMA starts again from the model"
            )
            return
        reload(self.optim, self.stepper.model, best)
        restart = recipe.stage_ema_restart > 0
        if restart:
            self.optim.ema.restart(self.stepper.model)
        LOGGER.info(
            f"epoch {epoch}: the no-augmentation stage begins from stage 1's best epoch, {best['epoch']} "
            "(weights/best.pt): its weights and optimizer state, "
            + ("the EMA started again from its weights" if restart else "its EMA going on (stage_ema_restart: 0)")
        )

    def validate(self, model: torch.nn.Module, plots: bool, verbose: bool) -> Any:
        """Every rank validates its part of the split; the results are gathered, so every rank has the figures."""
        run = self.run
        outputs = OutputOptions(
            save_dir=run.save_dir, plots=plots, verbose=verbose and run.nc < 50, main=self.info.is_main
        )
        options = ValOptions(
            names=run.names,
            device=self.device,
            compute_loss=self.stepper.loss,
            family=run.family,
            predict=PredictOptions(conf_thres=CONF_THRES, max_det=MAX_DET, autocast_dtype=run.precision.dtype),
            outputs=outputs,
            gather=self.info.is_distributed,
        )
        return validate(model, run.val_loader, options)

    # ---- the end -----------------------------------------------------------------------------------------

    def finish(self, epoch: int) -> TrainResult:
        """The final record and, when the last epoch's report was not for the best weights, their validation."""
        run, info = self.run, self.info
        run.train_loader = None  # ends the training workers before the last validation
        best = None
        if info.is_main:
            LOGGER.info(
                f"\n{epoch - self.position.start_epoch + 1} epochs completed in "
                f"{(time.monotonic() - self.loop_started) / 3600:.3f} hours."
            )
            assert self.record is not None, "only rank 0 keeps the record"
            self.record.close()
            self.record.mark_finished()
            self.clock.stamp("checkpoints written")
            strip_training_state(self.record.best)
            if self.record.best.exists() and self.record.best_epoch != epoch:
                best_ckpt = load_checkpoint(self.record.best)
                best = (best_ckpt["model_cfg"], model_weights(best_ckpt))
                LOGGER.info(f"\nValidating {self.record.best} (epoch {self.record.best_epoch})...")
        best = broadcast_object(best, info)  # every rank validates its part of the split with rank 0's best weights
        if best is not None:
            final_model = run.family.build_model(best[0], weights=best[1], names=run.names)
            self.last_val = self.validate(
                final_model.to(self.device, memory_format=torch.channels_last),  # type: ignore[call-overload]  # a keyword torch's stubs lack
                plots=not self.config.noplots,
                verbose=True,
            )
            self.results = self.last_val.as_row()
            self.clock.stamp("final validation")
        if info.is_main:
            self.report_time()
            r = self.last_val
            if r is not None and r.class_metrics is not None and len(r.class_metrics.pr_curve):
                self.hooks.logger.log_pr_curve(r.class_metrics.pr_curve.mean(0), RECALL_POINTS, epoch)
            if not self.config.noplots:
                from utils.plots import plot_results

                try:
                    plot_results(run.save_dir / "results.csv")
                except UserError as e:  # a chart is not worth the end of the run: its checkpoints are written
                    LOGGER.warning(f"WARNING results.png not drawn: {e}")
            logger = self.hooks.logger
            logger.log_images(plot_files(run.save_dir), epoch)
            assert self.record is not None, "only rank 0 keeps the record"
            logger.log_artifacts([self.record.best, self.record.last, run.save_dir / "results.csv"])
            self.clock.stamp("plots and artifacts")
            logger.close()
            self.clock.stamp("tracker close")
            if run.upload is not None:  # every file the run wrote, as it is now (best.pt stripped)
                run.upload.close(finished=True)
                self.clock.stamp("run folder uploaded")
            LOGGER.info(f"Results saved to {colorstr(str(self.config.save_dir))}")
        end_workers(run.val_loader)
        self.clock.stamp("validation workers ended")
        return TrainResult(run.save_dir, self.results)

    def report_time(self) -> None:
        """Where the step time of this process's epochs went, and one line of advice when data loading held them up."""
        if self.profiler is not None:
            self.profiler.stop()
        summary = self.run_time.summary()
        if summary is None:
            return
        epochs = len(self.run_time.epochs)
        LOGGER.info(f"Time over {epochs} epoch{'s' * (epochs != 1)}: {summary.describe()}")
        cores = len(os.sched_getaffinity(0)) // max(self.info.local_world_size, 1)
        advice = data_advice(summary.shares(), self.loader_workers, max(cores, 1))
        if advice:
            LOGGER.info(advice)

    def interrupted(self) -> Interrupted:
        """The run stopped on a signal: its checkpoint written (rank 0 waits for the writer), the command that
        resumes it."""
        self.run.train_loader = None  # ends the training workers, as at a run's end
        last: Path | str = self.run.save_dir / "weights" / "last.pt"
        if self.record is not None:
            self.record.close()
            last = self.record.last
        if self.run.staging:  # the run folder is a URL; the local staging folder is removed at the end
            last = join(str(self.config.save_dir), "weights/last.pt")
        launcher = (
            f"python -m torch.distributed.run --nproc_per_node {self.info.local_world_size} "
            if self.info.is_distributed
            else "python "
        )
        return Interrupted(self.stop_signal(), f"{launcher}train.py --resume {last}")

    def stop_signal(self) -> int:
        """The signal that stopped the run, the same on every rank: a scheduler may signal one process only, and the
        others stopped on its wish (at the same read-back). Under DDP a collective, after rank 0's checkpoint is
        written: no rank exits before it, since a launcher ends the other workers when one exits."""
        asked = STOP.signum or 0
        if self.info.is_distributed:
            signals = torch.tensor([asked], dtype=torch.int32, device=self.device)
            with collective("the stop's signal"):
                dist.all_reduce(signals, op=dist.ReduceOp.MAX)
            asked = int(signals.item())
        return asked or signal.SIGINT

    def stop_reporting(self, status: str) -> None:
        """A run ending on an error: the profile written, the tracker runs ended with ``status``."""
        if self.profiler is not None:
            self.profiler.stop()
        self.hooks.logger.close(status)


class FirstStepStamp:
    """The epoch's after-step hook: stamps the first optimizer step, then calls ``then`` (--profile) each step."""

    def __init__(self, clock: PhaseClock, then: Callable[[], None] | None) -> None:
        self.clock, self.then, self.stamped = clock, then, False

    def __call__(self) -> None:
        if not self.stamped:
            self.stamped = True
            self.clock.stamp("first step")
        if self.then is not None:
            self.then()


class FirstBatchStamp:
    """A training loader whose first batch is stamped as it arrives (the workers' start-up and first batch)."""

    def __init__(self, loader: Any, clock: PhaseClock) -> None:
        self.loader, self.clock = loader, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        first = next(batches, None)
        if first is None:
            return
        self.clock.stamp("first batch")
        yield first
        yield from batches


def start_optimization(
    run: RunSetup, ckpt: dict | None, n_losses: int
) -> tuple[Optimization, ResumePosition, tuple[float, int]]:
    """The run's optimizer, EMA and schedule, a resumed run's restored; where the run starts; its best so far."""
    hyp = cast(OptimisationHyp, run.hyp)  # every family's record holds the shared optimisation group
    family = run.family
    inputs = OptimizerInputs(len(run.dataset), run.nc, hyp, family.adamw_lr_per_class_term, family.recipe_optimizer)
    optim = build_optimization(
        run.model, run.family, run.config, choose(run.config, inputs, ckpt), hyp, run.precision.needs_scaler
    )
    position, best = ResumePosition(optim.schedule, 0, 0, LossTally(n_losses)), (0.0, -1)
    if ckpt:
        restore(optim, ckpt)
        position = resumed_position(ckpt, run.config, hyp, n_losses)
        optim.schedule = position.schedule
        best = float(ckpt["best_fitness"]), int(ckpt.get("best_epoch", -1))
    stage = family.stage_epoch(run.config.epochs, run.config.close_mosaic, run.hyp)
    optim.start_schedule(position.start_epoch, len(run.train_loader), run.config.epochs, stage)
    return optim, position, best


def check_same_draw(info: DistInfo, draw: list[int], epoch: int, device: torch.device) -> None:
    """--image-weights under DDP: stop when the ranks' global draws of ``epoch`` differ (their shards would overlap)."""
    if not info.is_distributed:
        return
    digest = draw_digest(np.array(draw))
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    with collective("all_reduce"):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the largest and (negated) the smallest digest
    if int(extremes[0]) != -int(extremes[1]):
        raise RuntimeError(f"--image-weights: the ranks drew different image lists for epoch {epoch}")
    LOGGER.info(f"image weights: epoch {epoch} draw {digest:08x} is the same on all {info.world_size} ranks")
