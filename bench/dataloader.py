"""Data pipeline benchmark: augmented samples/s on COCO128 and label-cache build/reload time for 20k images.

Run by hand from the repo root: ``python bench/dataloader.py [--images 20000] [--skip-coco] [--cache none ram]
[--repeats 5]``.
Shards against loose files on the same data (COCO128 converted with shards.py into a temporary folder):
``python bench/dataloader.py --shards [--repeats 5] [--cache none ram] --images 0``.
Side by side with a YOLOv5 checkout (its own create_dataloader / LoadImagesAndLabels, same settings, same
generated images): ``python bench/dataloader.py --yolov5 /path/to/yolov5 --yolov5-python /path/to/python``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.families import YOLOV5  # noqa: E402
from utils.data.config import load_data_config  # noqa: E402
from utils.data.image_files import img2label_path, list_image_files  # noqa: E402
from utils.data.loader import create_dataloader  # noqa: E402
from utils.data.yolo_labels import load_label_set  # noqa: E402
from utils.log import setup_logging  # noqa: E402

COCO128 = ROOT.parent / "shared" / "datasets" / "coco128.yaml"


def bench_augmented(
    workers: int, cache: str | None, epochs: int, imgsz: int = 640, batch_size: int = 16, data: Path = COCO128
) -> float:
    """Augmented (mosaic) training samples per second over the train split of ``data`` (COCO128 by default)."""
    cfg = load_data_config(data)
    hyp = YOLOV5.read_hyp(YOLOV5.default_hyp_path)
    loader, dataset = create_dataloader(
        cfg["train"],
        imgsz,
        batch_size,
        32,
        hyp=hyp,
        augment=True,
        shuffle=True,
        workers=workers,
        nc=cfg["nc"],
        cache=cache,
    )
    loader.sampler.set_epoch(0)
    for _ in loader:  # warm-up (worker start, page cache): a whole epoch, as training never leaves one early,
        pass  # so the stream already holds epoch 1's first batches, as YOLOv5's endless iterator does after its warm-up
    count, start = 0, time.perf_counter()
    for epoch in range(1, epochs + 1):
        loader.sampler.set_epoch(epoch)
        for imgs, *_ in loader:
            count += len(imgs)
    return count / (time.perf_counter() - start)


def bench_read_path(shard_yaml: Path, passes: int = 7) -> None:
    """Whole-image read + decode per image, files against shard members, alternating passes (no augmentation)."""
    from utils.data.image_io import decode_image, read_image
    from utils.data.loader import load_labels
    from utils.data.webshards import ShardReader

    files = load_labels(load_data_config(COCO128)["train"], verbose=False)
    shards = load_labels(load_data_config(shard_yaml)["train"], verbose=False)
    reader = ShardReader(shards)
    times: dict[str, list[float]] = {"files": [], "shards": []}
    for _ in range(passes):
        t0 = time.perf_counter()
        for f in files.im_files:
            read_image(f)
        times["files"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(len(shards.im_files)):
            decode_image(reader.read(i))
        times["shards"].append(time.perf_counter() - t0)
    n = len(files.im_files)
    print(
        f"read + decode per image, median of {passes} alternating passes over {n} images: files "
        f"{np.median(times['files']) / n * 1e3:.2f} ms, shards {np.median(times['shards']) / n * 1e3:.2f} ms"
    )


def bench_shards(caches: list[str], repeats: int, epochs: int) -> None:
    """Samples/s from COCO128 as shards against the same images as loose files, 0 and 2 workers, alternating."""
    from shards import convert

    tmp = Path(tempfile.mkdtemp(prefix="bench_shards_"))
    try:
        shard_yaml = convert(str(COCO128), tmp / "shards", max_size_mb=2.0)  # several shards, as a real set has
        bench_read_path(shard_yaml)
        for cache in caches:
            for workers in (0, 2):
                runs: dict[str, list[float]] = {"loose files": [], "shards": []}
                for _ in range(repeats):  # alternating: this machine's speed drifts from minute to minute
                    for name, data in (("loose files", COCO128), ("shards", shard_yaml)):
                        runs[name].append(
                            bench_augmented(workers, None if cache == "none" else cache, epochs, data=data)
                        )
                loose, sharded = (float(np.median(runs[k])) for k in ("loose files", "shards"))
                print(
                    f"COCO128 imgsz 640 mosaic, cache {cache}, workers={workers}: shards {sharded:.1f} samples/s "
                    f"({', '.join(f'{v:.1f}' for v in runs['shards'])}), loose files {loose:.1f} "
                    f"({', '.join(f'{v:.1f}' for v in runs['loose files'])}): {sharded / loose:.2f}x"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_tiny_dataset(root: Path, n: int) -> Path:
    """n small JPEGs (48x40, distinct pixels) with one label row each; every 10th has no label file."""
    images, labels = root / "images" / "train", root / "labels" / "train"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
    for i in range(n):
        base[i % 40, (i // 40) % 48] = i % 256
        ok, enc = cv2.imencode(".jpg", base)
        (images / f"{i:06d}.jpg").write_bytes(enc.tobytes())
        if i % 10:
            (labels / f"{i:06d}.txt").write_text(f"{i % 3} 0.5 0.5 0.3 0.4\n0 0.2 0.3 0.1 0.1\n")
    return images


def _pil_style_check(pair: tuple[str, str]) -> int:
    """Reference: per-image PIL open + verify + EXIF size + end-marker check, then parse the label file."""
    from PIL import Image, ImageOps

    im_file, lb_file = pair
    with Image.open(im_file) as im:
        im.verify()
    with Image.open(im_file) as im:
        _ = ImageOps.exif_transpose(im).size  # decodes as training would
    with open(im_file, "rb") as f:
        f.seek(-2, 2)
        f.read()
    if os.path.isfile(lb_file):
        with open(lb_file) as f:
            np.array([x.split() for x in f.read().strip().splitlines() if len(x)], dtype=np.float32)
    return 1


# Runs inside the YOLOv5 checkout with its Python: the same two measurements through its public functions.
YOLOV5_PROBE = r"""
import sys, time, yaml
from utils.dataloaders import create_dataloader, LoadImagesAndLabels
mode, arg, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "throughput":
    hyp = yaml.safe_load(open(sys.argv[4]))
    cache = sys.argv[5] if sys.argv[5] != "none" else False
    epochs = int(sys.argv[6])
    loader, _ = create_dataloader(arg, 640, 16, 32, hyp=hyp, augment=True, workers=workers, shuffle=True,
                                  cache=cache)
    for _ in loader:  # warm-up: one whole epoch, as ours
        pass
    count, start = 0, time.perf_counter()
    for _ in range(epochs):  # each pass over the loader is one epoch
        for batch in loader:
            count += len(batch[0])
    print(f"{count / (time.perf_counter() - start):.1f}")
else:
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        LoadImagesAndLabels(arg, 640, 16, augment=False)
        times.append(time.perf_counter() - t0)
    print(f"{times[0]:.2f} {times[1]:.3f}")
"""


def run_yolov5_probe(yolov5: str, python: str, *args: str) -> str:
    out = subprocess.run([python, "-c", YOLOV5_PROBE, *args], cwd=yolov5, capture_output=True, text=True)
    if out.returncode:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    return out.stdout.strip().splitlines()[-1]


def bench_cache(n: int, reference: bool, yolov5: str = "", yolov5_python: str = "") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    try:
        t0 = time.perf_counter()
        images = make_tiny_dataset(tmp, n)
        print(f"generated {n} images in {time.perf_counter() - t0:.1f}s")
        files = list_image_files(str(images))
        t0 = time.perf_counter()
        built = load_label_set(files, nc=3, source=str(images), workers=8)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_label_set(files, nc=3, source=str(images), workers=8)
        reload_s = time.perf_counter() - t0
        print(f"label cache, {n} images: build {build_s:.2f}s, reload {reload_s:.3f}s ({built.counts})")
        if yolov5:
            for cache in (images.parent.parent / "labels").glob("*.cache"):
                cache.unlink()  # YOLOv5 must build its own, not find ours
            build, reload = run_yolov5_probe(yolov5, yolov5_python, "cache", str(images), "0").split()
            print(
                f"YOLOv5 label cache, same {n} images: build {build}s, reload {reload}s "
                f"(ours builds in {build_s / float(build):.2f} of its time)"
            )
        if reference:
            pairs = [(f, img2label_path(f)) for f in files]
            workers = min(8, os.cpu_count() or 1)
            t0 = time.perf_counter()
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                sum(pool.imap(_pil_style_check, pairs, chunksize=64))
            print(
                f"reference PIL-verify scan of the same {n} images ({workers} processes): "
                f"{time.perf_counter() - t0:.2f}s"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--images", type=int, default=20000, help="images in the generated label-cache benchmark (0 skips it)"
    )
    parser.add_argument("--skip-coco", action="store_true", help="skip the COCO128 throughput benchmark")
    parser.add_argument("--reference", action="store_true", help="also time a PIL-verify style scan")
    parser.add_argument("--yolov5", default="", help="a YOLOv5 checkout to measure the same way")
    parser.add_argument("--yolov5-python", default=sys.executable, help="the Python that runs that checkout")
    parser.add_argument("--epochs", type=int, default=5, help="epochs timed after the warm-up epoch")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="throughput runs per setting, alternating with YOLOv5's; medians are compared",
    )
    parser.add_argument(
        "--cache",
        nargs="+",
        default=["none"],
        choices=["none", "ram"],
        help="image caches to measure the throughput with (both frameworks alike)",
    )
    parser.add_argument("--shards", action="store_true", help="only compare shards with loose files (COCO128)")
    args = parser.parse_args()
    if args.repeats < 1 or args.epochs < 1:
        parser.error("--repeats and --epochs must be at least 1")
    if args.images < 0:
        parser.error("--images must be 0 (skip the label-cache benchmark) or more")
    setup_logging(0)
    if args.shards:
        bench_shards(args.cache, args.repeats, args.epochs)
        return
    if not args.skip_coco:
        if COCO128.is_file():
            hyp_file = str(ROOT / "data" / "hyps" / "hyp.scratch-low.yaml")
            train_dir = load_data_config(COCO128)["train"]
            for cache in args.cache:
                for workers in (0, 2):
                    # Alternate the two frameworks and take medians: this machine's speed drifts by tens of
                    # percent between minutes, which single back-to-back runs turn into ratio noise.
                    ours_runs, theirs_runs = [], []
                    for _ in range(args.repeats):
                        ours_runs.append(bench_augmented(workers, None if cache == "none" else cache, args.epochs))
                        if args.yolov5:
                            theirs = run_yolov5_probe(
                                args.yolov5,
                                args.yolov5_python,
                                "throughput",
                                train_dir,
                                str(workers),
                                hyp_file,
                                cache,
                                str(args.epochs),
                            )
                            if not theirs.startswith("failed"):
                                theirs_runs.append(float(theirs))
                    ours = float(np.median(ours_runs))
                    line = f"COCO128 imgsz 640 mosaic, cache {cache}, workers={workers}: {ours:.1f} samples/s"
                    if args.repeats > 1:
                        line += f" (median of {', '.join(f'{v:.1f}' for v in ours_runs)})"
                    if args.yolov5:
                        if theirs_runs:
                            median = float(np.median(theirs_runs))
                            line += f"; YOLOv5: {median:.1f} samples/s"
                            if args.repeats > 1:
                                line += f" (median of {', '.join(f'{v:.1f}' for v in theirs_runs)})"
                            line += f", {ours / median:.2f}x"
                        else:
                            line += f"; YOLOv5: {theirs}"
                    print(line)
        else:
            print(f"{COCO128} not found: skipping the throughput benchmark")
    if args.images:
        bench_cache(args.images, args.reference, args.yolov5, args.yolov5_python)


if __name__ == "__main__":
    main()
