"""Train a YOLOv5-family detector on a YOLO-format dataset.

    python train.py                                   # yolov5n on the built-in shapes set, CPU or GPU 0
    python train.py --data path/to/data.yaml --cfg yolov5s.yaml --epochs 100 --img 640
    python -m torch.distributed.run --nproc_per_node 4 train.py --device 0,1,2,3 --batch-size 64
    python train.py --resume                          # continue the latest interrupted run
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import val as validation
from models.yolo import Model
from utils.amp import autocast, choose_precision
from utils.autoanchor import check_anchors
from utils.checkpoint import build_model, cpu_fp32_state, load_checkpoint, model_state, save_checkpoint
from utils.data.config import load_data_config
from utils.data.loader import create_dataloader
from utils.distributed import DistInfo, de_parallel, destroy_process_group, dist_info, init_process_group, slow_barrier
from utils.errors import UserError
from utils.log import LOGGER, colorstr, setup_logging
from utils.loss import ComputeLoss
from utils.lr_schedule import apply_warmup, decay_factor, warmup_iterations
from utils.metrics import fitness
from utils.optimizer import build_optimizer, choose_optimizer, optimizer_steps
from utils.results_log import append_results_row
from utils.resume import resumed_options
from utils.run_dir import increment_path
from utils.sync_bn import convert_sync_batchnorm
from utils.ema import ModelEMA
from utils.torch_utils import init_torch_seeds, select_device

ROOT = Path(__file__).resolve().parent
NOMINAL_BATCH = 64  # gradients are accumulated up to this many images per optimizer step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="", help="checkpoint to start from ('' trains from scratch)")
    p.add_argument("--cfg", default="", help="model YAML (default: yolov5n.yaml, or the config inside --weights)")
    p.add_argument("--data", default=str(ROOT / "data/shapes.yaml"), help="data YAML (default: built-in shapes)")
    p.add_argument("--hyp", default=str(ROOT / "data/hyps/hyp.scratch-low.yaml"), help="hyper-parameter YAML")
    # The defaults of --epochs and --imgsz make `python train.py` a few-minute run on the built-in data.
    p.add_argument("--epochs", type=int, default=40, help="total training epochs")
    p.add_argument("--batch-size", type=int, default=16, help="total batch size over all ranks")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=256, help="train and val image size (px)")
    p.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic)")
    p.add_argument("--resume", nargs="?", const=True, default=False, help="resume the latest run, or PATH/last.pt")
    p.add_argument("--nosave", action="store_true", help="only save the final checkpoint")
    p.add_argument("--noval", action="store_true", help="only validate after the final epoch")
    p.add_argument("--noautoanchor", action="store_true", help="keep the model's anchors as they are")
    p.add_argument("--noplots", action="store_true", help="write no plots")
    p.add_argument("--cache", nargs="?", const="ram", default="auto", choices=["auto", "ram", "disk", "off"],
                   help="cache decoded images: auto (default: in RAM when the dataset is small), ram, disk, off")
    p.add_argument("--device", default="", help="'' (auto), 'cpu', '0' or '0,1,2,3'")
    p.add_argument("--multi-scale", action="store_true", help="vary the image size by +/- 50%% per batch")
    p.add_argument("--single-cls", action="store_true", help="train every class as one")
    p.add_argument("--optimizer", default="auto", choices=["auto", "SGD", "Adam", "AdamW"],
                   help="auto: AdamW for short runs, SGD for long ones (see utils/recipe.py)")
    p.add_argument("--close-mosaic", type=int, default=10, help="train the last N epochs without mosaic and mixup")
    p.add_argument("--sync-bn", action="store_true", help="synchronised BatchNorm across ranks (DDP only)")
    p.add_argument("--workers", type=int, default=2, help="dataloader workers per rank")
    p.add_argument("--project", default=str(ROOT / "runs/train"), help="runs are saved to project/name")
    p.add_argument("--name", default="exp", help="runs are saved to project/name")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name instead of incrementing it")
    p.add_argument("--cos-lr", action="store_true", help="cosine learning-rate decay instead of linear")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing epsilon")
    p.add_argument("--patience", type=int, default=100, help="stop after this many epochs without improvement")
    p.add_argument("--freeze", nargs="+", type=int, default=[0], help="freeze the first N layers, or listed layers")
    p.add_argument("--save-period", type=int, default=-1, help="also save epochN.pt every N epochs (< 1: never)")
    p.add_argument("--seed", type=int, default=0, help="global seed: model init, data order, augmentations")
    p.add_argument("--deterministic", action="store_true", help="bit-for-bit repeatable kernels (slower)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                   help="mixed precision where it helps: fp16 on CUDA, bf16 on CPUs with native bf16")
    return p


def parse_opt(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The command line, and the names of the options the user gave explicitly."""
    argv = sys.argv[1:] if argv is None else argv
    opt = build_parser().parse_args(argv)
    unset = object()
    probe = build_parser()
    probe.set_defaults(**{name: unset for name in vars(opt)})
    explicit = {name for name, value in vars(probe.parse_args(argv)).items() if value is not unset}
    return opt, explicit


def main(argv: list[str] | None = None) -> int:
    opt, explicit = parse_opt(argv)
    info = dist_info()
    setup_logging(info.rank)
    try:
        resume_ckpt = None
        if opt.resume:
            opt, resume_ckpt = resumed_options(opt, explicit)
            if resume_ckpt["epoch"] + 1 >= opt.epochs:
                LOGGER.info(f"{opt.resume}: this run already finished its {opt.epochs} epochs; nothing to resume")
                return 0
        device = setup_device(opt, info)
        train(opt, device, info, resume_ckpt)
    except UserError as e:
        LOGGER.error(f"error: {e}")
        return 1
    finally:
        destroy_process_group()
    return 0


def setup_device(opt: argparse.Namespace, info: DistInfo) -> torch.device:
    """This process's device; in a distributed run, also join the process group."""
    if opt.epochs < 1 or opt.batch_size < 1:
        raise UserError(f"--epochs {opt.epochs} and --batch-size {opt.batch_size} must be at least 1")
    if opt.batch_size % info.world_size:
        raise UserError(f"--batch-size {opt.batch_size} must be a multiple of WORLD_SIZE {info.world_size}")
    device = select_device(opt.device, batch_size=opt.batch_size)
    if info.is_distributed:
        n_devices = len(opt.device.split(",")) if device.type == "cuda" and opt.device else 0
        if device.type == "cuda":
            if n_devices and n_devices < info.world_size:
                raise UserError(f"--device {opt.device} has {n_devices} devices for WORLD_SIZE {info.world_size}")
            torch.cuda.set_device(info.local_rank)
            device = torch.device("cuda", info.local_rank)
        init_process_group(device)
        LOGGER.info(f"DDP: world size {info.world_size}, backend {dist.get_backend()}, rank {info.rank} on {device}")
    return device


def train(opt: argparse.Namespace, device: torch.device, info: DistInfo, resume_ckpt: dict | None) -> dict:
    # ---- options, data, run folder, model --------------------------------------------------------------
    hyp = resume_ckpt["hyp"] if resume_ckpt else load_hyp(opt.hyp)
    data = load_data_config(opt.data, info.local_rank)
    save_dir = Path(opt.save_dir) if resume_ckpt else increment_path(Path(opt.project) / opt.name, opt.exist_ok)
    opt.save_dir = str(save_dir)
    weights_dir = save_dir / "weights"
    last, best = weights_dir / "last.pt", weights_dir / "best.pt"
    if info.is_main:
        weights_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "opt.yaml").write_text(yaml.safe_dump(vars(opt), sort_keys=False))
        (save_dir / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False))
        LOGGER.info(colorstr("hyperparameters: ") + ", ".join(f"{k}={v}" for k, v in hyp.items()))
    init_torch_seeds(opt.seed, opt.deterministic)

    nc, names = (1, ["item"]) if opt.single_cls else (data["nc"], data["names"])
    # channels-last runs the convolutions 1.2-1.6x faster on CPU (oneDNN) and on tensor-core GPUs
    model = make_model(opt, nc, resume_ckpt).to(device, memory_format=torch.channels_last)
    model.names = names
    freeze_layers(model, opt.freeze)
    if opt.sync_bn and info.is_distributed:  # before the optimizer and the EMA take the parameters
        model = convert_sync_batchnorm(model, device)
    precision = choose_precision(device, opt.amp)
    LOGGER.info(f"precision: {precision.reason}")

    grid = max(int(model.stride.max()), 32)
    if opt.imgsz % grid:
        raise UserError(f"--imgsz {opt.imgsz} must be a multiple of the largest stride ({grid})")

    # ---- data --------------------------------------------------------------------------------------------
    batch_per_rank = opt.batch_size // info.world_size
    train_loader, dataset = create_dataloader(
        data["train"], opt.imgsz, batch_per_rank, grid, hyp=hyp, augment=True, cache=image_cache(opt.cache),
        rect=opt.rect, local_rank=info.local_rank, global_rank=max(info.rank, 0), world_size=info.world_size,
        workers=opt.workers, shuffle=True, seed=opt.seed, single_cls=opt.single_cls, nc=nc, prefix=colorstr("train: "),
        close_mosaic_epoch=max(opt.epochs - opt.close_mosaic, 0) if opt.close_mosaic > 0 else None)
    val_loader = None
    if info.is_main:
        val_loader, _ = create_dataloader(
            data["val"], opt.imgsz, batch_per_rank * 2, grid, hyp=hyp, cache=image_cache(opt.cache),
            rect=True, pad=0.5, workers=opt.workers, single_cls=opt.single_cls, nc=nc, prefix=colorstr("val: "))
    if not resume_ckpt and not opt.noautoanchor:
        check_anchors(dataset, model, thr=hyp["anchor_t"], imgsz=opt.imgsz)
    if info.is_main and not resume_ckpt and not opt.noplots:
        from utils.plots import plot_labels

        plot_labels(np.concatenate([lb for lb in dataset.labels if len(lb)] or [np.zeros((0, 5))]), names, save_dir)

    # ---- optimisation ------------------------------------------------------------------------------------
    batches_per_epoch = len(train_loader)
    accumulate = max(round(NOMINAL_BATCH / opt.batch_size), 1)
    choice = choose_optimizer(opt.optimizer, optimizer_steps(opt.epochs, len(dataset), opt.batch_size, accumulate),
                              nc, hyp)
    LOGGER.info(f"optimizer: {choice.name} lr0={choice.lr0} momentum={choice.momentum} ({choice.reason})")
    hyp_run = {**hyp, "lr0": choice.lr0, "momentum": choice.momentum}  # hyp itself stays as the file says
    decay = hyp["weight_decay"] * opt.batch_size * accumulate / NOMINAL_BATCH
    optimizer = build_optimizer(model, choice.name, choice.lr0, choice.momentum, decay)
    lr_factor = decay_factor(opt.epochs, hyp["lrf"], opt.cos_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_factor)
    ema = ModelEMA(model) if info.is_main else None
    scaler = torch.amp.GradScaler(device.type, enabled=precision.needs_scaler)
    start_epoch, best_fitness, best_epoch = 0, 0.0, -1
    if resume_ckpt:
        start_epoch, best_fitness, best_epoch = restore_training_state(resume_ckpt, optimizer, scaler, ema, scheduler)
    compute_loss = ComputeLoss(model, scaled_loss_gains(hyp, model, opt.imgsz), opt.label_smoothing)

    if info.is_distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # ---- training loop -----------------------------------------------------------------------------------
    n_warmup = warmup_iterations(hyp["warmup_epochs"], batches_per_epoch)
    results = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # P, R, mAP50, mAP50-95, val box/obj/cls losses
    # A resumed run keeps counting toward --patience from its best epoch.
    epochs_without_improvement, stop = (start_epoch - 1 - best_epoch if best_epoch >= 0 else 0), False
    LOGGER.info(f"Image sizes {opt.imgsz} train, {opt.imgsz} val; {opt.workers} dataloader workers per rank; "
                f"logging to {colorstr(str(save_dir))}\nStarting training for {opt.epochs} epochs...")
    t_start = time.time()
    for epoch in range(start_epoch, opt.epochs):
        model.train()
        train_loader.sampler.set_epoch(epoch)
        mean_loss = torch.zeros(3, device=device)
        batches = enumerate(train_loader)
        if info.is_main:
            LOGGER.info(f"\n{'Epoch':>11}{'GPU_mem':>11}{'box_loss':>11}{'obj_loss':>11}{'cls_loss':>11}"
                        f"{'Instances':>11}{'Size':>11}")
            batches = tqdm(batches, total=batches_per_epoch, bar_format="{l_bar}{bar:10}{r_bar}")
        optimizer.zero_grad()
        t_epoch = t_batch_ready = time.perf_counter()
        data_wait = 0.0
        for i, (imgs, targets, paths, _) in batches:
            data_wait += time.perf_counter() - t_batch_ready
            iteration = i + batches_per_epoch * epoch
            if iteration <= n_warmup:
                apply_warmup(optimizer, iteration, n_warmup, lr_factor(epoch), hyp_run)
            imgs = prepare_images(imgs, device, opt, grid, epoch, i)
            step_now = (i + 1) % accumulate == 0 or i == batches_per_epoch - 1
            with gradient_sync(model, step_now), autocast(device, precision):
                loss, loss_items = compute_loss(model(imgs), targets.to(device, non_blocking=True))
                loss = loss * info.world_size  # DDP averages gradients over ranks; the loss sums over images
            scaler.scale(loss).backward()
            if step_now:
                optimizer_step(model, optimizer, scaler, ema)
            mean_loss = (mean_loss * i + loss_items) / (i + 1)
            if info.is_main:
                batches.set_description(progress_line(epoch, opt.epochs, device, mean_loss, targets, imgs))
                if i < 3 and epoch == start_epoch and not opt.noplots:
                    from utils.plots import plot_images

                    plot_images(imgs_uint8(imgs), targets, paths, save_dir / f"train_batch{i}.jpg", names)
            t_batch_ready = time.perf_counter()
        scheduler.step()
        epoch_time = time.perf_counter() - t_epoch
        gpu_peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" \
            else ""
        LOGGER.info(f"epoch {epoch}: {batches_per_epoch * opt.batch_size / epoch_time:.1f} images/s, "
                    f"{100 * data_wait / epoch_time:.0f}% of the time waiting for data{gpu_peak}")

        if info.is_main:
            final_epoch = epoch + 1 == opt.epochs
            ema.update_attributes(model)
            if not opt.noval or final_epoch:
                report = final_epoch  # the full report (plots, per-class rows) once, for the final weights
                r = validation.validate(ema.ema, val_loader, names=names, device=device, compute_loss=compute_loss,
                                        plots=report and not opt.noplots, verbose=report and nc < 50,
                                        save_dir=save_dir, autocast_dtype=precision.dtype)
                results = (r.p, r.r, r.map50, r.map, *map(float, r.losses))
            current = float(fitness(np.array(results[:4])))
            improved = current > best_fitness
            best_fitness = max(best_fitness, current)
            best_epoch = epoch if improved else best_epoch
            epochs_without_improvement = 0 if improved else epochs_without_improvement + 1
            lrs = [g["lr"] for g in optimizer.param_groups]
            append_results_row(save_dir / "results.csv", [epoch, *mean_loss.tolist(), *results, *lrs])
            if not opt.nosave or final_epoch:
                ckpt = training_checkpoint(model, ema, optimizer, scaler, epoch, best_fitness, best_epoch, opt, hyp)
                save_checkpoint(ckpt, last)
                if improved:
                    save_checkpoint(ckpt, best)
                if opt.save_period > 0 and (epoch + 1) % opt.save_period == 0:
                    save_checkpoint(ckpt, weights_dir / f"epoch{epoch}.pt")
            stop = epochs_without_improvement >= opt.patience
            if stop:
                LOGGER.info(f"Stopping early: no improvement in the last {opt.patience} epochs")
        if info.is_distributed:
            slow_barrier()  # the other ranks wait here, however long rank 0's validation takes
            stop = broadcast_flag(stop, device)
        if stop:
            break

    # ---- final validation --------------------------------------------------------------------------------
    if info.is_main:
        LOGGER.info(f"\n{epoch - start_epoch + 1} epochs completed in {(time.time() - t_start) / 3600:.3f} hours.")
        del batches, train_loader  # ends the training workers before the last validation
        strip_training_state(best)
        if best.exists() and best_epoch != epoch:  # the last epoch's report was not for the best weights
            final_model = build_model(load_checkpoint(best)).to(device, memory_format=torch.channels_last)
            LOGGER.info(f"\nValidating {best} (epoch {best_epoch})...")
            r = validation.validate(final_model, val_loader, names=names, device=device, plots=not opt.noplots,
                                    save_dir=save_dir, verbose=nc < 50, compute_loss=compute_loss,
                                    autocast_dtype=precision.dtype)
            results = (r.p, r.r, r.map50, r.map, *map(float, r.losses))
        if not opt.noplots:
            from utils.plots import plot_results

            plot_results(save_dir / "results.csv")
        LOGGER.info(f"Results saved to {colorstr(str(save_dir))}")
    return {"save_dir": save_dir, "results": results}


# ---- helpers of train() ----------------------------------------------------------------------------------

def load_hyp(path: str) -> dict:
    try:
        hyp = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path}: cannot read hyper-parameters ({e.__class__.__name__})") from e
    required = ("lr0", "lrf", "momentum", "weight_decay", "warmup_epochs", "warmup_momentum", "warmup_bias_lr",
                "box", "cls", "cls_pw", "obj", "obj_pw", "anchor_t", "fl_gamma")
    missing = [k for k in required if not isinstance(hyp, dict) or k not in hyp]
    if missing:
        raise UserError(f"{path}: missing hyper-parameters {', '.join(missing)}")
    return hyp


def image_cache(mode: str) -> str | None:
    return None if mode == "off" else mode


def make_model(opt: argparse.Namespace, nc: int, resume_ckpt: dict | None) -> nn.Module:
    """A new model from --cfg, the model of --weights (matching tensors transferred), or the resumed one."""
    if resume_ckpt:
        model = Model(resume_ckpt["model_cfg"])
        model.load_state_dict(resume_ckpt["model"])
        return model
    if opt.weights:
        ckpt = load_checkpoint(opt.weights)
        model = Model(opt.cfg or ckpt["model_cfg"], nc=nc)
        source = ckpt.get("ema") or ckpt["model"]
        own = model.state_dict()
        matching = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape and "anchors" not in k}
        model.load_state_dict(matching, strict=False)
        LOGGER.info(f"Transferred {len(matching)}/{len(own)} tensors from {opt.weights}")
        return model
    return Model(opt.cfg or ROOT / "models/yolov5n.yaml", nc=nc)


def freeze_layers(model: nn.Module, freeze: list[int]) -> None:
    layers = [f"model.{x}." for x in (freeze if len(freeze) > 1 else range(freeze[0]))]
    for name, p in model.named_parameters():
        p.requires_grad = not any(name.startswith(prefix) for prefix in layers)
        if not p.requires_grad:
            LOGGER.debug(f"freezing {name}")


def scaled_loss_gains(hyp: dict, model: nn.Module, imgsz: int) -> dict:
    """Loss gains scaled to the number of levels, classes and the image size (hyp values are for 3/80/640)."""
    detect = de_parallel(model).model[-1]
    scaled = dict(hyp)
    scaled["box"] *= 3 / detect.nl
    scaled["cls"] *= detect.nc / 80 * 3 / detect.nl
    scaled["obj"] *= (imgsz / 640) ** 2 * 3 / detect.nl
    return scaled


def prepare_images(imgs: torch.Tensor, device: torch.device, opt: argparse.Namespace, grid: int, epoch: int,
                   batch_index: int) -> torch.Tensor:
    """uint8 batch -> float [0, 1] on the device, resized for --multi-scale by a (seed, epoch, batch) draw."""
    imgs = imgs.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last).float() / 255
    if opt.multi_scale:
        rng = np.random.default_rng([opt.seed, epoch, batch_index, 1])
        size = int(rng.uniform(opt.imgsz * 0.5, opt.imgsz * 1.5 + grid)) // grid * grid
        factor = size / max(imgs.shape[2:])
        if factor != 1:
            new_shape = [math.ceil(x * factor / grid) * grid for x in imgs.shape[2:]]
            imgs = F.interpolate(imgs, size=new_shape, mode="bilinear", align_corners=False)
    return imgs


def gradient_sync(model: nn.Module, step_now: bool) -> contextlib.AbstractContextManager:
    """Under DDP, all-reduce gradients only on the micro-batch that ends an accumulation window."""
    return model.no_sync() if isinstance(model, DDP) and not step_now else contextlib.nullcontext()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   ema: ModelEMA | None) -> None:
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    if ema is not None:
        ema.update(model)


def broadcast_flag(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([float(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def imgs_uint8(imgs: torch.Tensor) -> torch.Tensor:
    return (imgs.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def progress_line(epoch: int, epochs: int, device: torch.device, mean_loss: torch.Tensor, targets: torch.Tensor,
                  imgs: torch.Tensor) -> str:
    mem = f"{torch.cuda.memory_reserved() / 1e9:.3g}G" if device.type == "cuda" else "0G"
    losses = "".join(f"{x:>11.4g}" for x in mean_loss.tolist())
    return f"{f'{epoch}/{epochs - 1}':>11}{mem:>11}{losses}{targets.shape[0]:>11}{imgs.shape[-1]:>11}"


def training_checkpoint(model: nn.Module, ema: ModelEMA, optimizer: torch.optim.Optimizer,
                        scaler: torch.amp.GradScaler, epoch: int, best_fitness: float, best_epoch: int,
                        opt: argparse.Namespace, hyp: dict) -> dict:
    """Everything needed to resume, in the safe format: tensors, state_dicts and plain values only."""
    ckpt = model_state(model)
    ckpt.update(
        ema=cpu_fp32_state(ema.ema),
        updates=ema.updates,
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict() if scaler.is_enabled() else None,
        epoch=epoch,
        best_fitness=float(best_fitness),
        best_epoch=best_epoch,
        opt={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opt).items()},
        hyp=dict(hyp),
        torch_rng=torch.get_rng_state(),
        date=datetime.now().isoformat(timespec="seconds"),
    )
    return ckpt


def restore_training_state(ckpt: dict, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                           ema: ModelEMA | None, scheduler) -> tuple[int, float, int]:
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and ckpt.get("ema") is not None:
        ema.ema.load_state_dict(ckpt["ema"])
        ema.updates = int(ckpt["updates"])
    if ckpt.get("torch_rng") is not None:
        torch.set_rng_state(ckpt["torch_rng"])
    start_epoch = int(ckpt["epoch"]) + 1
    scheduler.last_epoch = start_epoch  # the saved optimizer already holds the learning rates of start_epoch
    LOGGER.info(f"Resuming training at epoch {start_epoch}")
    return start_epoch, float(ckpt["best_fitness"]), int(ckpt.get("best_epoch", -1))


def strip_training_state(path: Path) -> None:
    """Drop the optimizer and scaler from a final checkpoint (a third of the size); keep it loadable."""
    if not path.exists():
        return
    ckpt = load_checkpoint(path)
    for key in ("optimizer", "scaler"):
        ckpt[key] = None
    ckpt.pop("format_version", None)
    save_checkpoint(ckpt, path)


if __name__ == "__main__":
    sys.exit(main())
