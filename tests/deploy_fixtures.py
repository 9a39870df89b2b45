"""Session fixtures of the deploy tests (export, formats, val.py and detect.py on exported files), shared through
tests/conftest.py so that every test module, the format modules' included, uses the same files.

* ``deploy_data``: the generated rectangles set the narrow checkpoints were trained on (its data YAML);
* ``trained``: a narrow trained checkpoint per output layout (``yolov5``, ``anchor_free``, ``end2end``), copied
  into a session folder so exports land beside it; the end-to-end one is YOLO26, exported with ``end2end=True``;
* ``exported_onnx``: each layout's fp32 ONNX (dynamic batch), exported once.

The checkpoints are tests/fixtures/deploy/*.pt, written by tests/fixtures/deploy/make_checkpoints.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deploy"
# The rectangles set the checkpoints were trained on (tests/conftest.py: write_rectangles_dataset).
DATASET = {"n_train": 32, "n_val": 16, "size": 96, "n_classes": 2, "seed": 0}
IMGSZ = 64
CHECKPOINTS = {"yolov5": "narrow_yolov5.pt", "yolo11": "narrow_yolo11.pt", "yolo26": "narrow_yolo26.pt"}
LAYOUTS = {"yolov5": "yolov5", "anchor_free": "yolo11", "end2end": "yolo26"}  # layout: the checkpoint giving it


def write_dataset(root: Path) -> Path:
    from tests.conftest import write_rectangles_dataset

    return write_rectangles_dataset(root, **DATASET)


def assert_same_rows(
    got: np.ndarray, expected: np.ndarray, atol: float | list[float], rtol: float = 0.0, err_msg: str = ""
) -> None:
    """Detections (n, 6+) equal row for row within ``atol`` (one value, or one per column) + ``rtol`` x |expected|, in
    any order: rows of equal or nearly equal score come from top-k or a sort in either order, and a change in the
    last bit of a score may swap them."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape, err_msg)
    if got.ndim == 3:  # a batch
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_rows(g, e, atol, rtol, f"{err_msg} image {i}")
        return
    close = np.all(np.abs(got[:, None] - expected[None]) <= np.asarray(atol) + rtol * np.abs(expected[None]), axis=2)
    free = np.ones(len(got), bool)
    for j in np.argsort(-expected[:, 4], kind="stable"):
        match = np.flatnonzero(close[:, j] & free)
        assert len(match), f"{err_msg}: no row within tolerance of {expected[j]} among {got[free]}"
        free[match[0]] = False


def end2end(layout: str) -> bool:
    """Whether a layout's checkpoint runs and exports with ``end2end=True``."""
    return layout == "end2end"


@pytest.fixture(scope="session")
def deploy_data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("deploy_data"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("deploy_weights")
    out = {}
    for layout, key in LAYOUTS.items():
        out[layout] = folder / layout / CHECKPOINTS[key]
        out[layout].parent.mkdir()
        shutil.copyfile(FIXTURES / CHECKPOINTS[key], out[layout])
    return out


class _ExportedOnce(dict):
    """A layout's fp32 ONNX, exported on first use, once per test process."""

    def __init__(self, trained: dict[str, Path]):
        super().__init__()
        self.trained = trained

    def __missing__(self, layout: str) -> Path:
        import export

        (path,) = export.run(weights=str(self.trained[layout]), include=["onnx"], dynamic=True, end2end=end2end(layout))
        self[layout] = path
        return path


@pytest.fixture(scope="session")
def exported_onnx(trained) -> dict[str, Path]:
    return _ExportedOnce(trained)
