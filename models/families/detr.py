"""What the real-time DETR families (D-FINE, RT-DETRv2) share: configs with named scales mapped onto transformers'
configs, the model (``models/detr.py: DetrDetector``), the end-to-end output and its export hooks.

A family module sets its name, transformers' model type, its YAML and how a scale's backbone table becomes
transformers' backbone config; the official checkpoints' key names come with its ``official_keys`` table
(``models/families/detr_import.py`` reads the files).

Output layout ``"end2end"``: (B, 300, 6) = x1 y1 x2 y2 score class in input pixels, the top 300 over queries x
classes (no NMS).

The recipe (:class:`DetrHyp`, ``data/hyps/hyp.dfine.yaml`` and ``hyp.rtdetrv2.yaml``, numbers from the official
configs): AdamW at the hyp file's lr0 whatever the run's length, the backbone at ``backbone_lr`` times it, no
weight decay on norms and biases (``parameter_groups``), gradients clipped to 0.1 per image of a step, the step schedule and EMA of
``utils/hyp.py: StepScheduleHyp``, the augmentations of ``ZoomCropHyp``, and the no-augmentation stage over the
run's last ``no_aug_share`` of epochs (``stage_epoch``), which goes on from the best validated epoch before it
(the engine: ``Trainer.start_stage``). Training: the targets go into the forward pass (denoising queries), the loss is
``models/detr_loss.py: DetrLoss`` (Hungarian matching: ``models/detr_matcher.py``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn
import yaml

from models.detr import DenoisingPlan, DetrDetector, sample_entropy
from models.detr_loss import DetrLoss
from models.families.base import ExportModule, Family, Int8Scope, TrainBatch
from models.families.detr_import import HuggingFaceImporter, OfficialDetrImporter
from models.loss import DetectionLoss
from utils.errors import UserError
from utils.hyp import HypRecord, Limit, OptimisationHyp, StepScheduleHyp, ZoomCropHyp, evolve_limits_of
from utils.log import LOGGER
from utils.nms import end_to_end_detections

MODELS = Path(__file__).resolve().parents[1]
HUGGING_FACE_IMPORTER = HuggingFaceImporter()
OFFICIAL_IMPORTER = OfficialDetrImporter()
_SCALED = re.compile(r"^(?P<base>.+)-(?P<scale>[a-z0-9]+)$")  # dfine-n, rtdetrv2-r18


@dataclass(frozen=True)
class DetrLossGains(HypRecord):
    """The DETR losses' gains and the matcher's costs (the official criteria's ``weight_dict``s); the loss reads
    them as ``hyp.<name>``."""

    vfl: float = 1.0  # classification: varifocal loss
    mal: float = 0.0  # or DEIM's matchability-aware loss in its place: a gain above 0 chooses it (then vfl: 0)
    bbox: float = 5.0  # L1 box loss
    giou: float = 2.0  # GIoU box loss
    focal_alpha: float = 0.75  # the classification loss's alpha
    focal_gamma: float = 2.0  # and gamma (DEIM's MAL: 1.5)
    cost_class: float = 2.0  # Hungarian matching: the class cost (focal, alpha and gamma below)
    cost_bbox: float = 5.0  # the L1 cost
    cost_giou: float = 2.0  # the GIoU cost
    matcher_alpha: float = 0.25
    matcher_gamma: float = 2.0

    def check(self, source: str) -> None:
        class_loss_of(self, source)  # one classification loss: refused where the file is read, naming it


@dataclass(frozen=True)
class DetrHyp(ZoomCropHyp, DetrLossGains, StepScheduleHyp, OptimisationHyp):
    """RT-DETRv2's hyper-parameters (``data/hyps/hyp.rtdetrv2.yaml``); D-FINE's record adds its two terms. A file
    must set ``giou``: that is what tells it from a YOLO family's."""

    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ("giou",)


# --evolve: YOLOv5's table for the shared keys; the gains on their own scale. The step schedule, EMA, stage and the
# matcher's costs are the recipe's and are not mutated.
DETR_LIMITS = {
    "lr0": Limit(1, 1e-5, 1e-3),
    "weight_decay": Limit(1, 0.0, 1e-3),
    "momentum": Limit(0, 0.6, 0.98),
    "warmup_epochs": Limit(0, 0.0, 5.0),  # YOLO's warmup: unused by the step schedule
    "warmup_momentum": Limit(0, 0.0, 0.95),
    "warmup_bias_lr": Limit(0, 0.0, 0.2),
    "backbone_lr": Limit(1, 0.01, 1.0),
    "vfl": Limit(1, 0.2, 4.0),
    "mal": Limit(1, 0.2, 4.0),  # DEIM's in vfl's place: only the gain in use is searched (DetrFamily.evolve_keys)
    "bbox": Limit(1, 1.0, 10.0),
    "giou": Limit(1, 0.5, 5.0),
    "fgl": Limit(1, 0.02, 1.0),
    "ddf": Limit(1, 0.2, 5.0),
    "photometric": Limit(1, 0.0, 1.0),
    "zoom_out": Limit(1, 0.0, 1.0),
    "iou_crop": Limit(1, 0.0, 1.0),
}


# Why the check against PyTorch on one input cannot judge a DETR's fp16 and INT8 files: the encoder's top 300 of its
# tokens become the decoder's queries, and rounding reorders tokens whose scores lie near the cut, so a few of the
# 300 output rows differ however good the file is (bench/detr_export_precision.py; docs/deploy.md).
ROUNDED_QUERIES = "rounding may change which encoder tokens become the decoder's queries"


def class_loss_of(hyp: Any, source: str = "hyp") -> str:
    """The classification loss a run's hyper-parameters choose: DEIM's MAL where its gain ``mal`` is above 0, else
    the varifocal loss. Both gains above 0 is a one-line error naming ``source``: one loss classifies."""
    mal, vfl = float(getattr(hyp, "mal", 0.0)), float(getattr(hyp, "vfl", 0.0))
    if mal > 0 and vfl > 0:
        raise UserError(
            f"{source}: 'vfl' {vfl:g} and 'mal' {mal:g}: set the gain of one classification loss, the other 0"
        )
    return "mal" if mal > 0 else "vfl"


class DetrFamily(Family):
    """A DETR family: set ``name``, ``title``, ``model_type``, ``yaml_name``, ``official_keys`` and
    ``backbone_config``."""

    model_type: ClassVar[str]  # transformers' model type: "d_fine", "rt_detr_v2"
    yaml_name: ClassVar[str]  # its config file in models/, holding its scales
    distributions: ClassVar[bool] = False  # D-FINE's edge distributions: its fgl and ddf loss terms
    head = DetrDetector  # the whole detector: transformers' decoder is its head
    hyp_type: ClassVar[type[HypRecord]] = DetrHyp
    default_hyp = "data/hyps/hyp.rtdetrv2.yaml"
    evolve_limits = evolve_limits_of(DetrHyp, **DETR_LIMITS)
    recipe_optimizer = "AdamW"  # the references' optimizer, at the hyp file's lr0 whatever the run's length
    forward_takes_batch = True  # the denoising queries: groups and noise the same at any world size
    layouts = ("end2end",)
    end_to_end = True
    val_iou = 0.7  # unused: the output is final; kept for the predictor's interface
    detect_iou = 0.7
    importers = (HUGGING_FACE_IMPORTER, OFFICIAL_IMPORTER)
    export_formats: ClassVar[tuple[str, ...]] = ("onnx", "openvino")  # checked against PyTorch: docs/deploy.md
    min_onnx_opset = 17  # LayerNormalization: older opsets split it into a Pow that overflows in fp16

    # ---- configs ----

    def backbone_config(self, table: Mapping[str, Any]) -> dict[str, Any]:
        """transformers' backbone config (a dict with its ``model_type``) of a scale's backbone table."""
        raise NotImplementedError

    def scales(self) -> dict[str, Any]:
        """Its YAML: shared ``config``, ``backbones`` and per-scale ``scales``."""
        return yaml.safe_load((MODELS / self.yaml_name).read_text(encoding="utf-8"))

    def config_of_scale(self, scale: str, nc: int | None = None) -> dict[str, Any]:
        """The model config of one of its scales (as checkpoints store it)."""
        table = self.scales()
        if scale not in table["scales"]:
            raise UserError(
                f"{self.yaml_name}: scale '{scale}' is not among its scales {', '.join(table['scales'])} "
                f"(e.g. {Path(self.yaml_name).stem}-{next(iter(table['scales']))}.yaml)"
            )
        entry = table["scales"][scale]
        backbone = {**table["backbones"][entry["backbone"]["name"]], **entry["backbone"]}
        backbone.pop("name")
        fields = {**table["config"], **entry["config"], "backbone_config": self.backbone_config(backbone)}
        return {
            "family": self.name,
            "model_type": self.model_type,
            "yaml_file": f"{Path(self.yaml_name).stem}-{scale}.yaml",
            "scale": scale,
            "nc": int(nc if nc is not None else table["nc"]),
            "params": int(entry["params"]),
            "eval_layers": entry.get("eval_layers"),
            "transformers": fields,
        }

    def load_config(self, cfg: str | Path | Mapping[str, Any]) -> dict[str, Any]:
        """A config dict from a checkpoint's dict or a name: ``dfine-n.yaml`` (models/dfine.yaml at scale n)."""
        if isinstance(cfg, Mapping):
            if "transformers" in cfg:
                return copy.deepcopy(dict(cfg))
            if cfg.get("scale"):
                return self.config_of_scale(str(cfg["scale"]), cfg.get("nc"))
            raise UserError(f"{cfg.get('yaml_file', 'model config')}: a {self.title} config names no scale")
        match = _SCALED.match(Path(cfg).stem)
        if not match or f"{match['base']}.yaml" != self.yaml_name:
            scales = ", ".join(f"{Path(self.yaml_name).stem}-{s}.yaml" for s in self.scales()["scales"])
            raise UserError(f"{cfg}: name a scale of {self.title}: {scales}")
        return self.config_of_scale(match["scale"])

    def config_of_name(self, cfg: str | Path) -> dict[str, Any] | None:
        match = _SCALED.match(Path(cfg).stem)
        return self.load_config(cfg) if match and f"{match['base']}.yaml" == self.yaml_name else None

    def scale_names(self) -> list[str]:
        return list(self.scales()["scales"])

    # ---- building ----

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
        """transformers' detector of the config, with ``weights`` (ours: transformers' names under ``detr.``);
        ``transfer`` loads the tensors whose shapes fit, so a model for another class count starts with its
        class-dependent tensors (score heads, denoising class embedding) initialised afresh."""
        config = self.load_config(cfg)
        nc = int(nc if nc is not None else config["nc"])
        model = DetrDetector(config, nc, names)
        if weights is not None:
            load_weights(model, weights, transfer, config.get("yaml_file", self.name))
        return model

    def make_loss(self, model: nn.Module, hyp: Any, *, imgsz: int, label_smoothing: float = 0.0) -> DetectionLoss:
        """``models/detr_loss.py: DetrLoss``: Hungarian matching, varifocal, L1 and GIoU terms on every decoder layer,
        the encoder's top-k and the denoising groups (D-FINE: its fgl and ddf terms too); gains from the model's
        transformers config, replaced by the run's hyper-parameters (the family's record) where it has them."""
        return DetrLoss(model, distributions=self.distributions, class_loss=class_loss_of(hyp), hyp=hyp)

    def forward_train(
        self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, batch: TrainBatch | None = None
    ) -> Any:
        """The model with the targets and the step's ``batch`` (``forward_takes_batch``), of which the denoising
        queries are made: the groups sized by the most boxes of one image over every rank, each image's noise drawn
        from (seed, epoch, its sample), so the step does not depend on the world size."""
        if batch is None:
            return model(images, targets)
        entropy = tuple(sample_entropy(batch.seed, batch.epoch, sample) for sample in batch.samples)
        return model(images, targets, DenoisingPlan(batch.per_image, batch.most_over_ranks, entropy))

    def evolve_keys(self, base: HypRecord) -> list[str]:
        """The family's keys less the classification gain ``base`` leaves at 0: mutating it up from 0 (its
        limits start above 0) would ask for both classification losses, which a run refuses."""
        unused = "vfl" if class_loss_of(base) == "mal" else "mal"
        return [k for k in super().evolve_keys(base) if k != unused]

    def fit_anchors(
        self, dataset: Any, model: nn.Module, hyp: Any = None, *, thr: float | None = None, imgsz: int
    ) -> None:
        LOGGER.info(f"AutoAnchor does not apply: {self.title} has no anchors")

    def parameter_groups(self, model: nn.Module, weight_decay: float, hyp: Any = None) -> list[dict[str, Any]]:
        """Four groups, as the official configs split them: norms and biases outside the backbone (no decay), the
        other weights (``weight_decay``), the backbone's norms and biases (no decay) and weights (decay), both at
        ``backbone_lr`` times lr0. A parameter is listed once: transformers ties each decoder layer's heads under
        two names (``class_embed.i`` and ``model.decoder.class_embed.i``), one Parameter object."""
        scale = float(getattr(hyp, "backbone_lr", 1.0))
        norm_types = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
        groups: dict[tuple[bool, bool], list[nn.Parameter]] = {(b, d): [] for b in (False, True) for d in (False, True)}
        seen: set[int] = set()
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                backbone = ".backbone." in f".{module_name}."
                decayed = name != "bias" and not isinstance(module, norm_types)
                groups[backbone, decayed].append(p)
        return [
            {"params": groups[False, False], "weight_decay": 0.0},
            {"params": groups[False, True], "weight_decay": weight_decay},
            {"params": groups[True, False], "weight_decay": 0.0, "lr_scale": scale},
            {"params": groups[True, True], "weight_decay": weight_decay, "lr_scale": scale},
        ]

    def stage_epoch(self, epochs: int, close_mosaic: int, hyp: Any) -> int | None:
        """The recipes' no-augmentation stage: the run's last ``no_aug_share`` of epochs (D-FINE-N: 12 of 160,
        from epoch 148), at least the last epoch of a run of 2 or more; none when the share is 0 (``--close-mosaic``
        does not apply)."""
        share = float(getattr(hyp, "no_aug_share", 0.0))
        if share <= 0 or epochs < 2:
            return None
        return epochs - min(max(round(epochs * share), 1), epochs - 1)

    def mosaic_epochs(self, epochs: int, hyp: Any) -> tuple[int, int] | None:
        """The recipe's window of mosaic and mixup, its shares of the run's epochs rounded as the stage's (DEIM-N:
        ``mosaic_start_share`` 0.025 and ``mosaic_end_share`` 0.4875, epochs 4 to 78 of 160); the stage ends it in
        any case."""
        start = round(epochs * float(getattr(hyp, "mosaic_start_share", 0.0)))
        return start, max(round(epochs * float(getattr(hyp, "mosaic_end_share", 1.0))), start)

    # ---- inference and export ----

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
        """The (B, 300, 6) output is final: those above ``conf_thres``, best first (no NMS)."""
        return end_to_end_detections(pred, conf_thres, classes=classes, max_det=max_det)

    def candidates(self, output0: torch.Tensor) -> None:
        return None  # end-to-end: nothing for NMS

    def use_end_to_end(self, model: nn.Module, source: str | Path) -> None:
        """Its only output is end-to-end already."""

    def layout(self, model: nn.Module) -> str:
        return "end2end"

    def export_module(self, model: nn.Module, *, end2end: bool = False) -> nn.Module:
        return ExportModule(model).eval()

    def export_refusal(self, format_name: str, precision: str = "fp32") -> str | None:
        """The formats whose files were checked against PyTorch (docs/deploy.md), at every precision; the others
        are refused until someone checks that they express the deformable sampling (grid_sample) and the top-k."""
        if format_name in self.export_formats:
            return None
        if not self.export_formats:
            return f"{self.title} export is not checked yet (docs/deploy.md): use val.py and detect.py with its weights"
        return (
            f"{self.title} is exported to {' and '.join(self.export_formats)} only: {format_name} is not checked to "
            "express its deformable sampling (grid_sample) and top-k"
        )

    def gate_judges(self, format_name: str, precision: str) -> str | None:
        """fp16 and INT8 files: only their mAP on the user's val split says what the reordered queries cost."""
        return None if precision == "fp32" else ROUNDED_QUERIES

    def int8_float_scope(self, model: nn.Module) -> Int8Scope:
        """The encoder's attention and everything after it stay float: the deformable sampling (offsets and
        weights in pixels and probabilities), the layer norms, the box refinement, the anchors and the top-k (the
        own operations of the detector, of transformers' detector and of its model: '', ``detr``, ``detr.model``);
        the backbone's and the encoder's convolutions (their batch norms folded in) may be quantized. Names are
        the detector's (``DetrDetector``): its transformers model is ``detr``."""
        whole = ("decoder", "encoder.aifi", "enc_output", "enc_score_head", "enc_bbox_head")
        return Int8Scope(
            modules=tuple(f"detr.model.{name}" for name in whole), decoding=("", "detr", "detr.model"), op_types=()
        )


def load_weights(model: DetrDetector, weights: Mapping[str, torch.Tensor], transfer: bool, source: str) -> None:
    """``weights`` into ``model``: all of them, or with ``transfer`` those whose shapes fit (the rest, the
    class-dependent tensors of another class count, keep their initialisation; logged)."""
    own = model.state_dict()
    if transfer:
        fitting = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
        LOGGER.info(f"Transferred {len(fitting)}/{len(own)} items from {source}")
        model.load_state_dict(fitting, strict=False)
        return
    missing = sorted(k for k in own if k not in weights and not k.endswith(("num_batches_tracked", "_extra_state")))
    unexpected = sorted(k for k in weights if k not in own)
    wrong = sorted(k for k in weights if k in own and own[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        what = [
            f"{len(v)} {name} (first {v[0]})"
            for name, v in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong))
            if v
        ]
        raise UserError(f"{source}: its weights do not fit the model: {'; '.join(what)}")
    model.load_state_dict(weights, strict=False)
