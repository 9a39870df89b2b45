"""Run by tests/test_shards.py on 2 gloo ranks (or by hand under torch.distributed.run): one run, several checks.

Each rank writes ``OUT/rank{r}.json`` with
* ``keys``: per worker count (0, 2) and epoch, the sample names this rank's training loader gave, and a checksum
  of each augmented image (so that 0 and 2 workers can be compared sample by sample);
* ``val``: the figures of distributed validation (every rank validates its part, results gathered);
* ``shm``: whether the ``--cache ram`` images sit in one node-wide shared mapping that is already unlinked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.families import YOLOV5  # noqa: E402
from models.yolo import build_model  # noqa: E402
from utils.data.config import load_data_config  # noqa: E402
from utils.data.loader import create_dataloader, load_labels  # noqa: E402
from utils.data.shard_dataset import ShardDataset  # noqa: E402
from utils.distributed import destroy_process_group, dist_info, init_process_group  # noqa: E402
from utils.torch_utils import torch_distributed_zero_first  # noqa: E402
from utils.validation import OutputOptions, validate  # noqa: E402

IMGSZ, BATCH, WINDOW = 64, 3, 5


def training_keys(labels, info, workers: int) -> dict[str, list]:
    loader, _ = create_dataloader(
        None,
        IMGSZ,
        BATCH,
        32,
        hyp=YOLOV5.hyp_type(),
        augment=True,
        shuffle=True,
        workers=workers,
        world_size=info.world_size,
        global_rank=info.rank,
        label_set=labels,
        shard_window=WINDOW,
        seed=7,
        cache=None,
    )
    out: dict[str, list] = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        names, sums, batches = [], [], 0
        for imgs, _, paths, _ in loader:
            names += list(paths)
            sums += [int(im.to(torch.int64).sum()) for im in imgs]
            batches += 1
        out[str(epoch)] = [names, sums, batches]
    return out


def _figures(r) -> dict:
    cm = r.class_metrics
    return {
        "figures": [r.p, r.r, r.map50, r.map, r.n_images, r.n_instances, r.n_detections, r.losses.tolist()],
        "per_class": [cm.p.tolist(), cm.r.tolist(), cm.ap50.tolist(), cm.ap50_95.tolist()],
    }


def distributed_val(data: dict, info) -> dict:
    """Distributed validation on every rank, and (rank 0) one process over the whole split, same threads."""
    from models.loss import ComputeLoss

    torch.manual_seed(0)
    model = build_model(ROOT / "models/yolov5n.yaml", nc=2, names=["red", "blue"]).eval()
    loss = ComputeLoss(model, YOLOV5.read_hyp(YOLOV5.default_hyp_path))
    with torch_distributed_zero_first(info.local_rank):
        loader, _ = create_dataloader(
            data["val"],
            IMGSZ,
            2,
            32,
            rect=True,
            pad=0.5,
            workers=0,
            world_size=info.world_size,
            global_rank=info.rank,
            nc=2,
        )
    out = {
        "gathered": _figures(
            validate(
                model,
                loader,
                names=["red", "blue"],
                device="cpu",
                compute_loss=loss,
                gather=True,
                outputs=OutputOptions(main=info.rank == 0),
            )
        )
    }
    if info.rank == 0:
        whole, _ = create_dataloader(data["val"], IMGSZ, 2, 32, rect=True, pad=0.5, workers=0, nc=2)
        out["single"] = _figures(validate(model, whole, names=["red", "blue"], device="cpu", compute_loss=loss))
    return out


def shm_check(labels, out_dir: Path) -> dict:
    ds = ShardDataset(IMGSZ, BATCH, cache="ram", label_set=labels, prefix="shm: ")
    cache = getattr(ds, "node_cache", None)
    if cache is None:
        return {"node_cache": False}
    maps = Path("/proc/self/maps").read_text()
    private = ShardDataset(IMGSZ, BATCH, cache=None, label_set=labels)
    same = all(np.array_equal(ds.ram_images[i], private.load_image(i)[0]) for i in range(ds.n))
    same = same and all(private.load_image(i)[0].std() > 0 for i in range(ds.n))  # real pixels, not grey stand-ins
    return {
        "node_cache": True,
        "path": str(cache.path),
        "mapped": str(cache.path) in maps,
        "exists": cache.path.exists(),
        "pixels_equal": same,
        "nbytes": cache.nbytes,
    }


def main(argv: list[str] | None = None) -> None:
    yaml_file, out_dir = argv or sys.argv[1:3]
    out_dir = Path(out_dir)
    info = dist_info()
    init_process_group(torch.device("cpu"), info)
    data = load_data_config(yaml_file)
    with torch_distributed_zero_first(info.local_rank):  # local rank 0 builds the index, the other waits
        labels = load_labels(data["train"], nc=2, verbose=False)
    result = {
        "keys": {str(w): training_keys(labels, info, w) for w in (0, 2)},
        "val": distributed_val(data, info),
        "shm": shm_check(labels, out_dir),
    }
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_process_group()


if __name__ == "__main__":
    main()
