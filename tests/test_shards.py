"""WebDataset tar shards: converter round trip, exact-epoch plans, bad shards, pipe:/http:// URLs, 2 gloo ranks."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import tarfile
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import COLOURS, main_on_ranks, tar_members, write_rectangles_dataset, write_tar

from utils.data.config import load_data_config
from utils.data.loader import create_dataloader, load_labels
from utils.data.samplers import ShardPlan
from utils.data.shard_cache import ShardCache
from utils.data.webshards import ShardSet, load_shard_index
from utils.data.yolo_labels import load_split, parse_label_text
from utils.errors import UserError
from utils.log import LOGGER

N_GOOD_TRAIN = 19  # odd: 2 ranks need one sample of padding


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """(loose-file data YAML, shard data YAML); the loose train split has one corrupt image and one bad label."""
    root = tmp_path_factory.mktemp("shards")
    yaml_file = write_rectangles_dataset(root / "loose", n_train=N_GOOD_TRAIN, n_val=6)
    (root / "loose/images/train/broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    cv2.imwrite(str(root / "loose/images/train/badlabel.jpg"), np.full((96, 96, 3), 120, np.uint8))
    (root / "loose/labels/train/badlabel.txt").write_text("0 0.5 0.5 0.2\n")  # 4 columns
    from shards import main

    assert main(["--data", str(yaml_file), "--out", str(root / "sh"), "--max-count", "6", "--workers", "1"]) == 0
    return yaml_file, root / "sh" / "data.yaml"


def test_converter_round_trip(converted) -> None:
    loose_yaml, shard_yaml = converted
    cfg = load_data_config(shard_yaml)
    assert isinstance(cfg["train"], ShardSet) and len(cfg["train"].urls) == 4  # 19 samples, at most 6 per shard
    assert "{000000..000003}" in shard_yaml.read_text()
    members: dict[str, bytes] = {}
    for url in cfg["train"].urls:
        members.update(tar_members(Path(url)))
    loose = load_split(load_data_config(loose_yaml)["train"], nc=2, verbose=False)
    assert loose.counts["corrupt"] == 2 and len(loose.im_files) == N_GOOD_TRAIN
    for im_file, labels in zip(loose.im_files, loose.labels):
        key = f"images_train_{Path(im_file).stem}"
        assert members[f"{key}.jpg"] == Path(im_file).read_bytes()  # image bytes unchanged
        back, _ = parse_label_text(members[f"{key}.txt"].decode(), 2)
        np.testing.assert_array_equal(back, labels)  # every float32 digit kept
    assert not any("broken" in k or "badlabel" in k for k in members)
    wids_index = json.loads((shard_yaml.parent / "train-index.json").read_text())
    assert sum(s["nsamples"] for s in wids_index["shardlist"]) == N_GOOD_TRAIN
    shards = load_labels(cfg["train"], nc=2, verbose=False)
    assert list(shards.shard_counts) == [6, 6, 6, 1] and shards.counts["corrupt"] == 0
    np.testing.assert_array_equal(np.concatenate(shards.labels), np.concatenate(loose.labels))


@pytest.mark.parametrize("n_shards, world", [(7, 1), (7, 2), (7, 3), (1, 4)])
def test_plan_gives_exact_equal_epochs_with_sequential_reads(n_shards: int, world: int) -> None:
    counts = np.random.default_rng(n_shards).integers(5, 40, n_shards)
    plan = ShardPlan(counts, seed=1, window=16)
    n = int(counts.sum())
    for epoch in (0, 1):
        parts = [plan.rank_samples(epoch, r, world) for r in range(world)]
        assert len({len(p) for p in parts}) == 1  # equal per rank by construction
        flat = np.concatenate(parts)
        assert set(flat.tolist()) == set(range(n)) and len(flat) - n < world  # each once, padding < world size
        # the global order does not depend on the world size: the rank slices concatenate to it
        np.testing.assert_array_equal(flat[:n], ShardPlan(counts, seed=1, window=16).order(epoch))
        shard_of = np.repeat(np.arange(n_shards), counts)[plan.order(epoch)]
        for s in range(n_shards):  # a shard is read in one stretch: mixed with others only within a window
            where = np.nonzero(shard_of == s)[0]
            assert where.max() - where.min() < counts[s] + 2 * 16
        for s in flat[:5]:
            assert s in plan.partners(epoch, int(s))
    assert not np.array_equal(plan.order(0), plan.order(1))
    resampled = ShardPlan(counts, seed=1, window=16, resampled=True)
    assert {len(resampled.rank_samples(0, r, world)) for r in range(world)} == {-(-n // world)}


def test_shard_pixels_equal_loose_files(converted) -> None:
    loose_yaml, shard_yaml = converted
    batches = []
    for yaml_file in (loose_yaml, shard_yaml):
        loader, _ = create_dataloader(
            load_data_config(yaml_file)["val"], 64, 4, 32, rect=True, pad=0.5, workers=0, nc=2
        )
        batches.append([(b[0], b[1], [Path(p).stem for p in b[2]]) for b in loader])
    for (im_a, t_a, names_a), (im_b, t_b, names_b) in zip(*batches, strict=True):
        assert [f"images_val_{n}" for n in names_a] == names_b
        assert torch.equal(im_a, im_b) and torch.equal(t_a, t_b)


def test_bad_shards_and_members_are_skipped_and_counted(converted, tmp_path, caplog) -> None:
    _, shard_yaml = converted
    good = shard_yaml.parent / "train-000000.tar"
    shutil.copy(good, tmp_path / "a-000000.tar")
    data = good.read_bytes()
    (tmp_path / "a-000001.tar").write_bytes(data[: len(data) // 2])  # truncated mid-member
    members = tar_members(good)
    jpg = next(v for k, v in members.items() if k.endswith(".jpg"))
    write_tar(
        tmp_path / "a-000002.tar",
        {
            "ok.jpg": jpg,
            "ok.txt": b"0 0.5 0.5 0.2 0.2\n",
            "bad.jpg": b"garbage",
            "bad.txt": b"",
            "nolabel.jpg": jpg,
            "orphan.txt": b"1 0.5 0.5 0.1 0.1\n",
            f"sub/{'x' * 120}.jpg": jpg,
        },
    )  # a PAX long name in a folder
    shards = ShardSet(tuple(str(tmp_path / f"a-00000{i}.tar") for i in range(3)), "test")
    LOGGER.addHandler(caplog.handler)
    try:
        labels = load_shard_index(shards, nc=2, cache=ShardCache(tmp_path / "cache"))
    finally:
        LOGGER.removeHandler(caplog.handler)
    assert labels.counts["bad_shards"] == 1 and labels.counts["corrupt"] == 2  # bad.jpg, orphan (no image)
    assert list(labels.shard_counts) == [6, 0, 3] and labels.counts["background"] == 2
    text = caplog.text
    assert f"{tmp_path / 'a-000001.tar'}: unreadable or truncated shard" in text
    assert f"{tmp_path / 'a-000002.tar'}/bad.jpg: corrupt image" in text
    # training goes on over what is left
    loader, _ = create_dataloader(
        None, 64, 4, 32, augment=True, shuffle=True, workers=0, label_set=labels, shard_window=4
    )
    loader.set_epoch(0)
    assert sum(len(b[2]) for b in loader) == 9
    long_name = next(i for i, f in enumerate(labels.im_files) if f.endswith("x" * 120 + ".jpg"))
    ds = loader.dataset
    img = ds.load_image(long_name)[0]
    assert img.std() > 0 and np.array_equal(img, ds.load_image(long_name - 1)[0])  # the bytes of nolabel.jpg


def test_missing_shard_is_a_one_line_error(converted, tmp_path) -> None:
    _, shard_yaml = converted
    bad = tmp_path / "missing.yaml"
    bad.write_text(
        f"path: {shard_yaml.parent}\ntrain: train-{{000000..000009}}.tar\nval: val-000000.tar\nnames: [red, blue]\n"
    )
    with pytest.raises(UserError, match=r"train-000004\.tar: shard not found") as e:
        load_data_config(bad)
    assert "\n" not in str(e.value)


@pytest.fixture()
def http_server(converted):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(converted[1].parent))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_and_pipe_urls_read_like_local_shards(converted, http_server, tmp_path, monkeypatch) -> None:
    _, shard_yaml = converted
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.setenv("YOLO_ALLOW_PIPE", "1")  # the pipe: URL below runs only with the user's opt-in
    sh = shard_yaml.parent
    remote = tmp_path / "remote.yaml"
    remote.write_text(
        f"path: {tmp_path}\ntrain: ['{http_server}/train-{{000000..000001}}.tar', "
        f"'pipe:cat {sh}/train-000002.tar', '{sh}/train-000003.tar']\n"
        f"val: pipe:cat {sh}/val-000000.tar\nnames: [red, blue]\n"
    )
    cfg, local_cfg = load_data_config(remote), load_data_config(shard_yaml)
    got, want = load_labels(cfg["train"], nc=2, verbose=False), load_labels(local_cfg["train"], nc=2, verbose=False)
    assert [Path(f).name for f in got.im_files] == [Path(f).name for f in want.im_files]
    assert len(list((tmp_path / "node-cache").glob("*.tar"))) == 3  # fetched once into the node's cache
    for a, b in zip(
        *(create_dataloader(c["val"], 64, 3, 32, rect=True, workers=0, nc=2)[0] for c in (cfg, local_cfg)), strict=True
    ):
        assert torch.equal(a[0], b[0])
    with pytest.raises(UserError, match="nothere-000000.tar: cannot fetch shard"):
        load_labels(ShardSet((f"{http_server}/nothere-000000.tar",), "test"), nc=2)


def test_shard_cache_evicts_least_recently_used(converted, http_server, tmp_path) -> None:
    sizes = [(converted[1].parent / f"train-00000{i}.tar").stat().st_size for i in range(3)]
    cache = ShardCache(tmp_path / "c", max_bytes=int(max(sizes) * 1.5))
    urls = [f"{http_server}/train-00000{i}.tar" for i in range(3)]
    for url in urls:
        cache.local_path(url)
    assert cache.fetched == 3
    assert [cache.path_for(u).is_file() for u in urls] == [False, False, True]
    again = ShardCache(tmp_path / "c", max_bytes=cache.max_bytes)
    assert again.local_path(urls[2]) == str(cache.path_for(urls[2])) and again.fetched == 0
    again.prefetch(urls[:1])
    again._queue.put(None)  # the prefetch thread ends after the queued URL
    for _ in range(200):
        if cache.path_for(urls[0]).is_file():
            break
        threading.Event().wait(0.05)
    assert cache.path_for(urls[0]).is_file()


@pytest.mark.slow
def test_two_gloo_ranks_exact_epochs_distributed_val_and_node_cache(converted, tmp_path) -> None:
    _, shard_yaml = converted
    import shard_ranks

    codes, outputs = main_on_ranks(shard_ranks.main, [str(shard_yaml), str(tmp_path)], 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    all_names = {Path(f).name for f in load_labels(load_data_config(shard_yaml)["train"], nc=2, verbose=False).im_files}
    for epoch in ("0", "1"):
        for workers in ("0", "2"):
            names = [[Path(p).name for p in r["keys"][workers][epoch][0]] for r in ranks]
            assert len(names[0]) == len(names[1]) == 10  # 19 samples: one of padding
            assert ranks[0]["keys"][workers][epoch][2] == ranks[1]["keys"][workers][epoch][2] == 4  # batches
            union = names[0] + names[1]
            assert set(union) == all_names and len(union) == len(all_names) + 1
        for r in ranks:  # the same samples, augmented the same, with 0 and 2 workers
            assert r["keys"]["0"][epoch] == r["keys"]["2"][epoch]
    assert ranks[0]["keys"]["0"]["0"] != ranks[0]["keys"]["0"]["1"]

    # distributed validation equals one process over the whole split (same model, batch size and threads)
    gathered, single = ranks[0]["val"]["gathered"], ranks[0]["val"]["single"]
    assert gathered == ranks[1]["val"]["gathered"] == single
    assert single["figures"][6] > 0 and single["figures"][2] > 0  # a comparison of something, not of zeros

    # --cache ram: one shared mapping per node, already unlinked while the ranks run, so nothing outlives them
    for rank in ranks:
        shm = rank["shm"]
        assert shm["node_cache"] and shm["mapped"] and not shm["exists"] and shm["pixels_equal"]
    assert ranks[0]["shm"]["path"] == ranks[1]["shm"]["path"]
    assert not Path(ranks[0]["shm"]["path"]).exists()


@pytest.mark.slow
def test_train_py_on_two_ranks_from_shards(converted, tmp_path) -> None:
    """An anchor-free family (yolo11n) from shards on two ranks: the data path does not depend on the family."""
    _, shard_yaml = converted
    import train

    before = set(Path("/dev/shm").glob("yolo-train-cache-*"))  # other tests may run beside this one
    argv = [
        "--data",
        str(shard_yaml),
        "--cfg",
        "yolo11n.yaml",
        "--project",
        str(tmp_path),
        "--name",
        "exp",
        "--imgsz",
        "64",
        "--batch-size",
        "8",
        "--workers",
        "1",
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--noplots",
        "--cache",
        "ram",
        "--shard-window",
        "8",
    ]
    codes, outputs = main_on_ranks(train.main, argv, 2, tmp_path)
    assert codes == [0, 0], "".join(outputs)[-3000:]
    assert "one copy shared by the 2 ranks of this node" in outputs[0]
    rows = (tmp_path / "exp" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and (tmp_path / "exp" / "weights" / "best.pt").is_file()
    left = set(Path("/dev/shm").glob("yolo-train-cache-*")) - before
    if left:  # a test beside this one may hold a segment for the moment it takes to fill and unlink it
        time.sleep(2)
    assert not [p for p in left if p.exists()]


def test_image_weights_on_shards_is_refused_at_start_up_in_one_line(
    converted, train_here, tmp_path, monkeypatch
) -> None:
    _, shard_yaml = converted
    import utils.data.labels as labels_module

    def no_index(*args, **kwargs):
        raise AssertionError("the shard index was built before the refusal")

    monkeypatch.setattr(labels_module, "read_shard_table", no_index)
    status, log = train_here("--data", shard_yaml, "--project", tmp_path, "--epochs", "1", "--image-weights")
    assert status == 1, log
    line = log.splitlines()[-1]
    assert line.startswith("ERROR --image-weights") and "tar shards" in line and str(shard_yaml) in line, line
    assert not (tmp_path / "exp").exists()


def test_data_yaml_names_shards_in_every_form(converted, tmp_path) -> None:
    sh = converted[1].parent
    folder = tmp_path / "only-train"
    folder.mkdir()
    for i in range(4):
        shutil.copy(sh / f"train-00000{i}.tar", folder)
    (tmp_path / "list.txt").write_text(f"# shards\n{sh}/train-{{000000..000001}}.tar\nonly-train/train-000002.tar\n")
    want = [str(sh / f"train-00000{i}.tar") for i in range(4)]
    forms = {
        "folder": ("only-train", [str(folder / f"train-00000{i}.tar") for i in range(4)]),
        "txt": ("list.txt", [*want[:2], str(folder / "train-000002.tar")]),
        "list": (f"['{sh}/train-000000.tar', '{sh}/train-{{000001..000003}}.tar']", want),
    }
    for name, (spec, urls) in forms.items():
        yaml_file = tmp_path / f"{name}.yaml"
        yaml_file.write_text(f"path: {tmp_path}\ntrain: {spec}\nval: {sh}/val-000000.tar\nnames: [red, blue]\n")
        assert list(load_data_config(yaml_file)["train"].urls) == urls, name
    (folder / "stray.jpg").write_bytes(b"")  # a folder with images is a folder of images, whatever else it holds
    yaml_file.write_text(f"path: {tmp_path}\ntrain: only-train\nval: {sh}/val-000000.tar\nnames: [red, blue]\n")
    assert isinstance(load_data_config(yaml_file)["train"], str)


def test_shards_written_by_webdataset_itself_load_and_train_also_over_pipe(tmp_path, monkeypatch, train_here) -> None:
    # The form WebDataset's own writer makes: keys in folders, PNG/WebP/BMP beside JPEG (PIL-encoded from arrays
    # by the writer), members this trainer does not read (.json, .cls), a background without .txt, an empty .txt.
    import webdataset as wds

    rng = np.random.default_rng(0)
    plan = [
        ("set/a/im0", "png", 2),
        ("set/a/im1", "jpg", 1),
        ("set/b/im2", "webp", 2),
        ("im3", "bmp", None),
        ("im4", "jpeg", 0),
    ]  # (key, image type, boxes; None: no .txt member)
    label_text: dict[str, str | None] = {}
    shard = tmp_path / "foreign-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i, (key, ext, n_boxes) in enumerate(plan):
            img = np.full((48, 64, 3), int(rng.integers(60, 200)), np.uint8)  # h 48, w 64
            rows = []
            for _ in range(n_boxes or 0):
                cls, (x1, y1) = int(rng.integers(0, 2)), rng.integers(0, 32, 2)
                cv2.rectangle(img, (int(x1), int(y1)), (int(x1) + 24, int(y1) + 12), COLOURS[cls], -1)
                rows.append(f"{cls} {(x1 + 12.5) / 64:.6f} {(y1 + 6.5) / 48:.6f} {25 / 64:.6f} {13 / 48:.6f}")
            sample = {"__key__": key, "json": {"source": "another tool", "index": i}, "cls": i % 2}
            if ext in ("png", "jpg"):
                sample[ext] = img[..., ::-1].copy()  # an RGB array: the writer encodes it with PIL
            else:
                params = [cv2.IMWRITE_WEBP_QUALITY, 101] if ext == "webp" else []  # 101: lossless WebP
                sample[ext] = cv2.imencode(f".{ext}", img, params)[1].tobytes()
            if n_boxes is not None:
                sample["txt"] = "\n".join(rows)
            label_text[key] = sample.get("txt")
            sink.write(sample)
    members = tar_members(shard)
    yaml_file = tmp_path / "foreign.yaml"
    yaml_file.write_text(f"path: {tmp_path}\ntrain: foreign-000000.tar\nval: foreign-000000.tar\nnames: [red, blue]\n")

    split = load_data_config(yaml_file)["val"]
    assert isinstance(split, ShardSet)
    labels = load_labels(split, nc=2, verbose=False)
    assert labels.counts == {**labels.counts, "labelled": 3, "background": 1, "empty": 1, "corrupt": 0}
    _, dataset = create_dataloader(split, 64, 2, 32, workers=0, nc=2)
    assert sorted(f.rsplit(".tar/", 1)[1] for f in dataset.im_files) == sorted(f"{key}.{ext}" for key, ext, _ in plan)
    for i, im_file in enumerate(dataset.im_files):
        member = im_file.rsplit(".tar/", 1)[1]
        pixels, original_hw, _ = dataset.load_image(i)
        assert original_hw == (48, 64)
        np.testing.assert_array_equal(pixels, cv2.imdecode(np.frombuffer(members[member], np.uint8), cv2.IMREAD_COLOR))
        text = label_text[member.rsplit(".", 1)[0]]
        np.testing.assert_array_equal(dataset.labels[i], parse_label_text(text, 2)[0] if text else np.zeros((0, 5)))

    # Trained with its training split read over pipe: (the WebDataset convention for any fetch command).
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "node-cache"))
    yaml_file.write_text(f"path: {tmp_path}\ntrain: pipe:cat {shard}\nval: foreign-000000.tar\nnames: [red, blue]\n")
    status, _ = train_here(
        "--data",
        yaml_file,
        "--project",
        tmp_path,
        "--name",
        "exp",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--allow-pipe",
    )
    assert status == 0
    rows = (tmp_path / "exp" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and (tmp_path / "exp" / "weights" / "last.pt").is_file()
    assert [p.read_bytes() for p in (tmp_path / "node-cache").glob("*.tar")] == [shard.read_bytes()]


def _png_sample_tar(path: Path, keys: list[str]) -> list[int]:
    """A shard of small labelled PNG samples; returns each member's header offset."""
    png = cv2.imencode(".png", np.full((32, 32, 3), 90, np.uint8))[1].tobytes()
    write_tar(path, {f"{k}.{ext}": data for k in keys for ext, data in (("png", png), ("txt", b"0 0.5 0.5 0.2 0.2\n"))})
    with tarfile.open(path) as tar:
        return [m.offset for m in tar.getmembers()]


def test_shard_cut_inside_a_tar_header_is_skipped_and_named(tmp_path) -> None:
    from utils.data.webshards import read_shard_table

    _png_sample_tar(tmp_path / "c-000000.tar", ["a", "b"])
    headers = _png_sample_tar(tmp_path / "c-000001.tar", ["c", "d", "e"])
    cut = tmp_path / "c-000001.tar"
    cut.write_bytes(cut.read_bytes()[: headers[3] + 100])  # an interrupted copy: the 4th header is cut short
    shards = ShardSet((str(tmp_path / "c-000000.tar"), str(cut)), "test")
    table, _ = read_shard_table(shards, nc=1, cache=ShardCache(tmp_path / "cache"))
    assert table.counts["bad_shards"] == 1 and list(table.shard_counts) == [2, 0]
    assert any(m.startswith(f"{cut}: unreadable or truncated shard") for m in table.messages)


def test_huge_member_is_skipped_and_counted_without_being_read(tmp_path) -> None:
    import tracemalloc

    from utils.data import webshards

    path = tmp_path / "h-000000.tar"
    _png_sample_tar(path, ["a"])
    huge = webshards.MAX_MEMBER_BYTES + (1 << 20)
    with tarfile.open(path) as tar:
        end = tar.getmembers()[-1].offset_data + 512  # the end of the last (small) member's block
    info = tarfile.TarInfo("big.png")
    info.size = huge
    with open(path, "r+b") as f:  # a sparse member: its bytes take no disk space
        f.seek(end)
        f.write(info.tobuf())
        f.truncate(end + 512 + huge + 1024)
    shards = ShardSet((str(path),), "test")
    tracemalloc.start()
    try:
        table, _ = webshards.read_shard_table(shards, nc=1, cache=ShardCache(tmp_path / "cache"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # never read whole
    assert table.counts["corrupt"] == 1 and len(table.usable()) == 1
    assert any("big.png: member of" in m and "bound" in m for m in table.messages)


def test_shards_py_and_the_shard_index_keep_the_data_limits(tmp_path, caplog) -> None:
    """shards.py takes --allow-pipe and --max-pixels as train.py does: a pipe: source runs nothing without the
    opt-in, and an image over the cap is skipped before it is decoded, in the files it converts and in a shard."""
    import struct

    from shards import main

    yaml_file = write_rectangles_dataset(tmp_path / "loose", n_train=3, n_val=2, size=40)  # 1600 pixels each
    cv2.imwrite(str(tmp_path / "loose/images/train/large.jpg"), np.full((60, 60, 3), 90, np.uint8))
    (tmp_path / "loose/labels/train/large.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    cv2.imwrite(str(tmp_path / "loose/images/train/tiffy.tif"), np.full((40, 40, 3), 90, np.uint8))
    (tmp_path / "loose/labels/train/tiffy.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    assert (
        main(["--data", str(yaml_file), "--out", str(tmp_path / "sh"), "--workers", "0", "--max-pixels", "2000"]) == 0
    )
    members = tar_members(tmp_path / "sh" / "train-000000.tar")
    assert len(members) == 8 and not any("large" in name for name in members)  # 4 samples of image and label
    written = load_data_config(tmp_path / "sh" / "data.yaml")["train"]
    assert len(load_shard_index(written, nc=2, cache=ShardCache(tmp_path / "cache"), verbose=False).usable()) == 4
    # A shard holding an image whose header claims 65535x65535 (23 bytes): skipped, named and counted, not decoded.
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, 65535, 65535, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    png = cv2.imencode(".png", np.full((32, 32, 3), 90, np.uint8))[1].tobytes()
    write_tar(tmp_path / "b-000000.tar", {"bomb.jpg": b"\xff\xd8" + sof + b"\xff\xd9", "ok.png": png})
    table = load_shard_index(
        ShardSet((str(tmp_path / "b-000000.tar"),), "test"), nc=1, cache=ShardCache(tmp_path / "cache"), verbose=False
    )
    assert table.counts["corrupt"] == 1 and len(table.usable()) == 1
    assert any(
        "bomb.jpg: corrupt image, skipped (image size 65535x65535 is over --max-pixels" in m for m in table.messages
    )
    # A data YAML whose split is a pipe: command: refused in one line that names the opt-in, the command not run.
    marker = tmp_path / "marker"
    piped = tmp_path / "piped.yaml"
    piped.write_text(f'path: {tmp_path}\ntrain: "pipe:touch {marker}; exit 1"\nval: "pipe:true"\nnames: [a]\n')
    LOGGER.addHandler(caplog.handler)
    try:
        assert main(["--data", str(piped), "--out", str(tmp_path / "sh2"), "--workers", "0"]) == 1
        assert "runs a shell command; it was not run. To run it, pass --allow-pipe" in caplog.text
        # With the opt-in the source is taken, and refused as shards are (shards.py converts loose files)
        assert main(["--data", str(piped), "--out", str(tmp_path / "sh2"), "--workers", "0", "--allow-pipe"]) == 1
        assert "'train' already names shards" in caplog.text
    finally:
        LOGGER.removeHandler(caplog.handler)
    assert not marker.exists()


def test_a_pax_length_past_any_offset_is_a_bad_shard_not_a_traceback(tmp_path) -> None:
    """The fuzzer's shard: a PAX record whose length (10**20) the standard library's tar reader cannot seek to
    (OverflowError) is skipped and named as any damaged shard is."""
    from utils.data.webshards import read_shard_table

    _png_sample_tar(tmp_path / "p-000000.tar", ["a"])
    record = b"99999999999999999999 path=x\n"
    header = tarfile.TarInfo("PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(record)
    bad = tmp_path / "p-000001.tar"
    bad.write_bytes(header.tobuf(format=tarfile.USTAR_FORMAT) + record.ljust(512, b"\0") + bytes(1024))
    shards = ShardSet((str(tmp_path / "p-000000.tar"), str(bad)), "test")
    table, _ = read_shard_table(shards, nc=1, cache=ShardCache(tmp_path / "cache"))
    assert table.counts["bad_shards"] == 1 and list(table.shard_counts) == [1, 0]
    assert any(m.startswith(f"{bad}: unreadable or truncated shard, skipped (OverflowError") for m in table.messages)
