"""The storage seam (utils/storage.py) on a local folder, on a real S3 server on loopback (SeaweedFS,
tests/s3_server.py) and on fsspec's memory file system: whole-file writes, reads, listings; wrong credentials, an
unreachable endpoint and a missing backend are one line each, with no secret in it."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY_IN_PROCESS, _main_writing_to, free_port, main_on_ranks, rank_jobs, start_forked
from s3_server import ACCESS_KEY, SECRET_KEY

import train
from models.yolo import Model
from utils.checkpoint import load_checkpoint, model_state, save_checkpoint
from utils.distributed import DistInfo
from utils.engine.resume import latest_checkpoint
from utils.engine.run_record import RunRecord
from utils.engine.run_upload import RunUpload, job_run_folder
from utils.errors import UserError
from utils.results_log import result_columns
from utils.storage import Storage, is_url, local_copy, open_storage, protocol_of


def test_locations_are_told_apart() -> None:
    assert protocol_of("s3://b/runs") == "s3" and protocol_of("GS://b") == "gs"
    assert not is_url("runs/train") and not is_url("/abs/runs") and not is_url("file:///abs/runs")
    assert open_storage("file:///tmp/x").location == "/tmp/x"


def test_a_local_storage_writes_whole_files_and_lists_them(tmp_path) -> None:
    storage = open_storage(tmp_path / "run")
    storage.write_bytes("weights/last.pt", b"abc")
    storage.upload(tmp_path / "run/weights/last.pt", "weights/copy.pt")
    assert storage.read_bytes("weights/copy.pt") == b"abc" and storage.exists("weights/last.pt")
    assert storage.listdir("weights") == ["copy.pt", "last.pt"] and storage.listdir("nothing") == []


@pytest.mark.slow
def test_an_s3_bucket_holds_a_runs_files(bucket, tmp_path) -> None:
    storage = open_storage(f"s3://{bucket}/runs/exp")
    storage.check_access()
    assert storage.listdir() == [] and not storage.exists("weights/last.pt")
    storage.write_bytes("weights/last.pt", b"first")
    storage.write_bytes("weights/last.pt", b"second")  # replaced whole
    (tmp_path / "results.csv").write_text("epoch\n0\n")
    storage.upload(tmp_path / "results.csv", "results.csv")
    assert storage.read_bytes("weights/last.pt") == b"second"
    assert storage.read_bytes("results.csv") == b"epoch\n0\n"
    assert storage.listdir() == ["results.csv", "weights"] and storage.listdir("weights") == ["last.pt"]
    with pytest.raises(UserError, match=rf"^opening s3://{bucket}x/runs: the bucket {bucket}x does not exist$"):
        open_storage(f"s3://{bucket}x/runs").check_access()


@pytest.mark.slow
def test_wrong_credentials_are_one_line_without_the_secret(bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    with pytest.raises(UserError) as info:
        open_storage(f"s3://{bucket}/runs").check_access()
    message = str(info.value)
    assert message.startswith(f"opening s3://{bucket}/runs: ") and "\n" not in message
    assert "not-the-secret-at-all" not in message and SECRET_KEY not in message


def test_an_unreachable_endpoint_is_one_line_within_seconds(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-value")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^opening s3://bucket/runs: .*check the credentials and the endpoint\)$"):
        open_storage("s3://bucket/runs").check_access()
    assert time.monotonic() - started < 30


def test_a_missing_backend_is_one_line_naming_the_package(monkeypatch) -> None:
    import fsspec  # noqa: F401 (its registry module, shadowed by a mapping of the same name on the package)

    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs raises ImportError
    # As in a process that never imported s3fs: fsspec keeps the classes it imported in its registry.
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(UserError, match=r"^s3://b/runs: s3:// needs the package s3fs \(pip install s3fs\)$"):
        open_storage("s3://b/runs")


def test_a_backend_without_atomic_uploads_writes_beside_and_moves() -> None:
    """A protocol not known to upload atomically gets a temporary object moved into place: never half visible."""
    import fsspec

    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    moves = []
    real_mv = fs.mv
    fs.mv = lambda a, b, **kw: (moves.append((a, b)), real_mv(a, b, **kw))[1]
    storage = Storage(f"memory://{uuid.uuid4().hex}/run", fs, "sftp")
    storage.write_bytes("weights/last.pt", b"x" * 1000)
    assert storage.read_bytes("weights/last.pt") == b"x" * 1000 and storage.listdir("weights") == ["last.pt"]
    ((tmp, target),) = moves
    assert target.endswith("/weights/last.pt") and tmp.rpartition("/")[2].startswith(".last.pt.")


# ---- a training run whose folder is in a bucket --------------------------------------------------------------

# 2 ranks, global batch 32 over 96 images: 3 batches an epoch, an optimizer step every 2 (AdamW accumulates up to the
# nominal batch of 64), so --save-steps 1 writes a checkpoint inside the epoch, after its second batch. At 32 px.
DDP_RUN = [
    *TINY_IN_PROCESS,
    "--imgsz",
    "32",
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--noval",
    "--save-steps",
    "1",
    "--optimizer",
    "AdamW",
    "--loggers",
    "tensorboard",
]
GATE_AFTER = 32  # a rank's samples before the gated run stops for good: its first two batches


def _gated_rank(rank: int, argv: list[str], log: str) -> int:
    """train.py's main on one forked rank whose data stops for good at the third batch: the run hangs right after it
    has handed the checkpoint inside the epoch to the writer, for the test to kill it there."""
    from utils.data.dataset import YoloDataset

    load, taken = YoloDataset.__getitem__, []

    def gated(self, item):
        if isinstance(item, tuple):
            taken.append(item)
            while len(taken) > GATE_AFTER:
                time.sleep(1)
        return load(self, item)

    YoloDataset.__getitem__ = gated
    return _main_writing_to(train.main, argv, log)


def _staged(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith("yolo-")]


def _run_state(url: str) -> dict:
    try:
        return json.loads(open_storage(url).read_bytes("run.json"))
    except FileNotFoundError:
        return {}


@pytest.mark.slow
def test_a_2_rank_run_in_a_bucket_killed_inside_an_epoch_resumes_from_the_bucket_alone_bit_identical(
    bucket, rectangles96_yaml, tmp_path, monkeypatch
) -> None:
    """Every file of a 2-rank run with --project s3://... lands in the bucket and no local file stays; the same run
    killed inside its epoch, its local folders deleted, resumed in a fresh folder from the bucket's URL alone,
    ends with the uninterrupted run's weights bit for bit."""
    # Imported once here, before the forks, so that each rank starts with them: TensorBoard's writer, and the
    # module the optimizer's constructor imports (seconds per process).
    for module in ("tensorboard", "torch._dynamo"):
        importlib.import_module(module)

    local = tmp_path / "local"  # every rank's staging folder goes under it (forked ranks inherit tempfile's folder)
    local.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(local))
    data = ["--data", str(rectangles96_yaml), "--name", "exp"]
    codes, outputs = main_on_ranks(
        train.main, [*DDP_RUN, *data, "--project", f"s3://{bucket}/straight"], 2, tmp_path / "logs"
    )
    assert codes == [0, 0], outputs[0][-3000:]
    straight = open_storage(f"s3://{bucket}/straight/exp")
    files = straight.files()
    for name in ("weights/last.pt", "weights/best.pt", "results.csv", "run.json", "opt.yaml", "hyp.yaml"):
        assert name in files, files
    assert any(f.startswith("events.out.tfevents") for f in files), files  # TensorBoard's
    assert open_storage(f"s3://{bucket}/straight").listdir() == ["exp"]  # rank 1 made no exp2
    state = _run_state(f"s3://{bucket}/straight/exp")
    assert state["status"] == "finished" and state["newest_checkpoint"] == "weights/last.pt"
    assert yaml.safe_load(straight.read_bytes("opt.yaml"))["save_dir"] == f"s3://{bucket}/straight/exp"
    for name in ("opt.yaml", "run.json", "weights/last.pt"):  # the credentials are written nowhere
        assert SECRET_KEY.encode() not in straight.read_bytes(name) and ACCESS_KEY.encode() not in straight.read_bytes(
            name
        )
    assert _staged(local) == []  # the staging folders are removed at the end
    assert f"Results saved to s3://{bucket}/straight/exp" in outputs[0]

    cut_url = f"s3://{bucket}/cut/exp"
    logs = [str(tmp_path / f"cut{rank}.log") for rank in range(2)]
    argv = [*DDP_RUN, *data, "--project", f"s3://{bucket}/cut"]
    procs = [start_forked(*job) for job in rank_jobs(lambda rank: _gated_rank(rank, argv, logs[rank]), 2)]
    try:
        deadline = time.monotonic() + 120
        while _run_state(cut_url).get("checkpoint") != "epoch 0 batch 2":  # uploaded, then named in run.json
            assert all(p.exitcode is None for p in procs), Path(logs[0]).read_text()[-3000:]
            assert time.monotonic() < deadline, Path(logs[0]).read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert _run_state(cut_url)["status"] == "running"
    shutil.rmtree(local)  # the machine is lost: nothing local is left
    local.mkdir()
    monkeypatch.chdir(local)
    codes, outputs = main_on_ranks(train.main, ["--resume", f"{cut_url}/weights/last.pt"], 2, tmp_path / "logs_resumed")
    assert codes == [0, 0], outputs[0][-3000:]
    assert "Resuming training at batch 2 of epoch 0" in outputs[0]
    assert [
        int(float(r.split(",")[0])) for r in open_storage(cut_url).read_bytes("results.csv").decode().splitlines()[1:]
    ] == [0]
    with (
        local_copy(f"{cut_url}/weights/last.pt") as resumed,
        local_copy(f"{straight.location}/weights/last.pt") as whole,
    ):
        a, b = load_checkpoint(resumed), load_checkpoint(whole)
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in b["ema"])
    assert _staged(local) == []


def test_wrong_credentials_stop_a_run_in_one_line_before_any_training(
    bucket, train_here, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    status, log = train_here("--data", str(tmp_path / "never-read.yaml"), "--project", f"s3://{bucket}/runs")
    errors = [line for line in log.splitlines() if line.startswith("ERROR")]
    assert status == 1 and len(errors) == 1, log
    assert errors[0].startswith(f"ERROR opening s3://{bucket}/runs: ") and "not-the-secret-at-all" not in log
    assert "Starting training" not in log and "hyperparameters" not in log


def _record(storage: Storage, run: str, status: str, age_s: float, checkpoint: str | None = "weights/last.pt") -> None:
    state = {"status": status, "newest_checkpoint": checkpoint, "checkpoint": "epoch 0", "updated": time.time() - age_s}
    storage.write_bytes(f"{run}/run.json", json.dumps(state).encode())


def test_resume_alone_takes_the_newest_interrupted_run_of_a_bucket_and_never_one_alive(bucket, train_here) -> None:
    """--resume with --project s3://...: the run whose record is not finished and whose heartbeat is older than
    twice --dist-timeout, the newest of them; a run beating within that window is alive elsewhere and never taken."""
    project = f"s3://{bucket}/runs"
    storage = open_storage(project)
    status, log = train_here("--resume", "--project", project)  # train.py looks in the bucket
    assert status == 1 and f"ERROR {project}: no interrupted run to resume (train first" in log, log
    _record(storage, "exp", "running", age_s=3600)
    _record(storage, "exp2", "running", age_s=1300)  # newer, and stale: 1300 s > 2 x 10 min
    _record(storage, "exp3", "finished", age_s=10)
    _record(storage, "exp4", "running", age_s=60)  # alive elsewhere
    _record(storage, "exp5", "running", age_s=7200, checkpoint=None)  # nothing complete to resume from
    storage.write_bytes("notes.txt", b"not a run")
    assert latest_checkpoint((project,), dist_timeout=10) == f"{project}/exp2/weights/last.pt"
    assert latest_checkpoint((project,), dist_timeout=30) == f"{project}/exp/weights/last.pt"  # exp2 within 60 min
    with pytest.raises(
        UserError,
        match=r"the records of exp \(\d+ s ago\), exp2 \(\d+ s ago\), exp4 \(\d+ s ago\) were updated less than",
    ):
        latest_checkpoint((project,), dist_timeout=100)
    # A launcher restart finds the folder its job made: marked with its run id since its launcher started.
    storage.write_bytes("exp4/run_id", b"job-7")
    started = time.time() - 30
    assert job_run_folder(project, DistInfo(0, 0, 2, 2, 1, "job-7", started)) == f"{project}/exp4"
    assert job_run_folder(project, DistInfo(0, 0, 2, 2, 1, "job-8", started)) is None
    assert job_run_folder(project, DistInfo(0, 0, 2, 2, 1, "job-7", time.time() + 30)) is None  # an older job's


def test_a_failed_upload_is_retried_and_reported_in_one_line_and_training_goes_on(tmp_path, caplog) -> None:
    """The storage fails twice, then takes the file: one warning naming the tries; a storage that never takes it:
    one warning, False, and the next upload of the file tries again."""
    fails = {"n": 2}

    class Flaky(Storage):
        def upload(self, local, relative):
            if fails["n"] > 0:
                fails["n"] -= 1
                raise UserError(f"writing {self.full(relative)}: ConnectTimeoutError (check the endpoint)")
            super().upload(local, relative)

    (tmp_path / "run/weights").mkdir(parents=True)
    (tmp_path / "run/weights/last.pt").write_bytes(b"checkpoint")
    (tmp_path / "run/results.csv").write_text("epoch\n0\n")
    upload = RunUpload(Flaky(str(tmp_path / "bucket")), tmp_path / "run", retry_delays=(0.01, 0.01, 0.01))
    with caplog.at_level("WARNING"):
        assert upload.upload("weights/last.pt")
    (line,) = caplog.messages
    assert line.startswith(f"WARNING {tmp_path}/bucket/weights/last.pt: uploaded on try 3 (2 failed, the last: ")
    assert (tmp_path / "bucket/weights/last.pt").read_bytes() == b"checkpoint"
    assert upload.changed(with_checkpoints=True) == ["results.csv"]  # last.pt is sent as it is
    caplog.clear()
    fails["n"] = 10
    with caplog.at_level("WARNING"):
        assert not upload.sync()
    (line,) = caplog.messages
    assert line.endswith("training goes on and the next upload tries again") and "not uploaded after 4 tries" in line
    fails["n"] = 0
    assert upload.changed(with_checkpoints=False) == ["results.csv"] and upload.sync() and not upload.changed(True)


@pytest.mark.slow
def test_detect_takes_weights_from_a_bucket_and_a_missing_object_is_one_line(
    bucket, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    """--weights s3://... (val.py, detect.py and export.py download it through utils/storage.py: local_copy)."""
    import detect

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml", nc=2)
    model.names = ["red", "blue"]
    save_checkpoint({**model_state(model), "opt": {"imgsz": 64}}, tmp_path / "w.pt")
    open_storage(f"s3://{bucket}/models").upload(tmp_path / "w.pt", "w.pt")
    image = rectangles_yaml.parent / "images/val/0000.jpg"
    common = ["--source", str(image), "--imgsz", "64", "--device", "cpu", "--project", str(tmp_path / "out")]
    assert detect.main([*common, "--weights", f"s3://{bucket}/models/w.pt", "--save-txt"]) == 0
    assert (tmp_path / "out/exp/0000.jpg").is_file()
    assert not list((tmp_path / "tmp").iterdir())  # the download is removed
    assert detect.main([*common, "--weights", f"s3://{bucket}/models/none.pt"]) == 1


@pytest.mark.slow
def test_tar_shards_in_a_bucket_read_like_local_ones_through_the_node_cache(
    bucket, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    from shards import main as convert
    from utils.data.config import load_data_config
    from utils.data.loader import load_labels
    from utils.data.webshards import ShardSet

    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "node-cache"))
    assert convert(["--data", str(rectangles_yaml), "--out", str(tmp_path / "sh"), "--max-count", "8"]) == 0
    tars = sorted(p.name for p in (tmp_path / "sh").glob("train-*.tar"))
    assert len(tars) == 2
    for name in tars:
        open_storage(f"s3://{bucket}/sh").upload(tmp_path / "sh" / name, name)
    remote = tmp_path / "remote.yaml"
    remote.write_text(
        f"path: {tmp_path}\ntrain: s3://{bucket}/sh/train-{{000000..000001}}.tar\nval: {tmp_path}/sh/val-000000.tar\n"
        "names: [red, blue]\n"
    )
    got = load_labels(load_data_config(remote)["train"], nc=2, verbose=False)
    want = load_labels(load_data_config(tmp_path / "sh/data.yaml")["train"], nc=2, verbose=False)
    assert [Path(f).name for f in got.im_files] == [Path(f).name for f in want.im_files] and len(want.im_files) == 16
    assert len(list((tmp_path / "node-cache").glob("*.tar"))) == 2  # fetched once into the node's cache
    with pytest.raises(UserError, match=rf"s3://{bucket}/sh/nothere-000000.tar: cannot fetch shard"):
        load_labels(ShardSet((f"s3://{bucket}/sh/nothere-000000.tar",), "test"), nc=2)


def test_a_stalled_store_holds_up_no_epoch_and_run_json_names_only_what_the_bucket_holds(tmp_path) -> None:
    """A store that stops answering (a frozen server): every epoch's checkpoint is handed over at once; run.json in
    the bucket names a checkpoint only once it is there, and the newest one once the store answers again."""
    release, entered = threading.Event(), threading.Event()

    class Stalled(Storage):
        def upload(self, local, relative):
            if relative.startswith("weights/"):
                entered.set()
                assert release.wait(30)
            super().upload(local, relative)

    bucket = Stalled(str(tmp_path / "bucket"))
    record = RunRecord(
        tmp_path / "stage", result_columns(("box", "obj", "cls")), patience=0, noval=False, nosave=False, save_period=-1
    )
    record.upload_to(RunUpload(bucket, tmp_path / "stage"))
    t0 = time.monotonic()
    for epoch in range(3):
        ckpt = {"model_cfg": {}, "model": {"w": torch.full((4,), float(epoch))}, "ema": None, "epoch": epoch}
        record.end_epoch(epoch, np.zeros(3), (0.0, 0.0, 0.0, 0.1 * epoch, 0.0, 0.0, 0.0), [0.01] * 3, ckpt, False)
        assert entered.wait(30)
        assert json.loads(bucket.read_bytes("run.json"))["newest_checkpoint"] is None  # nothing complete there
    assert time.monotonic() - t0 < 10 and not release.is_set()
    release.set()
    assert record.close()
    state = json.loads(bucket.read_bytes("run.json"))
    assert (state["newest_checkpoint"], state["checkpoint"]) == ("weights/last.pt", "epoch 2")
    assert torch.equal(load_checkpoint(tmp_path / "bucket/weights/last.pt")["model"]["w"], torch.full((4,), 2.0))
