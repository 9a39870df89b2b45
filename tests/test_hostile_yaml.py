"""The YAML files users hand us besides the data YAML (hyp, model and export metadata files) are read in bounded time
and end in one line, whatever they hold: the inputs bench/fuzz_readers.py found (seed 11) and their kind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from models.families import family_of
from models.yolo import Model
from utils.errors import UserError
from utils.formats.metadata import METADATA_YAML, ModelMeta

HYP = (Path(__file__).resolve().parents[1] / "data/hyps/hyp.scratch-low.yaml").read_text()
DEEP = "[" * 3000 + "]" * 3000
LAYERS = "backbone:\n  - [-1, 1, Conv, [16, 3, 2]]\nhead:\n  - [-1, 1, Conv, [16, 3, 1]]\n"


def _hyp(tmp_path: Path, text: str) -> None:
    (tmp_path / "hyp.yaml").write_text(text)
    family_of("yolov5").read_hyp(tmp_path / "hyp.yaml")


def _metadata(tmp_path: Path, text: str) -> None:
    folder = tmp_path / "m_openvino_model"
    folder.mkdir()
    (folder / METADATA_YAML).write_text(text)
    ModelMeta.from_yaml(folder, "openvino")


def _model(tmp_path: Path, text: str) -> None:
    (tmp_path / "tinyn.yaml").write_text(text)
    Model(str(tmp_path / "tinyn.yaml"))


@pytest.mark.parametrize(
    "read, text, words",
    [
        (_hyp, HYP + "mixup: " + DEEP + "\n", "nested more than 50 levels"),
        (_hyp, HYP.replace("lr0: 0.01", "lr0: 1" + "0" * 400), "'lr0' must be a finite number"),
        (_hyp, HYP + "null: 1\n7: 2\n", "are not hyper-parameters"),
        (_metadata, "names: " + DEEP + "\n", "nested more than 50 levels"),
        (_model, "nc: 2\n" + LAYERS.replace("[-1, 1, Conv, [16, 3, 2]]", "[0, 1, Conv, [16, 3, 2]]", 1), "'from'"),
        (_model, "nc: 2\nanchors: 3\n" + LAYERS + "  - [[1], 1, Detect, [nc, 1000000000]]\n", "anchors per level"),
    ],
    ids=[
        "hyp-deep",
        "hyp-huge-integer",
        "hyp-null-and-number-keys",
        "metadata-deep",
        "model-layer-0-from-itself",
        "model-a-billion-anchors",
    ],
)
def test_a_hostile_yaml_is_one_line_in_bounded_time(tmp_path: Path, read, text: str, words: str) -> None:
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        read(tmp_path, text)
    assert time.monotonic() - start < 10
    message = str(e.value)
    assert words in message and "\n" not in message, message
