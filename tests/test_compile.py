"""--compile: train.py's model forward through torch.compile, tested with the cheap aot_eager backend (it traces
and runs the captured graphs without generating code) on a tiny model, so the test pays little compile time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from utils.checkpoint import load_checkpoint

# Three convolutions and a one-level head: little for dynamo to trace.
TINY_CFG = """\
family: yolov5
nc: 3
depth_multiple: 1.0
width_multiple: 1.0
anchors:
  - [10,13, 16,30, 33,23]
backbone:
  [[-1, 1, Conv, [8, 3, 2]],
   [-1, 1, Conv, [16, 3, 2]],
   [-1, 1, Conv, [16, 3, 2]],
  ]
head:
  [[[2], 1, Detect, [nc, anchors]]]
"""


def _relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    names = [k for k in b if b[k].is_floating_point()]
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in names])
    return float(diff.norm() / torch.cat([b[k].double().flatten() for k in names]).norm())


@pytest.mark.slow
@pytest.mark.traces_with_dynamo
def test_compiled_forward_trains_as_eager_and_saves_plain_keys(train_here, rectangles_yaml, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_CFG)
    common = ("--data", rectangles_yaml, "--cfg", cfg, "--epochs", "2", "--noval", "--project", tmp_path)
    torch._dynamo.reset()
    counters.clear()
    status, log = train_here(*common, "--name", "compiled", "--compile", "aot_eager")
    assert status == 0, log[-3000:]
    assert "torch.compile: the model's forward with backend aot_eager" in log
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the forward: it did not run eagerly
    status, log = train_here(*common, "--name", "eager")
    assert status == 0, log[-3000:]
    compiled = load_checkpoint(tmp_path / "compiled/weights/last.pt")
    eager = load_checkpoint(tmp_path / "eager/weights/last.pt")
    for key in ("model", "ema"):  # the module's own names: no _orig_mod. prefix, loadable without compiling
        assert compiled[key].keys() == eager[key].keys(), key
    # The same 2 epochs: aot_eager runs the same kernels, decomposed, so only float rounding differs.
    assert _relative_l2(compiled["model"], eager["model"]) < 1e-4
