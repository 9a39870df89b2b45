"""The CUDA paths: fp16 autocast with a gradient scaler, NCCL, exact resume, and val/detect/export on a GPU.

These run only where CUDA is available (CI has no GPU: there they are skipped, not passed). On a GPU machine:

    python -m pytest -q -n 0 tests/test_cuda.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import export
import val
from tests.conftest import ROOT, free_port, write_rectangles_dataset
from tests.test_train import results_rows
from tests.ultralytics_reference import FIXTURES, reference
from utils.checkpoint import load_checkpoint
from utils.formats import open_runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# 64 px, batch 8, on the GPU; a fresh process per run, as a user starts one.
TINY_CUDA = ["--imgsz", "64", "--batch-size", "8", "--workers", "0", "--device", "0", "--noplots"]


def _train(*args: str, nproc: int = 0, devices: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            f"--master_port={free_port()}",
        ]
        if nproc
        else [sys.executable]
    )
    cmd = [*launcher, "train.py", *TINY_CUDA, *map(str, args)]
    if nproc:
        cmd[cmd.index("--device") + 1] = devices or ",".join(str(i) for i in range(nproc))
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def _differing_tensors(a: dict, b: dict) -> list[str]:
    return [k for k in b if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov8n.yaml", "yolo11n.yaml", "yolo12n.yaml", "yolo26n.yaml"])
def test_each_family_trains_on_the_gpu_in_fp16_with_a_gradient_scaler(rectangles_yaml, tmp_path, cfg) -> None:
    run = _train("--data", rectangles_yaml, "--cfg", cfg, "--epochs", "3", "--project", tmp_path, "--name", "exp")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "fp16 autocast with a gradient scaler on CUDA" in log
    rows = results_rows(tmp_path / "exp")
    assert len(rows) == 3
    losses = [float(v) for r in rows for k, v in r.items() if k.startswith("train/")]
    assert losses and all(np.isfinite(losses)) and all(v > 0 for v in losses)
    ckpt = load_checkpoint(tmp_path / "exp/weights/last.pt")
    assert ckpt["scaler"] and ckpt["scaler"]["scale"] > 0  # the scaler's state is saved for an exact resume
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def test_resume_on_the_gpu_continues_the_same_run(rectangles_yaml, tmp_path) -> None:
    """--deterministic on CUDA: 2 epochs straight, and 1 epoch then a resume, end with the same weights."""
    common = ["--data", rectangles_yaml, "--cfg", "yolo11n.yaml", "--deterministic", "--seed", "3", "--noval"]
    straight = _train(*common, "--epochs", "2", "--project", tmp_path / "straight", "--name", "exp")
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    first = _train(*common, "--epochs", "2", "--save-period", "1", "--project", tmp_path / "cut", "--name", "exp")
    assert first.returncode == 0
    cut = tmp_path / "cut/exp/weights"
    shutil.copyfile(cut / "epoch0.pt", cut / "last.pt")
    resumed = _train("--resume", cut / "last.pt")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    a, b = load_checkpoint(cut / "last.pt"), load_checkpoint(tmp_path / "straight/exp/weights/last.pt")
    assert a["epoch"] == b["epoch"] == 1
    for key in ("model", "ema"):
        assert not _differing_tensors(a[key], b[key]), key


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two ranks need two GPUs")
def test_ddp_with_nccl_trains(rectangles_yaml, tmp_path) -> None:
    nproc = torch.cuda.device_count()
    run = _train(
        "--data",
        rectangles_yaml,
        "--cfg",
        "yolo26n.yaml",
        "--epochs",
        "2",
        "--sync-bn",
        "--project",
        tmp_path,
        "--name",
        "exp",
        nproc=nproc,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert f"DDP: world size {nproc}, backend nccl" in log
    assert len(results_rows(tmp_path / "exp")) == 2


def test_two_ranks_share_one_gpu_over_gloo_with_sync_bn(rectangles_yaml, tmp_path) -> None:
    # NCCL refuses two ranks on one device; '--device 0,0' puts both on GPU 0 and joins them over gloo, whose
    # all-reduce SyncBN (utils/sync_bn.py) then runs on CUDA tensors.
    run = _train(
        "--data",
        rectangles_yaml,
        "--cfg",
        "yolo11n.yaml",
        "--epochs",
        "2",
        "--sync-bn",
        "--project",
        tmp_path,
        "--name",
        "exp",
        nproc=2,
        devices="0,0",
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "DDP: world size 2, backend gloo" in log and "on cuda:0" in log
    rows = results_rows(tmp_path / "exp")
    assert len(rows) == 2 and all(np.isfinite(float(v)) for r in rows for k, v in r.items() if k.startswith("train/"))


def test_val_detect_and_export_on_the_gpu_in_fp16(tmp_path) -> None:
    # The fixture predicts 20 classes: a rectangles set whose YAML names 20 (two of them drawn).
    rectangles_yaml = write_rectangles_dataset(tmp_path / "data")
    rectangles_yaml.write_text(
        f"path: {rectangles_yaml.parent}\ntrain: images/train\nval: images/val\n"
        f"names: {[f'class{i}' for i in range(20)]}\n"
    )
    weights = tmp_path / "yolo11-final.pt"
    shutil.copyfile(FIXTURES / "yolo11-final.pt", weights)  # trained by Ultralytics, fp16 as it is stored
    x, ref = reference("yolo11")
    model = open_runner(weights, device="cuda:0")
    with torch.no_grad():
        out = model(x.cuda()).float().cpu()
    # TF32 convolutions and cuDNN's kernels round otherwise than the CPU's; boxes are in input pixels.
    torch.testing.assert_close(out, ref["pred"], atol=2e-2, rtol=1e-3)

    options = {
        "data": str(rectangles_yaml),
        "weights": str(weights),
        "imgsz": 64,
        "batch_size": 8,
        "workers": 0,
        "device": "0",
        "noplots": True,
        "project": str(tmp_path),
    }
    plain, half = val.run(**options), val.run(**options, half=True)
    assert plain.n_images == half.n_images == 8
    assert abs(plain.map50 - half.map50) < 0.05

    found = detect.run(
        weights=str(weights),
        source=str(Path(rectangles_yaml).parent / "images/val"),
        imgsz=64,
        device="0",
        half=True,
        project=str(tmp_path),
        name="detect",
    )
    assert len(found.detections) == 8

    files = export.run(
        weights=str(weights),
        imgsz=list(x.shape[2:]),
        batch_size=x.shape[0],
        include=["onnx", "torchscript"],
        device="0",
        half=True,
    )
    assert {p.suffix for p in files} == {".onnx", ".torchscript"}
    runner = open_runner(next(p for p in files if p.suffix == ".torchscript"), device="cuda:0")
    assert runner.meta.layout == "anchor_free"
    with torch.no_grad():
        got = runner(x.cuda().half()).float().cpu()
    # export.py's own fp16 rule (utils/evaluation/gate.py check_numerics), against Ultralytics' fp32 output on the CPU.
    from utils.evaluation.gate import check_numerics

    check_numerics(got, ref["pred"], "anchor_free", "fp16")
