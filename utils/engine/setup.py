"""A training run's parts, made before its first step: checked options, hyper-parameters, data, model, loaders
and the run folder (made last, once every start-up check has passed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn

from models.families import Family, family_of, model_config_of_name
from models.yolo import load_model_config
from utils.amp import Precision, choose_precision
from utils.checkpoint import load_checkpoint, model_weights, run_folder_of
from utils.data.config import load_data_config
from utils.data.loader import create_dataloader, load_labels
from utils.data.webshards import ShardSet
from utils.distributed import DistInfo, broadcast_object
from utils.engine.config import TrainConfig
from utils.engine.phases import PhaseClock, benchmark_choice
from utils.engine.resume import Resumed
from utils.engine.run_upload import RunUpload, job_run_folder, staging_folder
from utils.errors import EveryRankError, UserError
from utils.hyp import HypRecord
from utils.log import LOGGER, colorstr
from utils.process import kernel_choice
from utils.run_dir import increment_path
from utils.storage import Storage, is_url, join, local_copy, local_path, open_storage, split
from utils.sync_bn import convert_sync_batchnorm
from utils.torch_utils import init_torch_seeds, torch_distributed_zero_first


@dataclass
class RunSetup:
    """What ``set_up`` made."""

    config: TrainConfig  # with the run folder (and a batch size kept on another number of ranks)
    family: Family
    hyp: HypRecord  # the family's record (an evolution's generation may bring another)
    nc: int
    names: list[str]
    model: nn.Module  # on the device, not yet wrapped for DDP
    grid: int  # image sizes are multiples of it
    precision: Precision
    train_loader: Any
    dataset: Any  # the training set
    val_loader: Any
    save_dir: Path  # where the run writes its files: the run folder, or the local staging folder of a URL's
    upload: RunUpload | None = None  # a run folder on object storage: global rank 0's uploads of save_dir
    staging: bool = False  # save_dir is a temporary staging folder, removed at the end


def set_up(
    config: TrainConfig,
    device: torch.device,
    info: DistInfo,
    resumed: Resumed | None,
    hyp: HypRecord | None,
    clock: PhaseClock | None = None,
) -> RunSetup:
    """Check, read and build everything a run trains with; ``hyp`` (an evolution's generation) replaces --hyp;
    ``clock`` stamps the phases on the log."""
    clock = clock or PhaseClock()
    config = check_options(config, info, resumed=resumed is not None)
    ckpt = resumed.ckpt if resumed else None
    source = None
    if config.weights and not ckpt:  # --weights to start from (a URL is downloaded through the storage seam)
        with local_copy(config.weights) as weights:
            source = load_checkpoint(weights)
    family = family_of(model_config(config, ckpt, source))
    hyp = run_hyp(config, family, resumed, hyp)
    if ckpt and config.deterministic != torch.backends.cudnn.deterministic:  # the resumed run's own, or given now
        LOGGER.info(kernel_choice(config.deterministic) or "kernels: cuDNN benchmark (the resumed run's own)")
    init_torch_seeds(config.seed)
    with torch_distributed_zero_first(info.local_rank):  # local rank 0 makes built-in data and label caches first
        data = load_data_config(config.data)
        check_data_options(config, data)  # before a shard index or label cache is built
        labels = [
            load_labels(
                data[split],
                nc=data["nc"],
                workers=config.workers,
                prefix=colorstr(f"{split}: "),
                verbose=info.is_local_main,
            )
            for split in ("train", "val")
        ]
    clock.stamp("data scan and caches")
    # Labels were checked against the data YAML's classes above; --single-cls folds them into one afterwards.
    nc, names = (1, ["item"]) if config.single_cls else (data["nc"], data["names"])
    model = create_model(config, family, ModelSource(nc, names, hyp, ckpt, source)).to(  # type: ignore[call-overload]  # stubs: device with memory_format
        device, memory_format=torch.channels_last
    )
    freeze_layers(model, list(config.freeze))
    # Before the optimizer and the EMA take the parameters. On one CPU process --sync-bn still swaps in the CPU
    # SyncBN for its exact statistics, so that the run equals a W-rank --sync-bn run up to rounding.
    if config.sync_bn and (info.is_distributed or device.type == "cpu"):
        model = convert_sync_batchnorm(model, device)
    grid = max(int(model.stride.max()), 32)
    if config.imgsz % grid:
        raise UserError(f"--imgsz {config.imgsz} must be a multiple of the largest stride ({grid})")
    precision = choose_precision(device, config.amp)
    LOGGER.info(f"precision: {precision.reason}")
    clock.stamp("model")
    stage = family.stage_epoch(config.epochs, config.close_mosaic, hyp)
    window = family.mosaic_epochs(config.epochs, hyp)
    if window is not None and window != (0, config.epochs):
        LOGGER.info(f"mosaic and mixup only in epochs {window[0]} to {window[1] - 1} of 0 to {config.epochs - 1}")
    train_loader, dataset, val_loader = make_loaders(config, info, hyp, grid, labels, stage, window)
    choose_kernels(config, device, (train_loader, val_loader), grid)
    if not ckpt and not config.noautoanchor:
        family.fit_anchors(dataset, model, hyp, imgsz=config.imgsz)
    clock.stamp("loaders")
    # Only now that every check has passed.
    folder = run_folder(config, info, hyp, resumed is not None)
    return RunSetup(
        config.replace(save_dir=folder.location),
        family,
        hyp,
        nc,
        names,
        model,
        grid,
        precision,
        train_loader,
        dataset,
        val_loader,
        folder.local,
        folder.upload,
        folder.location != str(folder.local),
    )


def check_options(config: TrainConfig, info: DistInfo, resumed: bool) -> TrainConfig:
    """The options that cannot train, as one-line UserErrors, before any data is read or folder made.

    A run ``resumed`` on a number of ranks that does not split its global batch keeps the nearest batch that does.
    """
    if config.epochs < 1 or config.batch_size < 1:
        raise UserError(f"--epochs {config.epochs} and --batch-size {config.batch_size} must be at least 1")
    if config.time is not None and not config.time > 0:
        raise UserError(f"--time {config.time}: give the training time in hours, more than 0 (e.g. --time 0.5)")
    if config.log_interval < 1:
        raise UserError(f"--log-interval {config.log_interval} must be at least 1 (optimizer steps)")
    if config.batch_size % info.world_size and resumed:
        kept = max(config.batch_size // info.world_size, 1) * info.world_size
        LOGGER.warning(
            f"WARNING the global batch {config.batch_size} cannot be split over {info.world_size} ranks: "
            f"continuing with {kept} from the next epoch boundary"
        )
        config = config.replace(batch_size=kept)
    for flag in ("image_weights", "quad"):
        if getattr(config, flag) and config.rect:
            raise UserError(f"--{flag.replace('_', '-')} needs shuffled square batches: drop --rect")
    if config.quad and config.batch_size // info.world_size < 4:
        raise UserError(
            f"--quad merges 4 images into one: --batch-size {config.batch_size} must give every rank at "
            f"least 4 (it gives {config.batch_size // info.world_size})"
        )
    check_global_batch(config.batch_size, info.world_size)
    return config


def check_global_batch(batch_size: int, world_size: int) -> None:
    """The global batch splits evenly over the ranks; else one line (from rank 0) with the nearest that do."""
    if batch_size % world_size:
        below = batch_size // world_size * world_size
        nearest = " or ".join(str(b) for b in (below, below + world_size) if b > 0)
        raise EveryRankError(
            f"--batch-size {batch_size} must be a multiple of WORLD_SIZE {world_size}: try --batch-size {nearest}"
        )


def check_data_options(config: TrainConfig, data: dict) -> None:
    """The options that the form of the training data rules out, as one-line UserErrors, once the YAML is read."""
    if config.image_weights and isinstance(data["train"], ShardSet):
        raise UserError(
            f"--image-weights draws images by index and is not available for tar shards "
            f"({data['yaml_file']} names shards for 'train'): drop --image-weights or train on image files"
        )


def run_hyp(config: TrainConfig, family: Family, resumed: Resumed | None, hyp: HypRecord | None) -> HypRecord:
    """The run's hyper-parameters, in the family's record: a resumed run's own (a checkpoint written with the
    record of every family's keys too), an evolution's generation, --hyp, or the family's file."""
    if resumed:
        return family.read_hyp(resumed.ckpt["hyp"], f"{resumed.path} (hyp)")
    if hyp is None:
        hyp = family.read_hyp(config.hyp or family.default_hyp_path, config.hyp or family.default_hyp)
    return hyp


def model_config(config: TrainConfig, ckpt: dict | None, source: dict | None) -> dict:
    """The config of the model a run trains: the resumed run's, --cfg (given or the preset's), or the --weights
    checkpoint's."""
    if ckpt:
        return ckpt["model_cfg"]
    if config.cfg:
        return model_config_of_name(config.cfg) or load_model_config(config.cfg)
    return load_model_config(cast(dict, source)["model_cfg"])  # the --weights checkpoint's own


@dataclass(frozen=True)
class ModelSource:
    """Where a run's model comes from besides its config."""

    nc: int
    names: list[str]
    hyp: HypRecord
    ckpt: dict | None  # a resumed run's checkpoint
    weights: dict | None  # --weights, to start from


def create_model(config: TrainConfig, family: Family, source: ModelSource) -> nn.Module:
    """The resumed model, a new one with the tensors of --weights that fit, or a new one from --cfg."""
    if source.ckpt:
        return family.build_model(source.ckpt["model_cfg"], weights=source.ckpt["model"], names=source.names)
    anchors = family.anchors(source.hyp)
    if source.weights is not None:
        LOGGER.info(f"Starting from {config.weights}")
        # Anchors come with the weights unless another config or anchor count is asked for (AutoAnchor may refit).
        return family.build_model(
            config.cfg or source.weights["model_cfg"],
            nc=source.nc,
            weights=model_weights(source.weights),
            transfer=True,
            keep_anchors=not (config.cfg or anchors),
            anchors=anchors,
            names=source.names,
        )
    assert config.cfg is not None, "a new model needs --cfg (the presets give one)"
    return family.build_model(config.cfg, nc=source.nc, anchors=anchors, names=source.names)


def freeze_layers(model: nn.Module, freeze: list[int]) -> None:
    """--freeze: stop training the listed layers. Parameters a model keeps fixed itself (the DFL head's bins) stay
    fixed: trainable, they would get no gradient, and DDP stops at a parameter that takes no part in the loss."""
    indices = [name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("model.")]
    n_layers = 1 + max((int(i) for i in indices if i.isdecimal()), default=-1)
    if max(freeze) > n_layers or (len(freeze) > 1 and max(freeze) >= n_layers):
        raise UserError(f"--freeze {' '.join(map(str, freeze))}: the model has {n_layers} layers (0 to {n_layers - 1})")
    layers = [f"model.{x}." for x in (freeze if len(freeze) > 1 else range(freeze[0]))]
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in layers):
            p.requires_grad = False
            LOGGER.debug(f"freezing {name}")


def make_loaders(
    config: TrainConfig,
    info: DistInfo,
    hyp: HypRecord,
    grid: int,
    labels: list,
    stage: int | None,
    mosaic_epochs: tuple[int, int] | None = None,
) -> tuple[Any, Any, Any]:
    """The training loader (and its dataset), and the validation loader over this rank's part of the split;
    ``stage``: the epoch from which the training set stops its strongest augmentation, ``mosaic_epochs``: the
    window of its mosaics and mixups (the family's rules)."""
    batch_per_rank = config.batch_size // info.world_size
    cache = None if config.cache == "off" else config.cache
    train_loader, dataset = create_dataloader(
        None,
        config.imgsz,
        batch_per_rank,
        grid,
        hyp=hyp,
        augment=True,
        cache=cache,
        rect=config.rect,
        global_rank=max(info.rank, 0),
        world_size=info.world_size,
        workers=config.workers,
        shuffle=True,
        seed=config.seed,
        single_cls=config.single_cls,
        prefix=colorstr("train: "),
        label_set=labels[0],
        close_mosaic_epoch=stage,
        mosaic_epochs=mosaic_epochs,
        image_weights=config.image_weights,
        quad=config.quad,
        shard_window=config.shard_window,
        resampled=config.resampled,
    )
    # Every rank validates its own part of the split; the results are gathered (validate(gather=True)).
    val_loader, _ = create_dataloader(
        None,
        config.imgsz,
        batch_per_rank * 2,
        grid,
        hyp=hyp,
        cache=cache,
        rect=True,
        pad=0.5,
        workers=config.workers,
        single_cls=config.single_cls,
        prefix=colorstr("val: "),
        label_set=labels[1],
        world_size=info.world_size,
        global_rank=max(info.rank, 0),
    )
    return train_loader, dataset, val_loader


def choose_kernels(config: TrainConfig, device: torch.device, loaders: tuple[Any, Any], grid: int) -> None:
    """cuDNN's benchmark on only where the run is long enough to pay its autotuning back (phases.py), logged with
    the reason; the CPU and --deterministic are left as they are."""
    if device.type != "cuda" or config.deterministic:
        return
    # Validation runs with the benchmark off whatever this says (utils/validation.py): training's steps decide.
    steps = config.epochs * len(loaders[0])
    on, reason = benchmark_choice(steps, input_shapes(config, grid, loaders[0]), True, False)
    torch.backends.cudnn.benchmark = on
    LOGGER.info(reason)


def input_shapes(config: TrainConfig, grid: int, train_loader: Any) -> int:
    """How many distinct image sizes the training steps see: one, one per --multi-scale size (step.py draws
    multiples of ``grid`` from half to one and a half times --imgsz), or one per --rect batch shape."""
    if config.multi_scale:
        return len(range(int(config.imgsz * 0.5) // grid * grid, int(config.imgsz * 1.5) + grid, grid))
    dataset = getattr(train_loader, "dataset", None)
    shapes = getattr(dataset, "batch_shapes", None)
    return len({tuple(s) for s in shapes}) if getattr(dataset, "rect", False) and shapes is not None else 1


@dataclass(frozen=True)
class RunFolder:
    """Where a run's files go (``location``: a local folder or a URL) and where the run writes them (``local``: the
    folder itself, or a staging folder that ``upload`` sends to the URL, on global rank 0)."""

    location: str
    local: Path
    upload: RunUpload | None = None


def run_folder(config: TrainConfig, info: DistInfo, hyp: HypRecord, resumed: bool) -> RunFolder:
    """The run's folder: a resumed run keeps its own; rank 0 makes a new one and writes the options into it."""
    if is_url(config.save_dir if resumed and config.save_dir else config.project):
        return remote_run_folder(config, info, hyp, resumed)
    restarted = (
        run_folder_of(info.run_id, config.project, info.launcher_started)
        if info.restart_count > 0 and info.is_main
        else None
    )
    if resumed:
        assert config.save_dir is not None, "a resumed run's configuration names its folder"
        save_dir = Path(config.save_dir)
    elif restarted is not None:  # the launcher restarted the group before the run's first checkpoint
        save_dir = restarted
    else:
        save_dir = increment_path(local_path(config.project) / config.name, config.exist_ok)
    # Rank 0's absolute path: every node (and a later resume) finds the folder whatever its working directory.
    save_dir = Path(broadcast_object(str(save_dir.resolve()), info))
    if info.is_main:
        write_run_options(config.replace(save_dir=str(save_dir)), hyp, save_dir, info)
    return RunFolder(str(save_dir), save_dir)


def write_run_options(config: TrainConfig, hyp: HypRecord, folder: Path, info: DistInfo) -> None:
    """opt.yaml, hyp.yaml and the launcher's run id in the run folder (global rank 0)."""
    import yaml

    (folder / "weights").mkdir(parents=True, exist_ok=True)
    (folder / "opt.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    hyp.to_yaml(folder / "hyp.yaml")
    if info.run_id:  # launcher restarts find the folder by it
        (folder / "run_id").write_text(info.run_id)
    LOGGER.info(colorstr("hyperparameters: ") + ", ".join(f"{k}={v}" for k, v in hyp.to_dict().items()))


def remote_run_folder(config: TrainConfig, info: DistInfo, hyp: HypRecord, resumed: bool) -> RunFolder:
    """A run folder at a URL: global rank 0 chooses it once (exp, exp2, ... by what the storage holds) and every
    rank is told; each rank works in a local staging folder, and rank 0's is uploaded (a resumed run's files are
    first downloaded into it)."""
    location = None
    if info.is_main:
        if resumed:
            location = config.save_dir
        else:
            restarted = job_run_folder(config.project, info) if info.restart_count > 0 else None
            location = restarted or join(config.project, free_run_name(open_storage(config.project), config))
    location = broadcast_object(location, info)
    assert location is not None, "rank 0 names the run folder"
    local = staging_folder(split(location)[1])
    if not info.is_main:
        return RunFolder(location, local)
    storage = open_storage(location)
    upload = RunUpload(storage, local, heartbeat_s=min(60.0, config.dist_timeout * 30))
    upload.mark_sent(pull_run_files(storage, local))
    write_run_options(config.replace(save_dir=location), hyp, local, info)
    upload.sync()  # the folder's name is taken before the first step
    LOGGER.info(f"run folder {location} (written in {local}, uploaded as the run goes)")
    return RunFolder(location, local, upload)


def free_run_name(storage: Storage, config: TrainConfig) -> str:
    """``--name``, or ``name2``, ``name3``, ... : the first that ``storage`` (the project) does not hold."""
    taken = set(storage.listdir())
    if config.name not in taken or config.exist_ok:
        return config.name
    n = 2
    while f"{config.name}{n}" in taken:
        n += 1
    return f"{config.name}{n}"


def pull_run_files(storage: Storage, local: Path) -> list[str]:
    """The files of a run folder at a URL that a resumed run goes on writing (results.csv, run.json, best.pt, the
    trackers' files ...) downloaded into ``local``; not last.pt (read already, and written anew) nor epochN.pt."""
    pulled = []
    for relative in storage.files():
        name = relative.rpartition("/")[2]
        if relative.startswith("weights/") and (name == "last.pt" or name.startswith("epoch")):
            continue
        storage.download(relative, local / relative)
        pulled.append(relative)
    return pulled
