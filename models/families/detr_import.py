"""The DETR families' weights from other tools, read without running pickled code:

- Hugging Face folders (``config.json`` + ``model.safetensors``, as transformers' ``save_pretrained`` writes them):
  the model is built from the folder's own config; one that is no scale of ours is logged in one line naming the
  nearest scale and what differs;
- the official repositories' ``.pth`` files (D-FINE, RT-DETRv2: a dict holding ``model`` and, in most releases,
  ``ema`` = {``module``: state dict}; the EMA weights are preferred as their loader prefers them), read with
  ``torch.load(weights_only=True)`` and mapped key by key onto transformers' names by the family's
  ``official_keys`` table; the scale is the one whose tensors match by name and shape.

Both give this project's checkpoint dict (``model_cfg``, ``model``, ``names``, ``source``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from models.detr import MODEL_CLASSES, DetrDetector, transformers_module
from models.families.base import CheckpointImporter, Family
from utils.errors import UserError
from utils.log import LOGGER

# Bookkeeping fields of a transformers config.json: not architecture.
_CONFIG_BOOKKEEPING = ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "model_type")
_PACKED_QKV = re.compile(r"^(?P<owner>.*\.self_attn)\.in_proj_(?P<kind>weight|bias)$")

# The official names (regular expressions) -> transformers' names that D-FINE and RT-DETRv2 share: their hybrid
# encoder's and decoder's common parts. A family's ``official_keys`` table puts its backbone's rows first, then
# SHARED_MODULE_KEYS and its own module rows (each anchored at an official top-level name, so their order among
# themselves does not matter), then SHARED_ATTENTION_KEYS and its own rows inside the attention layers, which rename
# parts of names the rows before have made.
SHARED_MODULE_KEYS = (
    (r"^encoder\.input_proj\.(\d+)\.conv\.", r"detr.model.encoder_input_proj.\1.0."),
    (r"^encoder\.input_proj\.(\d+)\.norm\.", r"detr.model.encoder_input_proj.\1.1."),
    (r"^encoder\.encoder\.", "detr.model.encoder.aifi."),
    (r"^encoder\.lateral_convs\.", "detr.model.encoder.lateral_convs."),
    (r"^decoder\.input_proj\.(\d+)\.conv\.", r"detr.model.decoder_input_proj.\1.0."),  # D-FINE-X: 384 wide into 256
    (r"^decoder\.input_proj\.(\d+)\.norm\.", r"detr.model.decoder_input_proj.\1.1."),
    (r"^decoder\.decoder\.layers\.", "detr.model.decoder.layers."),
    (r"^decoder\.dec_bbox_head\.", "detr.model.decoder.bbox_embed."),
    (r"^decoder\.dec_score_head\.", "detr.model.decoder.class_embed."),
    (r"^decoder\.query_pos_head\.", "detr.model.decoder.query_pos_head."),
    (r"^decoder\.enc_output\.proj\.", "detr.model.enc_output.0."),
    (r"^decoder\.enc_output\.norm\.", "detr.model.enc_output.1."),
    (r"^decoder\.(denoising_class_embed|enc_score_head|enc_bbox_head)\.", r"detr.model.\1."),
)
SHARED_ATTENTION_KEYS = (
    (r"\.out_proj\.", ".o_proj."),
    (r"\.norm1\.", ".self_attn_layer_norm."),
    (r"(\.aifi\..*)\.norm2\.", r"\1.final_layer_norm."),
    (r"(\.decoder\.layers\..*)\.norm3\.", r"\1.final_layer_norm."),
    (r"\.cross_attn\.", ".encoder_attn."),
)
# transformers keeps each decoder layer's heads twice (``class_embed.i`` and ``model.decoder.class_embed.i``, tied).
TIED_COPIES = (
    ("detr.model.decoder.class_embed.", "detr.class_embed."),
    ("detr.model.decoder.bbox_embed.", "detr.bbox_embed."),
)


def _detr_families(families: Sequence[Family]) -> list[Any]:
    return [f for f in families if getattr(f, "model_type", None)]


def _plain(value: Any) -> Any:
    """Lists for tuples, floats for ints, recursively: a config read from JSON compares with one from YAML."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)


def config_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The fields of our scale's config ``ours`` that ``theirs`` sets otherwise, as 'name theirs (ours)'."""
    found = []
    for key, value in ours.items():
        other = theirs.get(key)
        if isinstance(value, Mapping) and isinstance(other, Mapping):
            found += config_differences(value, other, f"{prefix}{key}.")
        elif _plain(value) != _plain(other):
            found.append(f"{prefix}{key} {other} (ours {value})")
    return found


def nearest_scale(family: Any, fields: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The scale of ``family`` whose config differs from ``fields`` in the fewest fields, and those differences."""
    ranked = []
    for scale in family.scale_names():
        ours = family.config_of_scale(scale)["transformers"]
        ranked.append((len(diff := config_differences(ours, fields)), scale, diff))
    _, scale, diff = min(ranked)
    return scale, diff


def complete_tied(state: dict[str, torch.Tensor], pairs: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Each tied tensor under both of its names (``pairs`` of name prefixes; a file may keep one of them)."""
    for first, second in pairs:
        for key in list(state):
            for have, other in ((first, second), (second, first)):
                if key.startswith(have):
                    state.setdefault(other + key[len(have) :], state[key])
    return state


def _labels(path: Path, model_type: str) -> list[str]:
    """The class names of a folder's config (transformers' reading: a file may leave default labels out)."""
    config_class = getattr(transformers_module(), MODEL_CLASSES[model_type][0])
    id2label = config_class.from_pretrained(path, local_files_only=True).id2label
    return [str(id2label[i]) for i in range(len(id2label))]


def _hugging_face_state(path: Path, model_type: str) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder in transformers' current names: its own loader reads them (files keep
    the names of the version that wrote them, which it converts), offline; a tensor missing or left over is one
    line."""
    lib = transformers_module()
    model_class = getattr(lib, MODEL_CLASSES[model_type][1])
    try:
        model, info = model_class.from_pretrained(path, local_files_only=True, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: transformers cannot read it ({e.__class__.__name__}: {str(e).splitlines()[0]})"
        ) from e
    problems = [f"{what} {', '.join(keys[:3])}" for what, keys in info.items() if keys and what != "error_msgs"]
    if problems:
        raise UserError(f"{path}: its weights do not fit its config: {'; '.join(problems)}")
    return model.state_dict()


class HuggingFaceImporter(CheckpointImporter):
    """Folders that transformers' ``save_pretrained`` wrote for a model type of a DETR family."""

    source = "huggingface"
    title = "Hugging Face"
    possessive = "Hugging Face's"

    def read(self, path: Path, families: Sequence[Family]) -> dict[str, Any] | None:
        if not path.is_dir() or not (path / "config.json").is_file():
            return None
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{path / 'config.json'}: not readable JSON ({e.__class__.__name__})") from e
        by_type = {f.model_type: f for f in _detr_families(families)}
        family = by_type.get(config.get("model_type"))
        if family is None:
            raise UserError(
                f"{path / 'config.json'}: model type {config.get('model_type')!r} is none of the DETRs read here "
                f"({', '.join(sorted(by_type))})"
            )
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise UserError(f"{path}: no model.safetensors beside config.json")
        fields = {k: v for k, v in config.items() if k not in _CONFIG_BOOKKEEPING}
        scale, diff = nearest_scale(family, fields)
        if diff:
            LOGGER.warning(
                f"{path / 'config.json'}: no scale of {family.title}; built as its config says (nearest: "
                f"{family.name}-{scale}, differing in {'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''})"
            )
        state = {f"detr.{k}": v for k, v in _hugging_face_state(path, family.model_type).items()}
        names = _labels(path, family.model_type)
        model_cfg = {
            "family": family.name,
            "model_type": family.model_type,
            "yaml_file": path.name,
            "scale": None if diff else scale,
            "nc": len(names),
            "transformers": {k: v for k, v in fields.items() if k not in ("id2label", "label2id")},
        }
        state = complete_tied(state, family.tied_copies)
        return {"model_cfg": model_cfg, "model": state, "ema": None, "names": names, "source": self.source}


def official_state(raw: Any, path: Path) -> dict[str, torch.Tensor] | None:
    """The state dict of an official release file: ``ema.module`` when present, else ``model``; None for a file
    of another kind."""
    if not isinstance(raw, dict):
        return None
    ema = raw.get("ema")
    state = ema.get("module") if isinstance(ema, dict) else None
    state = state if isinstance(state, dict) else raw.get("model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return None
    return {k.removeprefix("module."): v for k, v in state.items()}


def official_name_to_ours(key: str, family: Any) -> str:
    """An official checkpoint's tensor name in our model's naming, by the family's table (a packed attention
    projection keeps its ``in_proj_*`` name: ``map_official`` splits it)."""
    for pattern, replacement in family.official_keys:
        key = re.sub(pattern, replacement, key)
    return key


def map_official(state: Mapping[str, torch.Tensor], family: Any) -> dict[str, torch.Tensor]:
    """Official names to ours by the family's table; packed attention projections split into q, k, v."""
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if re.match(family.official_dropped, key):
            continue
        name = official_name_to_ours(key, family)
        packed = _PACKED_QKV.match(name)
        if packed:
            for part, chunk in zip("qkv", tensor.chunk(3, 0)):
                mapped[f"{packed['owner']}.{part}_proj.{packed['kind']}"] = chunk
        else:
            mapped[name] = tensor
    return complete_tied(mapped, family.tied_copies)


def _fit(model_state: Mapping[str, Any], mapped: Mapping[str, torch.Tensor]) -> tuple[int, list[str]]:
    """How ``mapped`` fails to fill ``model_state`` (names and shapes): the count of tensors in error and a line for
    each kind; (0, []) when it fills it exactly."""
    missing = [k for k in model_state if k not in mapped and not k.endswith(("num_batches_tracked", "_extra_state"))]
    extra = [k for k in mapped if k not in model_state]
    shapes = [k for k in mapped if k in model_state and model_state[k].shape != mapped[k].shape]
    kinds = (("missing", missing), ("unknown", extra), ("of another shape", shapes))
    return len(missing) + len(extra) + len(shapes), [f"{len(v)} {what} (first {v[0]})" for what, v in kinds if v]


class OfficialDetrImporter(CheckpointImporter):
    """The official repositories' release files (D-FINE's, RT-DETRv2's ``.pth``)."""

    source = "detr_official"
    title = "the official DETR repositories"
    possessive = "the official repositories'"

    def read(self, path: Path, families: Sequence[Family]) -> dict[str, Any] | None:
        if not path.is_file():
            return None
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 (not a plain tensor file: another importer's, or refused there)
            return None
        state = official_state(raw, path)
        if state is None or "decoder.enc_score_head.weight" not in state:
            return None
        nc = int(state["decoder.enc_score_head.weight"].shape[0])
        tried = []
        for family in _detr_families(families):
            mapped = map_official(state, family)
            for scale in family.scale_names():
                cfg = family.config_of_scale(scale, nc)
                with torch.device("meta"):  # shapes only: nothing allocated or initialised
                    shapes = DetrDetector(cfg, nc).state_dict()
                errors, problems = _fit(shapes, mapped)
                if not errors:
                    names = [str(i) for i in range(nc)]
                    LOGGER.info(f"{path}: official {family.title} weights, scale {scale}, {nc} classes")
                    return {"model_cfg": cfg, "model": mapped, "ema": None, "names": names, "source": self.source}
                tried.append((errors, f"{family.name}-{scale}: {'; '.join(problems)}"))
        if not tried:
            return None
        raise UserError(f"{path}: official DETR weights of no scale here (nearest {min(tried)[1]})")
