"""The training step never makes the host wait for the device in steady state, for every YOLO family.

Counted on the CPU across real training steps (train.py in this process, tiny models at 32 px): the operations that
would synchronise a CUDA device, seen two ways, as neither sees all of them on CPU tensors: the dispatched operators
whose result the host must read or whose size depends on the data (``_local_scalar_dense``, ``nonzero``, boolean
indexing, ...) or that make a tensor of host numbers, which CUDA copies from pageable memory (``lift_fresh``), and the Tensor methods that hand a value to Python (``.item()``, ``.cpu()``, ``bool()``, ...),
patched on torch.Tensor while a step runs. Only the read-back steps (every ``--log-interval`` steps) may have any.

The one host reading a step makes on purpose is of the batch's label rows as the loader gave them, before their copy
to the device (``labels_per_image``): checked to be given the loader's own tensor, and not counted.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import utils.engine.epoch as epoch_module
import utils.engine.step as step_module

aten = torch.ops.aten
# Operators that read a device value on the host, or whose output size depends on the data (so the host must wait to
# learn it) on CUDA.
SYNCING_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    # A tensor made from host numbers (``torch.as_tensor(8.0, device=...)``, ``t[i] = 0``, ``mask[i, j] = True``): on
    # CUDA its copy from pageable host memory waits for the device.
    aten.lift_fresh.default,
}
INDEXING_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
TENSOR_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
LOG_INTERVAL = 2
STEPS = 3  # steps 1 and 3 are steady-state steps, 2 reads back (sends; the next read-back reads what it sent)


class Enough(Exception):
    """Raised after the steps counted: the rest of the run (the epoch's end, the final validation) is not needed."""


class SyncCounter(TorchDispatchMode):
    """Records each syncing operation while ``active`` (and not ``paused``), with where in the project it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.paused = False

    def record(self, what: str) -> None:
        if self.paused:
            return
        frames = [
            f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and "tests/" not in f.filename
        ]
        where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.events.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS:
            self.record(str(func))
        elif func in INDEXING_OPS:
            indices = args[1] if len(args) > 1 else []
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.record(f"{func} with a boolean index")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted_steps(monkeypatch):
    """Counts per training step: a list of (events, whether the step read back)."""
    steps: list[tuple[list[str], bool]] = []
    loader_targets: set[int] = set()
    counter: list[SyncCounter] = []

    for name in TENSOR_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            if counter:
                counter[-1].record(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    windows = epoch_module.accumulation_windows

    def recorded_windows(*args, **kwargs):
        for window in windows(*args, **kwargs):
            loader_targets.update(id(batch[1]) for _, batch in window)
            yield window

    per_image = step_module.labels_per_image

    def host_count(targets: torch.Tensor, images: int) -> list[int]:
        assert id(targets) in loader_targets, "labels_per_image was given a tensor the loader did not yield"
        counter[-1].paused = True
        try:
            return per_image(targets, images)
        finally:
            counter[-1].paused = False

    train_step = epoch_module.train_step

    def counting_step(*args, **kwargs):
        counter.append(SyncCounter())
        try:
            with counter[-1]:
                readout = train_step(*args, **kwargs)
        finally:
            events = counter.pop().events
        steps.append((events, readout is not None))
        if len(steps) == STEPS:
            raise Enough
        return readout

    monkeypatch.setattr(epoch_module, "accumulation_windows", recorded_windows)
    monkeypatch.setattr(step_module, "labels_per_image", host_count)
    monkeypatch.setattr(epoch_module, "train_step", counting_step)
    return steps


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov8n.yaml", "yolo11n.yaml", "yolo12n.yaml", "yolo26n.yaml"])
def test_no_step_waits_for_the_device_but_the_read_back_steps(
    cfg, counted_steps, train_here, rectangles_yaml, tmp_path
) -> None:
    with pytest.raises(Enough):
        train_here(
            "--data",
            rectangles_yaml,
            "--cfg",
            cfg,
            "--imgsz",
            "32",
            "--batch-size",
            "2",
            "--epochs",
            "1",
            "--noval",
            "--log-interval",
            LOG_INTERVAL,
            "--loggers",
            "--project",
            tmp_path,
        )
    assert [read for _, read in counted_steps] == [(k + 1) % LOG_INTERVAL == 0 for k in range(STEPS)]
    for k, (events, read) in enumerate(counted_steps):
        if not read:
            assert events == [], f"{cfg} step {k + 1} waits for the device: {events}"
    # The counter sees the read-back's copy to the host (on a CPU, ``.cpu()``): it would see any other host reading.
    assert any("Tensor.cpu" in e for e in counted_steps[LOG_INTERVAL - 1][0]), counted_steps


# The DETR families' waits, each named in docs/design.md ("Where the step may and may not sync"): ours, the matcher's
# one copy of every set's costs; transformers' own, in its training forward pass (its encoder layer's finite check,
# each decoder layer's check of the deformable attention's shapes). The boxes per image come from the loader's host
# count, and the denoising queries' noise goes to the device in one pinned copy, queued without a wait.
DETR_WAITS = {
    "Tensor.cpu at detr_matcher.py": 1,
    "Tensor.numpy at detr_matcher.py": 1,
    "aten.lift_fresh.default at detr_matcher.py": 1,  # the matches back: a pinned copy on CUDA, queued, no wait
    "aten.lift_fresh.default at detr.py": 1,  # the denoising noise: a pinned copy on CUDA, queued, no wait
}
TRANSFORMERS_FILES = ("modeling_d_fine.py", "modeling_rt_detr_v2.py", "import_utils.py")


@pytest.mark.parametrize("name", ["dfine", "rtdetrv2"])
def test_a_detr_step_waits_only_where_named(name, counted_steps, train_here, rectangles_yaml, tmp_path, monkeypatch):
    """A DETR family's steady-state step waits for the device only at the named places: once for the matcher's costs
    (every decoder layer's and the encoder's, all images, in one copy), and inside transformers' forward pass."""
    pytest.importorskip("transformers", reason="the DETR families need transformers (requirements-test.txt)")
    from tests.test_detr_train import FAMILIES

    family, table = FAMILIES[name]
    monkeypatch.setattr(family, "scales", lambda: table)
    with pytest.raises(Enough):
        train_here(
            "--data", rectangles_yaml, "--cfg", f"{name}-tiny.yaml", "--imgsz", "64", "--batch-size", "2",
            "--epochs", "1", "--noval", "--log-interval", LOG_INTERVAL, "--loggers", "--project", tmp_path,
        )  # fmt: skip
    for k, (events, read) in enumerate(counted_steps):
        if read:
            continue
        ours = [e.split(":")[0] for e in events if not e.rsplit(" at ", 1)[1].startswith(TRANSFORMERS_FILES)]
        assert {e: ours.count(e) for e in ours} == DETR_WAITS, f"{name} step {k + 1}: {events}"
