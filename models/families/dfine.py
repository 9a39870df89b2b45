"""D-FINE (github.com/Peterande/D-FINE, Apache-2.0): HGNetV2 backbones, the hybrid encoder, a deformable decoder
with fine-grained distribution refinement; scales n, s, m, l, x (``models/dfine.yaml``: ``--cfg dfine-n.yaml``).

The official checkpoints' names map onto transformers' by ``OFFICIAL_KEYS`` (regular expressions applied in turn;
the self-attention's packed input projection is split in ``models/families/detr_import.py``), written from the two
models' state dicts built with random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from models.families.detr import DETR_LIMITS, DetrFamily, DetrLossGains
from models.families.detr_import import SHARED_ATTENTION_KEYS, SHARED_MODULE_KEYS, TIED_COPIES
from utils.hyp import HypRecord, OptimisationHyp, StepScheduleHyp, ZoomCropHyp, evolve_limits_of

# HGNetV2's stage layout, the same at every scale (the official arch_configs' downsample, light-block and kernel
# columns).
_HGNET_FIXED = {
    "model_type": "hgnet_v2",
    "stage_downsample": [False, True, True, True],
    "stage_light_block": [False, False, True, True],
    "stage_kernel_size": [3, 3, 5, 5],
}

# Official name (regular expression) -> transformers' name, applied in this order to every key (the rows both
# families share: models/families/detr_import.py).
OFFICIAL_KEYS = (
    (r"^backbone\.stem\.", "detr.model.backbone.model.embedder."),
    (r"^backbone\.stages\.", "detr.model.backbone.model.encoder.stages."),
    (r"^(detr\.model\.backbone\..*)\.conv\.", r"\1.convolution."),
    (r"^(detr\.model\.backbone\..*)\.bn\.", r"\1.normalization."),
    *SHARED_MODULE_KEYS,
    (r"^encoder\.downsample_convs\.(\d+)\.0\.cv(\d)\.", r"detr.model.encoder.downsample_convs.\1.conv\2."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv1\.", r"detr.model.encoder.\1_blocks.\2.conv1."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv2\.0\.", r"detr.model.encoder.\1_blocks.\2.csp_rep1."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv2\.1\.", r"detr.model.encoder.\1_blocks.\2.conv2."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv3\.0\.", r"detr.model.encoder.\1_blocks.\2.csp_rep2."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv3\.1\.", r"detr.model.encoder.\1_blocks.\2.conv3."),
    (r"^encoder\.(fpn|pan)_blocks\.(\d+)\.cv4\.", r"detr.model.encoder.\1_blocks.\2.conv4."),
    (r"^decoder\.decoder\.(lqe_layers|up|reg_scale)", r"detr.model.decoder.\1"),
    (r"^decoder\.pre_bbox_head\.", "detr.model.decoder.pre_bbox_head."),
    *SHARED_ATTENTION_KEYS,
    (r"\.linear1\.", ".mlp.layers.0."),
    (r"\.linear2\.", ".mlp.layers.1."),
)
# Official tensors transformers computes instead: the anchors and valid mask of the 640 x 640 deploy size (made
# for the image's own size here), and the transformer's copies of the decoder's ``up`` and ``reg_scale``.
OFFICIAL_DROPPED = r"^decoder\.(anchors|valid_mask|up|reg_scale)$"


@dataclass(frozen=True)
class DFineLossGains(DetrLossGains):
    fgl: float = 0.15  # fine-grained localization loss
    ddf: float = 1.5  # decoupled distillation focal loss


@dataclass(frozen=True)
class DFineHyp(ZoomCropHyp, DFineLossGains, StepScheduleHyp, OptimisationHyp):
    """D-FINE's hyper-parameters (``data/hyps/hyp.dfine.yaml``): RT-DETRv2's (``DetrHyp``) and the gains of its
    fine-grained localization (FGL) and decoupled distillation focal (DDF) losses."""

    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ("giou", "fgl")


class DFineFamily(DetrFamily):
    name = "dfine"
    title = "D-FINE"
    model_type = "d_fine"
    yaml_name = "dfine.yaml"
    loss_names = ("vfl", "box", "giou", "fgl", "ddf")  # models/detr_loss.py
    distributions = True
    official_keys = OFFICIAL_KEYS
    official_dropped = OFFICIAL_DROPPED
    tied_copies = TIED_COPIES
    hyp_type: ClassVar[type[HypRecord]] = DFineHyp
    default_hyp = "data/hyps/hyp.dfine.yaml"
    evolve_limits = evolve_limits_of(DFineHyp, **DETR_LIMITS)

    def backbone_config(self, table: Mapping[str, Any]) -> dict[str, Any]:
        """HGNetV2Config: the table's channels and blocks; the stem's output and the stages' outputs are also what
        transformers reads the feature widths from (``embedding_size``, ``hidden_sizes``)."""
        return {
            **_HGNET_FIXED,
            **table,
            "embedding_size": table["stem_channels"][-1],
            "hidden_sizes": list(table["stage_out_channels"]),
            "depths": list(table["stage_num_blocks"]),
        }


DFINE = DFineFamily()
