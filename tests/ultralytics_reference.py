"""The committed Ultralytics fixtures (tests/fixtures/ultralytics, described in its README):
their fixed inputs and reference outputs, and how outputs are compared with them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ultralytics"
# The issue's bar: Ultralytics' own outputs within 1e-4 (+1e-5 relative), same shape.
ATOL, RTOL = 1e-4, 1e-5


def fixed_input(shape: tuple[int, int, int, int], seed: int) -> torch.Tensor:
    """The input of the reference outputs, made as it was when the fixtures were written: smooth colour fields and
    a little noise, in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    b, c, h, w = shape
    coarse = torch.rand((b, c, h // 16, w // 16), generator=generator)
    smooth = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return smooth * 0.8 + torch.rand(shape, generator=generator) * 0.2


def reference(family: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A family's fixed input (rebuilt from its seed and checked by its sum) and Ultralytics' outputs on it."""
    ref = torch.load(FIXTURES / "reference_outputs.pt", weights_only=True)[family]
    x = fixed_input(tuple(ref["input_shape"].tolist()), int(ref["input_seed"]))
    # A changed recipe moves the sum by far more than the last bits interpolation kernels may differ in.
    assert torch.isclose(x.double().sum(), ref["input_sum"], rtol=1e-7, atol=0), "the fixed input is made otherwise"
    return x, ref


def assert_close_to_ultralytics(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(expected.shape)}"
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def assert_same_end2end_detections(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """End-to-end outputs (B, k, 6): the same scores in the same (descending) order, and the same rows, where rows
    of equal score may come in either order (top-k's order among ties is its own)."""
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(expected.shape)}"
    torch.testing.assert_close(out[..., 4], expected[..., 4], atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} scores: {m}")
    tolerance = ATOL + RTOL * expected.abs().amax(-1, keepdim=True)  # (B, k, 1) per expected row
    gaps = (out[:, None, :, :] - expected[:, :, None, :]).abs().amax(-1)  # (B, k expected, k out)
    assert (gaps.amin(2, keepdim=True) <= tolerance).all(), f"{what}: a row of Ultralytics' output is missing"
    assert (gaps.amin(1) <= tolerance.transpose(1, 2).amax(1)).all(), f"{what}: a row not in Ultralytics' output"
