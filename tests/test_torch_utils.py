from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import fork_ranks

import utils.data.yolo_labels as label_cache
from models.yolo import Model
from utils.distributed import WaitAbandoned, dist_info
from utils.ema import ModelEMA
from utils.errors import UserError
from utils.optimizer import build_optimizer
from utils.process import visible_devices
from utils.sync_bn import CpuSyncBatchNorm, convert_sync_batchnorm
from utils.torch_utils import (
    init_torch_seeds,
    local_ranks_share_a_gpu,
    select_device,
    time_synchronized,
    torch_distributed_zero_first,
)


def test_select_device_cpu_and_default(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    assert select_device("cpu").type == "cpu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert select_device("").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_select_device_missing_cuda_names_what_is_available(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserError, match=r"0,1.*0 CUDA device\(s\) are available"):
        select_device("0,1")
    with pytest.raises(UserError, match="not valid"):
        select_device("gpu")


def _pretend_gpus(monkeypatch, count: int) -> None:
    """CUDA with ``count`` GPUs as select_device sees it, none visible by CUDA_VISIBLE_DEVICES yet: no GPU needed."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"name": "fake", "total_memory": 1})()
    )


def test_select_device_picks_the_gpu_of_the_local_rank(monkeypatch) -> None:
    # A node of a 2-node run: 8 ranks in all, 4 on this machine; no GPU is needed to check the choice.
    _pretend_gpus(monkeypatch, 4)
    assert select_device("0,1,2,3", local_rank=3, local_world_size=4) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert visible_devices("2,3") == "CUDA_VISIBLE_DEVICES=2,3 (from --device; set before CUDA starts)"  # start-up
    assert select_device("2,3", local_rank=0, local_world_size=2) == torch.device("cuda", 0)  # GPU 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(UserError, match="names 2 GPU.*for 4 processes"):
        select_device("2,3", local_rank=0, local_world_size=4)


def test_a_node_of_a_multi_node_run_checks_devices_against_its_own_ranks(monkeypatch) -> None:
    # What torch.distributed.run sets on the second node of `--nnodes 2 --nproc_per_node 4`.
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("LOCAL_RANK", "2")
    info = dist_info()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (6, 2, 8, 4)
    _pretend_gpus(monkeypatch, 4)
    device = select_device("0,1,2,3", local_rank=info.local_rank, local_world_size=info.local_world_size)
    assert device == torch.device("cuda", 2)  # 4 GPUs for the node's 4 ranks, not for all 8


def test_two_ranks_can_share_one_gpu_over_gloo(monkeypatch) -> None:
    # '--device 0,0' under `--nproc_per_node 2`: GPU 0 is made visible once (CUDA stops reading the list at a repeated
    # id) and both ranks take it; NCCL refuses two ranks on one device, so they join over gloo.
    _pretend_gpus(monkeypatch, 1)
    assert visible_devices("0,0") == "CUDA_VISIBLE_DEVICES=0 (from --device; set before CUDA starts)"
    assert [select_device("0,0", local_rank=r, local_world_size=2) for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # '3,3': the one visible GPU is index 0
    assert select_device("3,3", local_rank=1, local_world_size=2) == torch.device("cuda", 0)
    assert local_ranks_share_a_gpu("0,0", 2) and local_ranks_share_a_gpu("1,1,2,2", 4)
    assert not any(local_ranks_share_a_gpu(d, 2) for d in ("0,1", "cpu", "", "0"))
    # Outside an NCCL group --sync-bn takes the all-reduce BatchNorm, which runs over gloo on the GPU too. It is made
    # where the model already is (the meta device and float64 stand in for a GPU here): DDP refuses a model whose
    # parameters sit on two devices, as the first two-rank run on one GPU found.
    bn = convert_sync_batchnorm(
        nn.Sequential(nn.BatchNorm2d(4, device="meta", dtype=torch.float64)), torch.device("cuda", 0)
    )
    assert isinstance(bn[0], CpuSyncBatchNorm)
    assert {(t.device.type, t.dtype) for t in (*bn.parameters(), bn[0].running_mean, bn[0].running_var)} == {
        ("meta", torch.float64)
    }
    assert bn[0].num_batches_tracked.device.type == "meta"


def test_init_torch_seeds_repeats_random_streams() -> None:
    init_torch_seeds(7)
    a = torch.rand(3)
    init_torch_seeds(7)
    assert torch.equal(a, torch.rand(3))


def test_time_synchronized_syncs_cuda_before_reading_the_monotonic_clock(monkeypatch) -> None:
    """With CUDA in use, the queued work is waited for first and the clock read after; the clock is perf_counter
    (monotonic, not the wall clock a system's time change moves); without CUDA in use nothing is synchronised."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(time, "perf_counter", lambda: calls.append("perf_counter") or 123.5)
    monkeypatch.setattr(time, "time", lambda: calls.append("time") or -1.0)
    assert time_synchronized() == 123.5
    assert calls == ["synchronize", "perf_counter"]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CUDA present but unused: not initialised
    assert time_synchronized() == 123.5 and calls == ["perf_counter"]


def test_optimizer_groups_keep_decay_off_norms_and_biases() -> None:
    model = Model("models/yolov5n.yaml", nc=2)
    opt = build_optimizer(model, "SGD", lr=0.01, momentum=0.9, decay=5e-4)
    biases, weights, norms = opt.param_groups
    assert biases["weight_decay"] == 0 and norms["weight_decay"] == 0 and weights["weight_decay"] == 5e-4
    n_bn = sum(1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert len(norms["params"]) == n_bn
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert isinstance(build_optimizer(model, "AdamW"), torch.optim.AdamW)
    with pytest.raises(UserError):
        build_optimizer(model, "Lion")


def test_model_ema_ramps_decay_and_tracks_weights() -> None:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema = ModelEMA(model, decay=0.9, tau=1.0)
    assert ema.decay() == 0.0
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)  # the first update uses decay 0.9 * (1 - e^-1)
    d = 0.9 * (1 - torch.exp(torch.tensor(-1.0)))
    assert ema.updates == 1
    assert torch.allclose(ema.ema.weight, torch.full((1, 2), float(1 - d)), atol=1e-6)
    for _ in range(200):
        ema.update(model)
    assert torch.allclose(ema.ema.weight, torch.ones(1, 2), atol=1e-4)
    assert ema.decay() == pytest.approx(0.9, abs=1e-6)


def _zero_first_worker(rank: int, log_file: str, images: str) -> None:
    dist.init_process_group("gloo")
    info = dist_info()
    events = []
    with torch_distributed_zero_first(info.local_rank):
        events.append(("enter", time.time()))
        if rank == 0:
            time.sleep(1.5)  # rank 1 must not enter while rank 0 is in here
        events.append(("leave", time.time()))
    scans = []
    real_scan = label_cache.scan
    label_cache.scan = lambda *a, **k: scans.append(1) or real_scan(*a, **k)
    with torch_distributed_zero_first(info.local_rank):  # as train.py prepares the data
        label_set = label_cache.load_split(images, nc=2, workers=1, verbose=False)
    events += [("scans", len(scans)), ("images", len(label_set.im_files))]
    with open(f"{log_file}.{rank}", "w") as f:
        json.dump(events, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_zero_first_makes_rank_1_wait_for_rank_0_and_reuse_its_label_cache(rectangles_yaml, tmp_path) -> None:
    log_file = str(tmp_path / "events")
    # A copy of its own: the shared set's label cache may already have been built by another test.
    images = tmp_path / "images" / "val"
    shutil.copytree(rectangles_yaml.parent / "images" / "val", images)
    shutil.copytree(rectangles_yaml.parent / "labels" / "val", tmp_path / "labels" / "val")
    images = str(images)
    assert fork_ranks(_zero_first_worker, 2, log_file, images) == [0, 0]
    rank0 = dict(json.load(open(f"{log_file}.0")))
    rank1 = dict(json.load(open(f"{log_file}.1")))
    assert rank1["enter"] >= rank0["leave"]
    assert rank1["enter"] - rank0["enter"] >= 1.4
    assert (rank0["scans"], rank1["scans"]) == (1, 0)  # local rank 0 built the cache, rank 1 read it
    assert rank0["images"] == rank1["images"] == 8


def test_zero_first_is_a_no_op_without_distribution() -> None:
    ran = []
    with torch_distributed_zero_first(-1):
        ran.append(True)
    assert ran == [True]


def _dies_inside_zero_first(rank: int, out: str) -> None:
    dist.init_process_group("gloo")
    t0 = time.time()
    try:
        with torch_distributed_zero_first(rank):
            if rank == 0:
                time.sleep(0.5)
                os._exit(3)  # local rank 0 dies while building, say, the label cache
    except WaitAbandoned as e:  # local rank 0 hosted the store: rank 1 says so in one line
        with open(out, "w") as f:
            json.dump({"error": str(e).splitlines()[0], "seconds": time.time() - t0}, f)
        os._exit(1)
    os._exit(0)


@pytest.mark.slow
def test_waiting_ranks_fail_fast_when_local_rank_0_dies(tmp_path) -> None:
    out = tmp_path / "rank1.json"
    assert fork_ranks(_dies_inside_zero_first, 2, str(out), timeout=60) == [3, 1]
    report = json.loads(out.read_text())
    assert report["seconds"] < 30 and "the rendezvous store at 127.0.0.1:" in report["error"], report
