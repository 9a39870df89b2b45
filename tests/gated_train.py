"""train.py whose data loading first waits until the run's trackers have started (their ids in the run folder's
trackers.yaml), for the test that kills a launched run with trackers inside an epoch: on a loaded machine the
trackers (MLflow's import, W&B's service) can take longer to start than the whole tiny run.

    python -m torch.distributed.run ... tests/gated_train.py <train.py's arguments>

with GATE_TRACKERS_FILE (the trackers.yaml to watch) and GATE_TRACKERS (names, comma-separated) set. Waiting
delays the run and changes nothing it computes; after 180 s it goes on regardless.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def trackers_started(ids_file: Path, names: set[str]) -> bool:
    try:
        return names <= set(yaml.safe_load(ids_file.read_text()) or {})
    except OSError:
        return False


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import train
    from utils.data.dataset import YoloDataset

    ids_file, names = Path(os.environ["GATE_TRACKERS_FILE"]), set(os.environ["GATE_TRACKERS"].split(","))
    load, started = YoloDataset.__getitem__, []

    def gated(self, item):
        deadline = time.monotonic() + 180
        while not started and time.monotonic() < deadline:
            if trackers_started(ids_file, names):
                started.append(True)
            else:
                time.sleep(0.1)
        return load(self, item)

    YoloDataset.__getitem__ = gated
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
