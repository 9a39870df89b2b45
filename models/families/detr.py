"""What the real-time DETR families (D-FINE, RT-DETRv2) share: configs with named scales mapped onto transformers'
configs, the model (``models/detr.py: DetrDetector``), the end-to-end output and its export hooks.

A family module sets its name, transformers' model type, its YAML and how a scale's backbone table becomes
transformers' backbone config; the official checkpoints' key names come with its ``official_keys`` table
(``models/families/detr_import.py`` reads the files).

Output layout ``"end2end"``: (B, 300, 6) = x1 y1 x2 y2 score class in input pixels, the top 300 over queries x
classes (no NMS). Training: the targets go into the forward pass (denoising queries), the loss is
``models/detr_loss.py: DetrLoss`` (Hungarian matching: ``models/detr_matcher.py``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn
import yaml

from models.detr import DetrDetector
from models.detr_loss import DetrLoss
from models.families.base import ExportModule, Family, Int8Scope
from models.families.detr_import import HuggingFaceImporter, OfficialDetrImporter
from models.families.yolov8 import AnchorFreeFamily, AnchorFreeHyp
from models.loss import DetectionLoss
from utils.errors import UserError
from utils.log import LOGGER
from utils.nms import end_to_end_detections

MODELS = Path(__file__).resolve().parents[1]
HUGGING_FACE_IMPORTER = HuggingFaceImporter()
OFFICIAL_IMPORTER = OfficialDetrImporter()
_SCALED = re.compile(r"^(?P<base>.+)-(?P<scale>[a-z0-9]+)$")  # dfine-n, rtdetrv2-r18


class DetrFamily(Family):
    """A DETR family: set ``name``, ``title``, ``model_type``, ``yaml_name``, ``official_keys`` and
    ``backbone_config``."""

    model_type: ClassVar[str]  # transformers' model type: "d_fine", "rt_detr_v2"
    yaml_name: ClassVar[str]  # its config file in models/, holding its scales
    distributions: ClassVar[bool] = False  # D-FINE's edge distributions: its fgl and ddf loss terms
    head = DetrDetector  # the whole detector: transformers' decoder is its head
    # Until the DETR recipe has its own: the anchor-free record, file and limits (the loss takes its gains from the
    # model's transformers config, not from the hyp).
    hyp_type = AnchorFreeHyp
    default_hyp = AnchorFreeFamily.default_hyp
    evolve_limits = AnchorFreeFamily.evolve_limits
    layouts = ("end2end",)
    end_to_end = True
    val_iou = 0.7  # unused: the output is final; kept for the predictor's interface
    detect_iou = 0.7
    importers = (HUGGING_FACE_IMPORTER, OFFICIAL_IMPORTER)
    export_formats: ClassVar[tuple[str, ...]] = ()  # formats whose files were checked against PyTorch

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
        transformers config."""
        return DetrLoss(model, distributions=self.distributions)

    def forward_train(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> Any:
        """The model with the targets: transformers builds its denoising queries from them."""
        return model(images, targets)

    def fit_anchors(
        self, dataset: Any, model: nn.Module, hyp: Any = None, *, thr: float | None = None, imgsz: int
    ) -> None:
        LOGGER.info(f"AutoAnchor does not apply: {self.title} has no anchors")

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

    def export_refusal(self, format_name: str) -> str | None:
        """The formats whose files were checked against PyTorch (docs/deploy.md); the others are refused until
        someone checks that they express the deformable sampling (grid_sample) and the top-k."""
        if format_name in self.export_formats:
            return None
        if not self.export_formats:
            return f"{self.title} export is not checked yet (docs/deploy.md): use val.py and detect.py with its weights"
        return (
            f"{self.title} is exported to {' and '.join(self.export_formats)} only: {format_name} is not checked to "
            "express its deformable sampling (grid_sample) and top-k"
        )

    def int8_float_scope(self, model: nn.Module) -> Int8Scope:
        """The encoder's attention and everything after it stay float: the deformable sampling (offsets and
        weights in pixels and probabilities), the layer norms, the box refinement and the top-k; the backbone's and
        the encoder's convolutions may be quantized."""
        decoding = ("model.detr.model.decoder", "model.detr.model.encoder.aifi")
        heads = ("enc_output", "enc_score_head", "enc_bbox_head")
        return Int8Scope(modules=decoding + tuple(f"model.detr.model.{h}" for h in heads), decoding=("model",))


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
