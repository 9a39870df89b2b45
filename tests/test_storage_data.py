"""Data on object storage (utils/data/remote_data.py): a data YAML in a bucket naming folders and lists of loose
images and YOLO label files there, read through the node's local copy, on the real S3 server on loopback
(tests/s3_server.py); the label cache stays on the node and the bucket is never written."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import write_rectangles_dataset

from utils.data.config import load_data_config
from utils.data.labels import read_table
from utils.data.remote_data import bucket_folder
from utils.engine.resume import latest_checkpoint
from utils.errors import UserError
from utils.storage import open_storage


def _data_in_bucket(bucket: str, tmp_path: Path) -> tuple[str, Path]:
    """A tiny dataset (8 train, 4 val images of 64 px) in s3://bucket/data: images/ and labels/ folders, a val
    list with entries relative to it (./ and bare) and one absolute URL, and a data YAML naming both by relative
    paths. Returns the YAML's URL and the local original's YAML."""
    local = write_rectangles_dataset(tmp_path / "original", n_train=8, n_val=4, size=64)
    storage = open_storage(f"s3://{bucket}/data")
    for folder in ("images", "labels"):  # at once (upload_tree sends one file after another)
        storage.fs.put(str(local.parent / folder), storage.full(folder), recursive=True)
    listed = f"./images/val/0000.jpg\nimages/val/0001.jpg\n# a comment\ns3://{bucket}/data/images/val/0002.jpg\n"
    storage.write_bytes("val.txt", listed.encode())
    storage.write_bytes("rect.yaml", b"train: images/train\nval: val.txt\nnames: [red, blue]\n")
    return f"s3://{bucket}/data/rect.yaml", local


def _rows(table) -> dict[str, list]:
    return {Path(f).name: np.round(table.labels[i], 5).tolist() for i, f in enumerate(table.im_files)}


def test_a_data_yaml_in_a_bucket_reads_loose_images_through_the_nodes_copy_and_never_writes_the_bucket(
    bucket, tmp_path, monkeypatch, caplog
) -> None:
    node = tmp_path / "node"
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(node))
    url, local_yaml = _data_in_bucket(bucket, tmp_path)
    whole = open_storage(f"s3://{bucket}")
    in_bucket = whole.files()

    config = load_data_config(url)
    assert config["yaml_file"] == url and config["names"] == ["red", "blue"]
    assert all(Path(config[split]).is_relative_to(node) for split in ("train", "val"))
    train, reused = read_table(config["train"], nc=2, verbose=False)
    val, _ = read_table(config["val"], nc=2, verbose=False)
    assert not reused and Path(train.cache_file).is_relative_to(node) and Path(val.cache_file).is_relative_to(node)
    original = load_data_config(local_yaml)
    assert _rows(train) == _rows(read_table(original["train"], nc=2, verbose=False)[0])  # the same labels
    assert sorted(_rows(val)) == ["0000.jpg", "0001.jpg", "0002.jpg"]
    assert whole.files() == in_bucket  # no cache, no copy went into the bucket

    caplog.clear()
    with caplog.at_level("INFO"):
        config = load_data_config(url)  # another start on this node: nothing fetched, the label cache reused
        assert read_table(config["train"], nc=2, verbose=False)[1]
    assert not [m for m in caplog.messages if "fetching" in m]

    whole.write_bytes("data/labels/train/0003.txt", b"1 0.5 0.5 0.25 0.25\n")  # a label changed in the bucket
    whole.fs.rm(whole.full("data/images/train/0005.jpg"))  # an image removed
    with caplog.at_level("INFO"):
        config = load_data_config(url)
    assert [m for m in caplog.messages if "fetching" in m] == [
        f"s3://{bucket}/data/images/train: fetching 1 of 15 files into {bucket_folder(f's3://{bucket}')}"
    ]
    train, reused = read_table(config["train"], nc=2, verbose=False)
    rows = _rows(train)
    assert not reused and "0005.jpg" not in rows and len(rows) == 7
    assert rows["0003.jpg"] == [[1.0, 0.5, 0.5, 0.25, 0.25]]


def test_a_missing_folder_in_a_bucket_is_one_line_naming_the_yaml(bucket, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(tmp_path / "node"))
    storage = open_storage(f"s3://{bucket}")
    storage.write_bytes("d.yaml", b"train: nothing/here\nval: nothing/here\nnames: [a]\n")
    with pytest.raises(UserError, match=rf"^s3://{bucket}/d.yaml 'train': s3://{bucket}/nothing/here does not exist"):
        load_data_config(f"s3://{bucket}/d.yaml")
    with pytest.raises(UserError, match=rf"^s3://{bucket}/none.yaml: no such file$"):
        load_data_config(f"s3://{bucket}/none.yaml")
    name = f"k{uuid.uuid4().hex[:6]}"
    storage.write_bytes(f"{name}.yaml", b"path: ../..\ntrain: x\nval: x\nnames: [a]\n")  # climbs to the bucket
    with pytest.raises(UserError, match=rf"s3://{bucket}/x does not exist"):
        load_data_config(f"s3://{bucket}/{name}.yaml")


@pytest.mark.slow
def test_a_run_on_data_in_s3_with_its_folder_in_gs_and_resume_finds_it_in_gs(
    bucket, gcs_env, train_here, tmp_path, monkeypatch
) -> None:
    """Training on a data YAML in an s3:// bucket writes nothing there; its run folder in gs:// (the GCS emulator)
    holds the run, and --resume --project gs://... finds the run there once its record is a killed run's."""
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(tmp_path / "node"))
    data, _ = _data_in_bucket(bucket, tmp_path)
    in_bucket = open_storage(f"s3://{bucket}").files()
    open_storage(f"gs://{bucket}").fs.mkdir(bucket)
    project = f"gs://{bucket}/runs"
    status, log = train_here("--data", data, "--epochs", "1", "--noval", "--project", project, "--name", "exp")
    assert status == 0, log[-3000:]
    run = open_storage(f"{project}/exp")
    files = run.files()
    for name in ("weights/last.pt", "weights/best.pt", "results.csv", "run.json", "opt.yaml"):
        assert name in files, files
    state = json.loads(run.read_bytes("run.json"))
    assert state["status"] == "finished" and state["newest_checkpoint"] == "weights/last.pt"
    assert open_storage(f"s3://{bucket}").files() == in_bucket

    # As if its machine had been lost before the end: the record not finished, its last beat an hour ago.
    run.write_bytes("run.json", json.dumps({**state, "status": "running", "updated": time.time() - 3600}).encode())
    assert latest_checkpoint((project,), dist_timeout=10) == f"{project}/exp/weights/last.pt"
    status, log = train_here("--resume", "--project", project)
    assert status == 0 and f"{project}/exp/weights/last.pt: this run already finished its 1 epochs" in log, log


def test_a_shard_list_in_a_bucket_resolves_its_entries_against_itself_and_names_itself_for_a_bad_one(
    bucket, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    """``train: train.txt`` in a bucket listing tar shards: a relative entry is relative to the list's folder in the
    bucket, a URL is itself, a list is followed; the shards are read through the node's shard cache under their URLs, as shards named in
    the YAML are; an entry climbing out of the bucket or naming a shard the bucket lacks is one line naming the list
    and its line."""
    from shards import main as convert
    from utils.data.labels import load_labels
    from utils.data.shard_cache import ShardCache
    from utils.data.shard_names import ShardSet

    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(tmp_path / "node-data"))  # a list read as loose data: not ~
    assert convert(["--data", str(rectangles_yaml), "--out", str(tmp_path / "sh"), "--max-count", "8"]) == 0
    storage = open_storage(f"s3://{bucket}")
    for tar in sorted((tmp_path / "sh").glob("*.tar")):
        storage.upload(tar, f"sh/{tar.name}")
    lists = f"s3://{bucket}/lists"
    storage.write_bytes("lists/train.txt", b"# train shards\n../sh/train-000000.tar\n\nmore.txt\n")  # a list in it too
    storage.write_bytes("lists/more.txt", f"s3://{bucket}/sh/train-{{000001..000001}}.tar\n".encode())
    storage.write_bytes("lists/d.yaml", b"train: train.txt\nval: ../sh/val-000000.tar\nnames: [red, blue]\n")

    config = load_data_config(f"{lists}/d.yaml")
    want = tuple(f"s3://{bucket}/sh/train-00000{i}.tar" for i in (0, 1))
    assert config["train"] == ShardSet(want, f"{lists}/d.yaml 'train'")
    got = load_labels(config["train"], nc=2, verbose=False)
    local = load_labels(load_data_config(tmp_path / "sh/data.yaml")["train"], nc=2, verbose=False)
    assert [Path(f).name for f in got.im_files] == [Path(f).name for f in local.im_files] and len(got.im_files) == 16
    cached = sorted(p.name for p in (tmp_path / "node-cache").glob("*.tar"))
    assert cached == sorted(ShardCache(tmp_path / "node-cache").path_for(u).name for u in want)

    for name, body, error in (
        (
            "out.txt",
            "train-000000.tar\n../../sh/train-000001.tar\n",
            r"line 2: '\.\./\.\./sh/train-000001\.tar' climbs",
        ),
        ("gone.txt", "../sh/train-000000.tar\n../sh/train-00000{7..9}.tar\n", r"line 2: s3://\S+/sh/train-000007\.tar"),
    ):
        storage.write_bytes(f"lists/{name}", body.encode())
        storage.write_bytes("lists/bad.yaml", f"train: {name}\nval: {name}\nnames: [red, blue]\n".encode())
        with pytest.raises(UserError, match=rf"^{lists}/bad\.yaml 'train': {lists}/{name} {error}") as raised:
            load_data_config(f"{lists}/bad.yaml")
        assert "\n" not in str(raised.value)
    assert "(nor are 2 more of its shards)" in str(raised.value)


def test_a_shard_list_in_gs_lists_shards_beside_it(gcs_env, tmp_path, monkeypatch) -> None:
    """The same in gs:// (the GCS emulator): entries relative to the list, the shards under gs:// URLs."""
    from utils.data.shard_names import ShardSet

    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(tmp_path / "node-data"))
    name = f"g{uuid.uuid4().hex[:10]}"
    storage = open_storage(f"gs://{name}")
    storage.fs.mkdir(name)
    for i in range(2):
        storage.write_bytes(f"sh/train-00000{i}.tar", b"not read here")
    storage.write_bytes("sh/lists/train.txt", b"../train-{000000..000001}.tar\n")
    (tmp_path / "d.yaml").write_text(
        f"train: gs://{name}/sh/lists/train.txt\nval: gs://{name}/sh/lists/train.txt\nnames: [a]\n"
    )
    config = load_data_config(tmp_path / "d.yaml")
    want = (f"gs://{name}/sh/train-000000.tar", f"gs://{name}/sh/train-000001.tar")
    assert config["train"] == ShardSet(want, f"{tmp_path / 'd.yaml'} 'train'")
    storage.write_bytes("sh/lists/train.txt", b"../train-000002.tar\n")
    with pytest.raises(UserError, match=rf"gs://{name}/sh/lists/train.txt line 1: gs://{name}/sh/train-000002.tar is"):
        load_data_config(tmp_path / "d.yaml")


def test_bucket_data_larger_than_the_room_of_the_nodes_copy_is_refused_in_one_line_before_any_download(
    bucket, tmp_path, monkeypatch
) -> None:
    """YOLO_TRAIN_DATA_CACHE_GB below what the data needs, or a disk with less free: one line (a UserError: a run
    stops with status 1) naming the data YAML (or the entry's URL), the size needed and the room available; nothing
    fetched. The room is checked for every split at once: room for train alone fetches nothing either."""
    import utils.data.remote_data as remote_data

    node = tmp_path / "node"
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE", str(node))
    url, _ = _data_in_bucket(bucket, tmp_path)
    stats = open_storage(f"s3://{bucket}/data").file_stats()
    needed = sum(s.size for name, s in stats.items() if name.startswith(("images/train/", "labels/train/")))
    val_images = [f"images/val/000{i}.jpg" for i in range(3)]  # the val list's three
    both = needed + sum(stats[n].size + stats[n.replace("images", "labels")[:-4] + ".txt"].size for n in val_images)
    for cap in (needed / 2, (needed + both) / 2):  # half of what train needs; room for train but not for val too
        monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE_GB", str(cap / (1 << 30)))
        refused = rf"^{url}: the node's copy of its 22 files needs {both / 1024:.1f} KiB but "
        with pytest.raises(
            UserError, match=refused + r"\d+\.\d KiB is available \(left under YOLO_TRAIN_DATA_CACHE_GB="
        ):
            load_data_config(url)
        assert not [p for p in node.rglob("*") if p.is_file() and not p.name.endswith(".lock")]  # nothing fetched
    train = f"s3://{bucket}/data/images/train"
    refused = rf"^{train}: the node's copy of its 16 files needs {needed / 1024:.1f} KiB but "

    monkeypatch.delenv("YOLO_TRAIN_DATA_CACHE_GB")
    with monkeypatch.context() as full_disk:
        full_disk.setattr(remote_data.shutil, "disk_usage", lambda _: SimpleNamespace(free=1024))
        with pytest.raises(UserError, match=refused + r"1\.0 KiB is available \(free on the disk of "):
            remote_data.local_data(train, "test")
    assert Path(remote_data.local_data(train, "test")).is_relative_to(node)  # room enough: copied
    monkeypatch.setenv("YOLO_TRAIN_DATA_CACHE_GB", "lots")
    with pytest.raises(UserError, match=r"^YOLO_TRAIN_DATA_CACHE_GB='lots': expected a size in GiB greater than 0$"):
        remote_data._cap_bytes()
