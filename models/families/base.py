"""The family contract: everything that differs between kinds of detector, as one object per family.

A family module (models/families/yolov5.py, yolov8.py, ...) subclasses :class:`Family`, sets what differs and
overrides the methods whose YOLO default does not fit; ``models/families/__init__.py`` registers one instance of
each in ``FAMILIES``. Code outside models/families/ asks ``family_of(model | config | name)`` and calls these
members; it never names a family, branches on a head type or keeps a table keyed by family. docs/design.md ("The
family contract") says who calls what.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn as nn

from models.loss import DetectionLoss
from models.yolo import build_model as build_yolo_model
from utils.distributed import de_parallel
from utils.errors import UserError
from utils.hyp import HypRecord, Limit
from utils.log import LOGGER
from utils.optimizer import parameter_groups as yolo_parameter_groups

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TrainBatch:
    """What the step knows on the host of one micro-batch, for a family whose training forward pass needs it
    (``Family.forward_takes_batch``): the run's seed, the epoch, each image's sample (its file: the same sample on
    any rank and at any world size), each image's label rows as the loader gave them, and the most label rows of one
    image over every rank's micro-batch of the step (the same on every rank)."""

    seed: int
    epoch: int
    samples: tuple[str, ...]
    per_image: tuple[int, ...]
    most_over_ranks: int


@dataclass(frozen=True)
class Int8Scope:
    """What stays in float when a model is quantized to INT8 (each export format maps it to its toolkit's ignored
    scope). Names are PyTorch qualified module names in the detector (``model.23``, ``model.23.dfl``; ``''`` is the
    detector itself).

    - ``modules``: modules whose whole arithmetic stays float (DFL's softmax and expectation);
    - ``decoding``: modules whose own operations, outside their child modules, stay float: the head's decoding
      of its convolutions' outputs into boxes and scores (grids, strides, anchors, sigmoid, concatenation), while
      the child convolutions themselves may be quantized;
    - ``op_types``: ONNX operator types that stay float wherever they occur inside ``decoding``;
    - ``logits``: the head's prediction convolutions, whose outputs are the box and class logits. A format keeps them
      float where its INT8 activations are symmetric (ONNX's QDQ for TensorRT, LiteRT), which cost the most accuracy
      there; NNCF's asymmetric activations quantize them as well as float (docs/benchmarks.md).
    """

    modules: tuple[str, ...]
    decoding: tuple[str, ...]
    op_types: tuple[str, ...] = ("Sigmoid", "Softmax", "Add", "Sub", "Mul", "Div", "Pow", "Concat")
    logits: tuple[str, ...] = ()


class ExportModule(nn.Module):
    """What an exported file computes: images (B, 3, H, W) in [0, 1] to ``output0`` in the family's layout, in
    input pixels (a PyTorch model in eval mode returns (output0, raw head outputs); only output0 is exported)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)[0]


class CheckpointImporter:
    """Reads another tool's checkpoint files through an allow-list into this project's checkpoint dict.

    ``source`` is the value the imported dict carries under ``source`` (and the key of the tool's own record in it);
    ``title`` and ``possessive`` name the tool in messages. Importers are tried in turn; a ``catch_all`` one comes
    last and reads (or refuses, naming the offending global) whatever no other importer took.
    """

    source: ClassVar[str]
    title: ClassVar[str]
    possessive: ClassVar[str]
    catch_all: ClassVar[bool] = False

    def read(self, path: Path, families: Sequence[Family]) -> dict[str, Any] | None:
        """The checkpoint dict of ``path`` for a model of one of ``families`` (those that use this importer), or
        None when the file is not this tool's."""
        raise NotImplementedError

    def missing_file_hint(self, file_name: str, families: Sequence[Family]) -> str | None:
        """Where a file of this name comes from, when it is one of the tool's released files; else None."""
        return None


class Family:
    """One family: its members are the contract of docs/design.md; the defaults are the YOLO ones."""

    name: ClassVar[str]  # "yolov5", ...: the ``family:`` key of its model YAMLs, checkpoints' and exports' records
    title: ClassVar[str]  # "YOLOv5", ...: for messages and documentation
    head: ClassVar[type[nn.Module]]  # the head its models end with (a DetectionHead, or a DETR's whole detector)
    # its loss terms: results.csv columns, the log, TensorBoard (a hyp may rename one: the loss's item_names)
    loss_names: ClassVar[tuple[str, ...]]
    hyp_type: ClassVar[type[HypRecord]]  # its hyper-parameter record
    default_hyp: ClassVar[str]  # its default hyper-parameter file, relative to the repository root
    evolve_limits: ClassVar[Mapping[str, Limit]]  # how --evolve may mutate each of its hyper-parameters
    layouts: ClassVar[tuple[str, ...]]  # its output layouts, the one of a freshly built model first
    val_iou: ClassVar[float] = 0.7  # NMS IoU of validation (the mAP sweep)
    detect_iou: ClassVar[float] = 0.7  # NMS IoU of detect.py
    importers: ClassVar[tuple[CheckpointImporter, ...]] = ()  # readers of other tools' checkpoints of its models
    end_to_end: ClassVar[bool] = False  # whether its models have an NMS-free output (``use_end_to_end``)
    anchor_based: ClassVar[bool] = False  # whether its head predicts relative to anchor boxes (AutoAnchor applies)
    # whether its training forward pass reads the step's TrainBatch (the DETRs' denoising queries: a host all-reduce
    # of the most label rows of one image per step)
    forward_takes_batch: ClassVar[bool] = False
    # The automatic optimizer's AdamW learning rate for short runs is this / (4 + nc) (see utils/optimizer.py). Every
    # family keeps the value measured for YOLOv5; Ultralytics' own rule (0.01 / (4 + nc)) is not measured against it.
    adamw_lr_per_class_term: ClassVar[float] = 0.05
    # The optimizer ``--optimizer auto`` gives its runs whatever their length, at the hyp file's lr0 (the DETRs'
    # AdamW); None: the run's length decides (utils/optimizer.py: choose_optimizer).
    recipe_optimizer: ClassVar[str | None] = None
    min_onnx_opset: ClassVar[int] = 1  # the oldest ONNX opset export.py writes its models at (--opset)

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    # ---- recognising its configs ----

    def recognizes(self, cfg: Mapping[str, Any]) -> bool:
        """Whether a model config is this family's: its ``family:`` key, or for configs without one (YOLOv5's and
        Ultralytics' YAMLs and checkpoints, and ours written before the key existed) their contents."""
        declared = cfg.get("family")
        return declared == self.name if declared is not None else self.recognizes_contents(cfg)

    def recognizes_contents(self, cfg: Mapping[str, Any]) -> bool:
        """The rule for configs without a ``family:`` key (see ``FAMILIES``' order in models/families/__init__.py)."""
        return False

    def config_of_name(self, cfg: str | Path) -> dict[str, Any] | None:
        """The model config a ``--cfg`` name stands for, when the name is one of this family's that the YOLO YAML
        reader does not resolve (the DETRs' ``dfine-n.yaml``); None otherwise (the default)."""
        return None

    # ---- training ----

    def build_model(
        self,
        cfg: str | Path | Mapping[str, Any],
        *,
        nc: int | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        transfer: bool = False,
        keep_anchors: bool = True,
        anchors: float | None = None,
        names: list[str] | None = None,
    ) -> nn.Module:
        """Its model from a config (a YAML path or its dict), loaded with ``weights`` when given (``transfer``:
        only the tensors that fit; ``keep_anchors`` False leaves the config's anchors). The default builds a YOLO
        ``Model`` (``models/yolo.py: build_model``); a family whose models are not built from a YOLO YAML overrides
        it. The model must carry ``yaml`` (its config dict, stored in checkpoints), ``names`` and a ``stride``
        tensor (image sizes are multiples of its largest)."""
        return build_yolo_model(
            cfg if isinstance(cfg, (str, Path)) else dict(cfg),
            nc=nc,
            weights=weights,
            transfer=transfer,
            keep_anchors=keep_anchors,
            anchors=anchors,
            names=names,
        )

    def make_loss(self, model: nn.Module, hyp: Any, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        """Its loss, normalised by counts over all ranks (a step does not depend on the world size)."""
        raise NotImplementedError

    def forward_train(
        self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, batch: TrainBatch | None = None
    ) -> Any:
        """The training forward pass; a family whose model needs the targets (denoising queries) overrides it. The
        step passes ``batch`` where ``forward_takes_batch`` says the family reads it."""
        return model(images)

    def parameter_groups(self, model: nn.Module, weight_decay: float, hyp: Any = None) -> list[dict[str, Any]]:
        """The optimizer's parameter groups. The first group's learning rate warms up from ``warmup_bias_lr``; YOLO's
        three: biases (no decay), weights of convolutions and linear layers (``weight_decay``), norm weights (no
        decay). Settings a group leaves out take the optimizer's defaults; ``lr_scale`` sets a group's learning rate
        as a multiple of lr0. ``hyp``: the run's record (a family's multipliers)."""
        weights, norm_weights, biases = yolo_parameter_groups(model)
        return [
            {"params": biases},
            {"params": weights, "weight_decay": weight_decay},
            {"params": norm_weights, "weight_decay": 0.0},
        ]

    def stage_epoch(self, epochs: int, close_mosaic: int, hyp: Any) -> int | None:
        """The epoch from which a run of ``epochs`` trains without its strongest augmentation, or None. YOLO's:
        ``--close-mosaic``'s last epochs without mosaic and mixup. The engine hands it to the dataset, which stops
        what the hyp's record says (utils/data/dataset.py), and where the record asks (the DETR recipes'
        ``StepScheduleHyp``) restarts the EMA there."""
        return max(epochs - close_mosaic, 0) if close_mosaic > 0 else None

    def mosaic_epochs(self, epochs: int, hyp: Any) -> tuple[int, int] | None:
        """The window of epochs ``[start, end)`` of a run of ``epochs`` in which its samples may be mosaics and
        mixups (until the stage epoch in any case), or None: the whole run before the stage (YOLO's)."""
        return None

    @property
    def default_hyp_path(self) -> Path:
        return ROOT / self.default_hyp

    def read_hyp(self, values: Mapping[str, Any] | str | Path, source: str | None = None) -> HypRecord:
        """Its hyper-parameters from a YAML file or a mapping (a checkpoint's); another family's are refused in
        one line naming the file."""
        if isinstance(values, (str, Path)):
            source = source or str(values)
            values = self.hyp_type.read_yaml(values, source)
        source = source or "hyp"
        mapping = cast(Mapping[str, Any], values)  # a YAML file's contents, whatever they are: checked below
        self.check_hyp_keys(mapping, source)
        return self.hyp_type.from_dict(dict(mapping), source)

    def check_hyp_keys(self, values: Mapping[str, Any], source: str) -> None:
        """A one-line error when ``values`` set a key this family's record has not, or lack one it needs."""
        if not isinstance(values, Mapping):
            return  # from_dict says what is wrong
        record = self.hyp_type
        foreign = sorted(  # a YAML key may be a number or null too
            (
                k
                for k in values
                if k not in record.field_names() and k not in record.IGNORED_KEYS and values[k] is not None
            ),
            key=str,
        )
        if foreign:
            keys = ", ".join(repr(k) for k in foreign)
            what = "is not a hyper-parameter" if len(foreign) == 1 else "are not hyper-parameters"
            raise UserError(
                f"{source}: {keys} {what} of {self.name}: another family's file? (its own: {self.default_hyp})"
            )
        missing = [k for k in record.REQUIRED_KEYS if values.get(k) is None]
        if missing:
            raise UserError(
                f"{source}: no {', '.join(repr(k) for k in missing)} gain: not hyper-parameters of "
                f"{self.name} (its own: {self.default_hyp})"
            )

    def check_hyp(self, hyp: HypRecord, source: str) -> None:
        """A one-line error when ``hyp`` (any record) holds another family's hyper-parameters."""
        self.check_hyp_keys(hyp.to_dict(), source)

    def evolve_keys(self, base: HypRecord) -> list[str]:
        """The hyper-parameters an evolve.csv row holds: those of ``base`` with a value that this family uses."""
        return [k for k in base.to_dict() if k in self.evolve_limits]

    def fit_anchors(
        self, dataset: Any, model: nn.Module, hyp: Any = None, *, thr: float | None = None, imgsz: int
    ) -> None:
        """AutoAnchor where the family has anchors; a note otherwise."""
        LOGGER.info(f"AutoAnchor does not apply: {self.name} is anchor-free")

    def anchors(self, hyp: Any) -> float | None:
        """Anchors per output level the hyper-parameters ask for (YOLOv5's ``anchors``); None: the config's."""
        return None

    # ---- inference and export ----

    @property
    def nms_iou(self) -> float:
        """The NMS IoU of validation (``val_iou``), under the name utils/validation.py reads."""
        return self.val_iou

    def layout(self, model: nn.Module) -> str:
        """Its output layout as the model is set now (one of ``layouts``)."""
        return self.layouts[0]

    def detections(
        self,
        pred: torch.Tensor,
        conf_thres: float,
        iou_thres: float,
        *,
        classes: list[int] | None = None,
        agnostic: bool = False,
        multi_label: bool = False,
        max_det: int = 300,
    ) -> list[torch.Tensor]:
        """Per image (n, 6) = x1 y1 x2 y2 conf cls in input pixels, best first, from decoded predictions (a
        PyTorch model's or any exported file's ``output0``)."""
        raise NotImplementedError

    def candidates(self, output0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Traceable, for NMS inside an exported graph: boxes (B, N, 4) x1 y1 x2 y2 in input pixels and per-class
        scores (B, N, nc); None for an end-to-end output, which needs no NMS."""
        raise NotImplementedError

    def use_end_to_end(self, model: nn.Module, source: str | Path) -> None:
        """Switch ``model`` (in place) to its NMS-free output; one line for a family that has none."""
        having = ", ".join(f.title for f in Family.registered() if f.end_to_end) or "no family"
        raise UserError(f"--end2end: {source} has no one-to-one head ({having} only)")

    def export_module(self, model: nn.Module, *, end2end: bool = False) -> nn.Module:
        """A traceable module: images (B, 3, H, W) in [0, 1] to ``output0`` in its layout, in input pixels. With
        ``end2end`` the NMS-free output, on a copy (``model`` stays as it is)."""
        if end2end:
            model = copy.deepcopy(model)
            self.use_end_to_end(model, getattr(model, "yaml", {}).get("yaml_file", "the model"))
        return ExportModule(model).eval()

    def export_refusal(self, format_name: str, precision: str = "fp32") -> str | None:
        """Why its models cannot be written in ``format_name`` at ``precision`` (one line), or None: every format
        and precision can."""
        return None

    def gate_judges(self, format_name: str, precision: str) -> str | None:
        """Why export.py's check against PyTorch on one input cannot judge its files in ``format_name`` at
        ``precision`` (one line), or None (the default): the check judges them. Such files are written only with
        ``--data``, and the accuracy gate alone judges them, as it judges every INT8 file."""
        return None

    def int8_float_scope(self, model: nn.Module) -> Int8Scope:
        """What stays out of INT8: the head's decoding, and where a format asks, its logits (see :class:`Int8Scope`)."""
        return Int8Scope(modules=(), decoding=(head_name(model),), logits=tuple(prediction_convs(model)))

    # ---- the registry (models/families/__init__.py fills it once) ----

    _registered: ClassVar[list[Family]] = []

    @staticmethod
    def register(*families: Family) -> None:
        Family._registered.extend(f for f in families if f not in Family._registered)

    @staticmethod
    def registered() -> list[Family]:
        """Every registered family, as ``FAMILIES`` lists them (for messages that name the families having a trait)."""
        return list(Family._registered)


def block_names(cfg: Mapping[str, Any]) -> set[str]:
    """The block names a model config's rows use (for the families' recognition rules)."""
    rows = list(cfg.get("backbone") or []) + list(cfg.get("head") or [])
    return {str(row[2]) for row in rows if isinstance(row, (list, tuple)) and len(row) > 2}


def head_name(model: nn.Module) -> str:
    """The qualified name of a built model's head (its last layer)."""
    bare: Any = de_parallel(model)  # a Model: its layers are untyped nn.Module attributes
    return f"model.{len(bare.model) - 1}"


def head_of(model: nn.Module) -> Any:
    """A built model's head, whose attributes depend on the family (hence ``Any``)."""
    net: Any = de_parallel(model)  # a Model: its layers are untyped nn.Module attributes
    return net.model[-1]


def prediction_convs(model: nn.Module) -> list[str]:
    """Qualified names of the head's bare convolutions (not inside a conv-norm-activation block): the layers whose
    outputs are the box and class logits."""
    head = head_name(model)
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    owners = dict(head_of(model).named_modules())
    return [
        f"{head}.{name}"
        for name, module in owners.items()
        if isinstance(module, nn.Conv2d)
        and isinstance(owners[name.rpartition(".")[0]], (type(head_of(model)), *containers))
    ]
