"""Mixed precision and channels-last change speed, not results."""

from __future__ import annotations

import torch

from models.families import YOLOV5
from models.loss import ComputeLoss
from models.yolo import Model
from utils.amp import autocast, choose_precision, cpu_supports_bf16


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    imgs = torch.rand(4, 3, 128, 128, generator=g)
    n = 12
    targets = torch.zeros(n, 6)
    targets[:, 0] = torch.arange(n) % 4
    targets[:, 1] = torch.randint(0, 3, (n,), generator=g).float()
    targets[:, 2:4] = torch.rand(n, 2, generator=g) * 0.6 + 0.2
    targets[:, 4:6] = torch.rand(n, 2, generator=g) * 0.3 + 0.05
    return imgs, targets


def test_choose_precision_policy() -> None:
    assert not choose_precision(torch.device("cpu"), requested=False).enabled
    cuda = choose_precision(torch.device("cuda"), requested=True)
    assert cuda.dtype == torch.float16 and cuda.needs_scaler
    cpu = choose_precision(torch.device("cpu"), requested=True)
    assert cpu.dtype == (torch.bfloat16 if cpu_supports_bf16() else None)
    assert not cpu.needs_scaler


def test_bf16_autocast_loss_matches_fp32_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml", nc=3)
    compute_loss = ComputeLoss(model, YOLOV5.read_hyp(YOLOV5.default_hyp_path))
    imgs, targets = _batch()
    fp32_loss, fp32_items = compute_loss(model(imgs), targets)
    precision = choose_precision(torch.device("cpu"), requested=True)
    if not precision.enabled:  # still exercise bf16 autocast: it is correct, only slower, without native bf16
        precision = type(precision)(torch.bfloat16, "forced for the test")
    with autocast(torch.device("cpu"), precision):
        preds = model(imgs)
        amp_loss, amp_items = compute_loss(preds, targets)
    assert preds[0].dtype == torch.bfloat16 and amp_loss.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: the loss agrees to about 1%.
    assert torch.allclose(amp_items, fp32_items, rtol=0.02, atol=1e-4)
    assert abs(amp_loss.item() - fp32_loss.item()) / fp32_loss.item() < 0.02


def test_channels_last_gives_the_same_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    nchw = Model("models/yolov5n.yaml", nc=3)
    nhwc = Model("models/yolov5n.yaml", nc=3)
    nhwc.load_state_dict(nchw.state_dict())
    nhwc = nhwc.to(memory_format=torch.channels_last)
    imgs, targets = _batch(1)
    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    out_a = nchw(imgs)
    out_b = nhwc(imgs.contiguous(memory_format=torch.channels_last))
    for a, b in zip(out_a, out_b):  # float rounding only: to 1e-4 of the outputs' scale (any thread count)
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    ComputeLoss(nchw, hyp)(out_a, targets)[0].backward()
    ComputeLoss(nhwc, hyp)(out_b, targets)[0].backward()
    for (name, pa), pb in zip(nchw.named_parameters(), nhwc.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-3, rtol=1e-3), name
    nchw.eval(), nhwc.eval()
    with torch.no_grad():
        assert torch.allclose(nchw(imgs)[0], nhwc(imgs.contiguous(memory_format=torch.channels_last))[0], atol=1e-3)
