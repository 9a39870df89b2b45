"""RT-DETRv2 (github.com/lyuwenyu/RT-DETR, rtdetrv2_pytorch, Apache-2.0): ResNet-vd backbones, the hybrid encoder, a
deformable decoder; scales r18, r34, r50, r50m, r101 (``models/rtdetrv2.yaml``: ``--cfg rtdetrv2-r18.yaml``).

The official checkpoints' names map onto transformers' by ``OFFICIAL_KEYS`` (regular expressions applied in turn;
the self-attention's packed input projection is split in ``models/families/detr_import.py``), written from the two
models' state dicts built with random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.families.detr import DetrFamily
from models.families.detr_import import SHARED_ATTENTION_KEYS, SHARED_MODULE_KEYS, TIED_COPIES

# Official name (regular expression) -> transformers' name, applied in this order to every key (the rows both
# families share: models/families/detr_import.py).
OFFICIAL_KEYS = (
    (r"^backbone\.conv1\.conv1_1\.", "detr.model.backbone.model.embedder.embedder.0."),
    (r"^backbone\.conv1\.conv1_2\.", "detr.model.backbone.model.embedder.embedder.1."),
    (r"^backbone\.conv1\.conv1_3\.", "detr.model.backbone.model.embedder.embedder.2."),
    (r"^backbone\.res_layers\.(\d+)\.blocks\.(\d+)\.", r"detr.model.backbone.model.encoder.stages.\1.layers.\2."),
    (r"(\.layers\.\d+)\.short\.conv\.(conv|norm)\.", r"\1.shortcut.1.\2."),  # vd: average pooling, then 1x1
    (r"(\.layers\.\d+)\.short\.", r"\1.shortcut."),
    (r"(\.layers\.\d+)\.branch2a\.", r"\1.layer.0."),
    (r"(\.layers\.\d+)\.branch2b\.", r"\1.layer.1."),
    (r"(\.layers\.\d+)\.branch2c\.", r"\1.layer.2."),
    (r"^(detr\.model\.backbone\..*)\.conv\.", r"\1.convolution."),
    (r"^(detr\.model\.backbone\..*)\.norm\.", r"\1.normalization."),
    *SHARED_MODULE_KEYS,
    (r"^encoder\.(fpn_blocks|pan_blocks|downsample_convs)\.", r"detr.model.encoder.\1."),
    *SHARED_ATTENTION_KEYS,
    (r"\.linear1\.", ".mlp.fc1."),
    (r"\.linear2\.", ".mlp.fc2."),
    (r"(\.decoder\.layers\..*)\.norm2\.", r"\1.encoder_attn_layer_norm."),
    (r"\.num_points_scale$", ".n_points_scale"),
)
# The anchors and valid mask of the 640 x 640 deploy size: made for the image's own size here.
OFFICIAL_DROPPED = r"^decoder\.(anchors|valid_mask)$"


class RTDetrV2Family(DetrFamily):
    name = "rtdetrv2"
    title = "RT-DETRv2"
    model_type = "rt_detr_v2"
    yaml_name = "rtdetrv2.yaml"
    loss_names = ("vfl", "box", "giou")  # models/detr_loss.py
    official_keys = OFFICIAL_KEYS
    official_dropped = OFFICIAL_DROPPED
    tied_copies = TIED_COPIES

    def backbone_config(self, table: Mapping[str, Any]) -> dict[str, Any]:
        """RTDetrResNetConfig of a ResNet-vd: the deep stem (three 3x3 convolutions), stride 2 in the 3x3
        convolution of a bottleneck (not its first 1x1), average pooling before a strided shortcut; stages 2-4 out."""
        return {
            "model_type": "rt_detr_resnet",
            "embedding_size": 64,
            "downsample_in_bottleneck": False,
            "out_features": ["stage2", "stage3", "stage4"],
            **table,
        }


RTDETRV2 = RTDetrV2Family()
