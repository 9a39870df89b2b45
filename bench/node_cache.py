"""What ``--cache ram`` adds to memory: one process against 2 ranks on one node (one /dev/shm copy per node).

Run by hand from the repo root: ``python bench/node_cache.py [--data DATA_YAML] [--imgsz 640]``. It starts the
measurement once as a plain process and once under ``torch.distributed.run --nproc_per_node 2``; each process
reads its PSS (``/proc/self/smaps_rollup``: shared pages are split between the processes mapping them, so the sum
over processes counts shared memory once) before and after building the cached training dataset, and the
launcher prints the sum of the increases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COCO128 = ROOT.parent / "shared" / "datasets" / "coco128.yaml"


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def measure(data: str, imgsz: int, out: Path) -> None:
    """One process's share: PSS increase from building the cached dataset (after labels are loaded)."""
    import torch

    from utils.data.config import load_data_config
    from utils.data.dataset import DatasetOptions
    from utils.data.loader import build_dataset, load_labels
    from utils.distributed import dist_info, init_process_group

    info = dist_info()
    if info.is_distributed:
        init_process_group(torch.device("cpu"), info)
    labels = load_labels(load_data_config(data)["train"], verbose=False)
    before = pss_bytes()
    dataset = build_dataset(labels, imgsz, 16, DatasetOptions(cache="ram", augment=True))
    if info.is_distributed:
        torch.distributed.barrier()  # every rank has attached and filled before anyone measures
    after = pss_bytes()
    shared = hasattr(dataset, "node_cache")
    (out / f"rank{max(info.rank, 0)}.json").write_text(json.dumps({"delta": after - before, "shared": shared}))
    if info.is_distributed:
        torch.distributed.barrier()


def launch(nproc: int, data: str, imgsz: int) -> tuple[int, bool]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = (
            [sys.executable]
            if nproc == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        )
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(
            [*prefix, __file__, "--measure", tmp, "--data", data, "--imgsz", str(imgsz)], check=True, env=env, cwd=ROOT
        )
        parts = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
    return sum(p["delta"] for p in parts), all(p["shared"] for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=str(COCO128))
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--measure", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.data, args.imgsz, Path(args.measure))
        return
    one, _ = launch(1, args.data, args.imgsz)
    two, shared = launch(2, args.data, args.imgsz)
    mib = 1 << 20
    print(
        f"--cache ram adds {one / mib:.1f} MiB (1 process) and {two / mib:.1f} MiB (2 ranks, PSS summed, "
        f"{'one shared copy' if shared else 'private copies'}): {two / one:.2f}x"
    )


if __name__ == "__main__":
    main()
