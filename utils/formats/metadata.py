"""What an exported file says about itself, and where each format keeps it.

Every exported file carries its metadata twice: under the keys and value forms Ultralytics' exporter writes
(``names`` as ``{0: 'person', ...}``, ``stride``, ``task``, ``batch``, ``imgsz``, ``end2end``, ``args``, ...), so
applications written for its files read ours, and this project's own record as JSON under ``yolo_train``.
Reading falls back, in order, to Ultralytics' keys and to the flat JSON record of older exports of this project
(which were all YOLOv5-layout files).

Where the metadata lives depends on the format: ONNX ``metadata_props`` (values as ``str()`` of Python literals);
a ``config.txt`` extra file in TorchScript (JSON); ``metadata.yaml`` inside an export folder (OpenVINO, NCNN);
each format module calls the reader and writer of its place here.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import yaml

from models.families import UNRECORDED_EXPORT_FAMILY, known_layouts, ultralytics_export_family
from utils.cli import INFERENCE_IMGSZ
from utils.errors import UserError, first_line
from utils.log import LOGGER
from utils.yaml_reader import load_yaml

OWN_METADATA_KEY = "yolo_train"  # this project's record among the exported metadata
METADATA_YAML = "metadata.yaml"  # inside an export folder, as Ultralytics writes it
LAYOUTS = known_layouts()
PRECISIONS = ("fp32", "fp16", "int8")
MAX_STRIDE = 1024  # a detector's largest stride is 32 or 64; anything past this is not a stride
MAX_SIDE = 65536  # an exported input's side or batch


@dataclass
class ModelMeta:
    """What an inference caller needs besides the network."""

    names: list[str]
    stride: int
    kind: str  # the format's name: "pytorch", "onnx", "torchscript", ...
    imgsz: tuple[int, int] | None = None  # (h, w) the file only accepts, None when any multiple of the stride fits
    batch: int | None = None  # the batch size the file only accepts, None when any
    family: str = UNRECORDED_EXPORT_FAMILY.name  # the family's name; for files exported before it was recorded
    layout: str = UNRECORDED_EXPORT_FAMILY.layouts[0]  # see LAYOUTS: (B, A, 5 + nc), (B, 4 + nc, A) or (B, k, 6)
    trained_imgsz: int | None = None  # the image size a .pt was trained at, when its checkpoint says
    precision: str = "fp32"  # of the file's weights and arithmetic: fp32, fp16 or int8
    nms: dict[str, float] | None = None  # NMS inside the graph: {"conf": .., "iou": .., "max_det": ..}
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nc(self) -> int:
        return len(self.names)

    def copy(self, **changes: Any) -> ModelMeta:
        return replace(self, **changes)

    def own_record(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "stride": self.stride,
            "imgsz": self.imgsz,
            "batch": self.batch,
            "family": self.family,
            "layout": self.layout,
            "precision": self.precision,
            "nms": self.nms,
            "producer": "yolo-train export.py",
            **self.extra,
        }

    def ultralytics_style(self, export_batch: int) -> dict[str, Any]:
        """The metadata keys and values Ultralytics' exporter writes for a detection model."""
        args: dict[str, Any] = {
            "batch": export_batch,
            "half": self.precision == "fp16",
            "int8": self.precision == "int8",
            "dynamic": self.batch is None,
            "nms": self.nms is not None,
        }
        if self.nms is not None:
            args.update(conf=self.nms["conf"], iou=self.nms["iou"], max_det=int(self.nms["max_det"]))
        return {
            "description": f"{self.family} detection model exported by yolo-train export.py",
            "author": "yolo-train",
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "version": "yolo-train",
            "stride": self.stride,
            "task": "detect",
            "batch": export_batch,
            "imgsz": list(self.imgsz) if self.imgsz else None,
            "names": dict(enumerate(self.names)),
            "args": args,
            "channels": 3,
            "end2end": self.layout == "end2end",
        }

    def to_json(self, export_batch: int = 1) -> str:
        """JSON holding Ultralytics' keys (as its exporter writes them) and ours: TorchScript's extra file."""
        return json.dumps({**self.ultralytics_style(export_batch), OWN_METADATA_KEY: self.own_record()})

    def onnx_props(self, export_batch: int = 1) -> dict[str, str]:
        """ONNX metadata_props: Ultralytics' keys with values as ``str()`` of Python values (as it writes them,
        read back there with ``ast.literal_eval``), and ours as JSON."""
        props = {k: str(v) for k, v in self.ultralytics_style(export_batch).items()}
        return {**props, OWN_METADATA_KEY: json.dumps(self.own_record())}

    def write_yaml(self, folder: Path, export_batch: int = 1) -> Path:
        """``metadata.yaml`` in an export folder (OpenVINO, NCNN, ...), where Ultralytics' apps look for it."""
        path = Path(folder) / METADATA_YAML
        record = {**self.ultralytics_style(export_batch), OWN_METADATA_KEY: json.dumps(self.own_record())}
        path.write_text(yaml.safe_dump(record, sort_keys=False, allow_unicode=True), encoding="utf-8")
        return path

    @classmethod
    def from_record(cls, raw: dict[str, Any], kind: str, path: Path) -> ModelMeta:
        """From this project's record, or the flat JSON of files exported before it had one (YOLOv5 layout)."""
        try:
            names, stride = [str(n) for n in raw["names"]], _whole(raw["stride"], "stride", MAX_STRIDE)
            imgsz = tuple(_whole(v, "imgsz", MAX_SIDE) for v in raw["imgsz"]) if raw.get("imgsz") else None
            batch = _whole(raw["batch"], "batch", MAX_SIDE) if raw.get("batch") else None
            family = str(raw.get("family", UNRECORDED_EXPORT_FAMILY.name))
            layout = str(raw.get("layout", UNRECORDED_EXPORT_FAMILY.layouts[0]))
            precision = str(raw.get("precision") or "fp32")
            nms = {k: float(v) for k, v in raw["nms"].items()} if raw.get("nms") else None
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise UserError(
                f"{path}: metadata unreadable ({e.__class__.__name__}: {e}); re-export it with export.py"
            ) from None
        if layout not in LAYOUTS:
            raise UserError(f"{path}: unknown output layout {layout!r} in its metadata (known: {', '.join(LAYOUTS)})")
        known = {f.name for f in fields(cls)} | {"producer"}
        extra = {k: v for k, v in raw.items() if k not in known}
        return cls(
            names=names,
            stride=stride,
            kind=kind,
            imgsz=cast("tuple[int, int] | None", imgsz),  # (h, w) as the file wrote it
            batch=batch,
            family=family,
            layout=layout,
            precision=precision,
            nms=nms,
            extra=extra,
        )

    @classmethod
    def from_json(cls, text: str, kind: str, path: Path) -> ModelMeta:
        """From JSON: our record; else Ultralytics' keys; else older exports' flat record."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise UserError(f"{path}: metadata unreadable ({e}); re-export it with export.py") from e
        if not isinstance(raw, dict):
            raise UserError(f"{path}: metadata unreadable (not a JSON object); re-export it with export.py")
        return cls.from_mapping(raw, kind, path)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any], kind: str, path: Path) -> ModelMeta:
        """From parsed metadata (JSON or YAML): our record when present, else Ultralytics' keys, else a flat
        record of an older export."""
        if OWN_METADATA_KEY in raw:
            own = raw[OWN_METADATA_KEY]
            return cls.from_json(own, kind, path) if isinstance(own, str) else cls.from_record(own, kind, path)
        return cls.from_ultralytics(raw, kind, path) if "task" in raw else cls.from_record(raw, kind, path)

    @classmethod
    def from_yaml(cls, folder: Path, kind: str) -> ModelMeta:
        """From ``metadata.yaml`` in an export folder (ours, or Ultralytics')."""
        path = Path(folder) / METADATA_YAML
        if not path.is_file():
            raise UserError(f"{folder}: no {METADATA_YAML} in it; export it with export.py")
        try:
            raw = load_yaml(path.read_text(encoding="utf-8"), "export metadata")
        except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:  # ValueError: a 5000-digit integer too
            raise UserError(f"{path}: metadata unreadable ({first_line(e)})") from e
        if not isinstance(raw, dict):
            raise UserError(f"{path}: metadata unreadable (not a mapping)")
        return cls.from_mapping(raw, kind, path)

    @classmethod
    def from_onnx_props(cls, props: dict[str, str], path: Path) -> ModelMeta:
        """From our record; else the flat JSON values of older exports; else Ultralytics' own props."""
        if OWN_METADATA_KEY in props:
            return cls.from_json(props[OWN_METADATA_KEY], "onnx", path)
        if not props.get("names"):
            raise UserError(f"{path}: no class names in its metadata; export it with export.py")
        try:
            return cls.from_record(
                {k: json.loads(v) for k, v in props.items() if k in ("names", "stride", "imgsz", "batch")}, "onnx", path
            )
        except ValueError:  # not JSON: Ultralytics' exporter writes Python literals
            pass
        try:  # literal_eval reads literals only, never calls anything
            values = {
                k: ast.literal_eval(v) if k in ("names", "imgsz", "end2end", "args") else v for k, v in props.items()
            }
        except (ValueError, SyntaxError) as e:
            raise UserError(f"{path}: metadata unreadable ({e.__class__.__name__}: {e})") from e
        return cls.from_ultralytics(values, "onnx", path)

    @classmethod
    def from_ultralytics(cls, values: dict[str, Any], kind: str, path: Path) -> ModelMeta:
        """From the metadata Ultralytics' exporter writes, its values already parsed."""
        task = values.get("task", "detect")
        if task != "detect":
            raise UserError(f"{path}: an Ultralytics {task} model; only detection models are supported")
        names = values.get("names")
        if isinstance(names, dict):  # {0: 'person', ...}; JSON makes the keys strings
            try:
                names = [names[k] for k in sorted(names, key=int)]
            except (TypeError, ValueError) as e:
                raise UserError(f"{path}: metadata names keyed by other than class indices ({first_line(e)})") from e
        args: dict[str, Any] = values["args"] if isinstance(values.get("args"), dict) else {}
        family = ultralytics_export_family(str(values.get("description", ""))).name
        end2end = values.get("end2end") in (True, "True") or args.get("nms") in (True, "True")
        nms = (
            {"conf": args.get("conf") or 0.25, "iou": args.get("iou") or 0.7, "max_det": args.get("max_det") or 300}
            if args.get("nms") in (True, "True")
            else None
        )
        precision = (
            "int8" if args.get("int8") in (True, "True") else "fp16" if args.get("half") in (True, "True") else "fp32"
        )
        return cls.from_record(
            {
                "names": names,
                "stride": values.get("stride", 32),
                "imgsz": values.get("imgsz"),
                "batch": None if args.get("dynamic") else values.get("batch"),
                "family": family,
                "layout": "end2end" if end2end else "anchor_free",
                "precision": precision,
                "nms": nms,
            },
            kind,
            path,
        )


def _whole(value: Any, key: str, high: int) -> int:
    """A metadata number that must be a whole number in [1, high] (a stride of 0 or infinity would divide image
    sizes by nothing); ValueError naming the key otherwise."""
    number = float(value)  # "32", 32 and 32.0 alike; inf and nan pass here and fail below
    if not (math.isfinite(number) and number.is_integer() and 1 <= number <= high):
        raise ValueError(f"{key} {value!r} is not a whole number in [1, {high}]")
    return int(number)


def default_imgsz(meta: ModelMeta) -> tuple[int, str]:
    """The inference size when --imgsz is left out, and where it comes from (for the one log line)."""
    if meta.imgsz is not None:
        return max(meta.imgsz), "from the exported file"
    if meta.trained_imgsz is not None:
        return meta.trained_imgsz, "from the checkpoint"
    return INFERENCE_IMGSZ, "the default; the checkpoint does not record its training size"


def inference_imgsz(meta: ModelMeta, asked: int | list[int] | None, weights: str | Path = "") -> tuple[int, int]:
    """The input size (h, w) of inference with ``meta``'s model: the one policy of val.py, detect.py, export.py and
    the predictor (docs/deploy.md, "Image size"). ``asked`` is ``--imgsz``: one size, ``[size]`` or ``[h, w]``.

    Left out, it is the size the model was trained at, else 640 (logged). A size that is not a multiple of the stride
    is raised to the next multiple, with a warning. An exported file with a fixed input shape runs at that shape
    whatever was asked (logged when it differs)."""
    if asked is None:
        size, source = default_imgsz(meta)
        LOGGER.info(f"image size {size} ({source})")
        asked = [size]
    sizes = [asked] if isinstance(asked, int) else list(asked)
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise UserError(f"--imgsz {' '.join(map(str, sizes))}: give one size or two (h w), each at least 1 pixel")
    stride = int(meta.stride)
    raised = [-(-s // stride) * stride for s in sizes]
    if raised != sizes:
        shown = " ".join(map(str, sizes))
        LOGGER.warning(
            f"image size {shown} is not a multiple of the stride {stride}: using {' '.join(map(str, raised))}"
        )
    h, w = raised * 2 if len(raised) == 1 else raised
    if meta.imgsz is not None:
        fixed = (int(meta.imgsz[0]), int(meta.imgsz[1]))
        if fixed != (h, w):
            LOGGER.info(f"{weights or 'the model'}: exported for {fixed[0]}x{fixed[1]} input; using that size")
        return fixed
    return h, w
