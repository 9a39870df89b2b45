"""Convert a dataset (loose files with YOLO labels, a COCO JSON or Pascal VOC: any form a data YAML names) into
WebDataset tar shards.

Usage:
    python shards.py --data data.yaml --out DIR [--max-size MB] [--max-count N]

Writes ``DIR/train-000000.tar ...`` and ``DIR/val-000000.tar ...`` (each sample: ``key.<image ext>`` with the
image's bytes unchanged, and ``key.txt`` with its verified label rows), per split an index (``.npz``, used by
training) and a ``wids`` shard list (``DIR/<split>-index.json``: URL and sample count per shard), and
``DIR/data.yaml`` naming the shards. Images and labels are verified on the way in with the label cache's checks;
what is skipped is counted and reported.
"""

from __future__ import annotations

from utils.versions import require_supported_versions

require_supported_versions()  # first: on an older Python or torch the imports below fail with a traceback

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import yaml

from utils.cli import WORKERS, add_allow_pipe, add_max_pixels, add_workers, apply_data_limits, make_parser
from utils.data.config import SPLITS, load_data_config
from utils.data.label_table import LabelTable
from utils.data.labels import load_labels
from utils.data.shard_names import ShardSet
from utils.data.webshards import load_shard_index
from utils.errors import UserError, run_reporting_errors
from utils.log import LOGGER, setup_logging


def sample_key(im_file: str, root: Path, used: set[str]) -> str:
    """A unique WebDataset key for an image: its path under the root, without the extension and with no dots
    (WebDataset splits a member name at the first dot of its base name)."""
    try:
        rel = Path(im_file).relative_to(root)
    except ValueError:
        rel = Path(Path(im_file).name)
    base = str(rel.with_suffix("")).replace(os.sep, "_").replace(".", "_")
    key, k = base, 1
    while key in used:
        key, k = f"{base}_{k}", k + 1
    used.add(key)
    return key


def label_text(labels: np.ndarray) -> str:
    """Rows ``cls x y w h``; ``%.9g`` keeps every float32 digit, so labels read back equal."""
    return "".join(f"{int(r[0])} {r[1]:.9g} {r[2]:.9g} {r[3]:.9g} {r[4]:.9g}\n" for r in labels)


def write_split(
    label_set: LabelTable, root: Path, out: Path, split: str, max_bytes: float, max_count: int
) -> list[str]:
    """Write one split's shards; returns their file names in order."""
    import webdataset

    out.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    pattern = str(out / f"{split}-%06d.tar")
    with webdataset.ShardWriter(
        pattern, maxcount=max_count, maxsize=max_bytes, verbose=0, start_shard=0, post=None
    ) as writer:
        for im_file, labels in zip(label_set.im_files, label_set.labels):
            ext = Path(im_file).suffix.lower().lstrip(".")
            ext = "jpg" if ext == "jpeg" else ext
            with open(im_file, "rb") as f:
                data = f.read()
            writer.write({"__key__": sample_key(im_file, root, used), ext: data, "txt": label_text(labels)})
        written = writer.shard  # shards opened so far (the next one's number)
    return [Path(pattern % k).name for k in range(written)]


def brace_pattern(split: str, files: list[str]) -> str:
    return f"{split}-{{000000..{len(files) - 1:06d}}}.tar" if len(files) > 1 else files[0]


def convert(
    data: str, out: str | Path, max_size_mb: float = 1000.0, max_count: int = 10000, workers: int = WORKERS
) -> Path:
    """Convert every split of ``data``; returns the path of the new data YAML."""
    if max_size_mb <= 0 or max_count < 1:
        raise UserError(f"--max-size {max_size_mb} and --max-count {max_count} must be positive")
    cfg = load_data_config(data)
    out = Path(out).resolve()
    root = Path(cfg["path"])
    new_cfg: dict = {"path": str(out), "names": dict(enumerate(cfg["names"]))}
    for split in SPLITS:
        source = cfg.get(split)
        if source is None:
            continue
        if isinstance(source, ShardSet):
            raise UserError(f"{cfg['yaml_file']}: '{split}' already names shards")
        label_set = load_labels(
            source, nc=cfg["nc"], workers=workers, prefix=f"{split}: "
        )  # any form: files, COCO, VOC
        files = write_split(label_set, root, out, split, max_size_mb * 1e6, max_count)
        shards = ShardSet(tuple(str(out / f) for f in files), f"{out}/{split}")
        index = load_shard_index(shards, nc=cfg["nc"], workers=workers, prefix=f"{split}: ", verbose=False)
        wids_index = {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "name": split,
            "shardlist": [{"url": f, "nsamples": int(c)} for f, c in zip(files, index.shard_counts)],
        }
        (out / f"{split}-index.json").write_text(json.dumps(wids_index, indent=1))
        skipped = label_set.counts.get("corrupt", 0)
        LOGGER.info(
            f"{split}: {len(label_set.im_files)} samples in {len(files)} shard(s) written to {out}; "
            f"{skipped} corrupt image(s) or label file(s) skipped, "
            f"{label_set.counts.get('duplicates', 0)} duplicate row(s) dropped"
        )
        new_cfg[split] = brace_pattern(split, files)
    yaml_out = out / "data.yaml"
    yaml_out.write_text(yaml.safe_dump(new_cfg, sort_keys=False))
    LOGGER.info(f"data YAML for the shards: {yaml_out}")
    return yaml_out


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("Convert a YOLO dataset (data YAML) into WebDataset tar shards")
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, help="dataset YAML of loose files")
    add_workers(data)
    add_allow_pipe(data)
    add_max_pixels(data)
    output = p.add_argument_group("output")
    output.add_argument("--out", required=True, help="output folder for the shards, their index and data.yaml")
    output.add_argument("--max-size", type=float, default=1000.0, help="shard size limit in MB")
    output.add_argument("--max-count", type=int, default=10000, help="samples per shard at most")
    return p


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    setup_logging()

    def run() -> None:
        apply_data_limits(opt)  # the pixel cap of every probe below, and whether a pipe: source may run
        convert(opt.data, opt.out, opt.max_size, opt.max_count, opt.workers)

    return run_reporting_errors(run)


if __name__ == "__main__":
    sys.exit(main())
