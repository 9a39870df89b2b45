"""Reading the records W&B writes beside a run (``wandb/<offline->run-<date>-<id>/run-<id>.wandb``).

W&B keeps no public reader for these files, so this is a small one. The format is LevelDB's log: a 7-byte
header (``:W&B``, a magic number, a version), then 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of
type and data, length, type: full, first, middle, last) and data; a record is one full chunk or a first, middles
and a last. Each record is a protobuf ``wandb.proto.wandb_internal_pb2.Record``. A file cut short (W&B buffers
its writes, so a killed process leaves a part or nothing) is read up to its last complete record.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

FILE_HEADER = 7
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def record_bytes(path: Path) -> Iterator[bytes]:
    """The records of a .wandb file as bytes, up to the first incomplete or damaged one."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER or data[:4] != b":W&B":
        return
    pos, parts = FILE_HEADER, []
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            return
        pos += CHUNK_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE and parts:
            parts.append(chunk)
        elif kind == LAST and parts:
            yield b"".join(parts + [chunk])
            parts = []


@dataclass
class WandbRunFiles:
    """What the .wandb files of one run id hold: the run ids seen, history rows, files saved, artifacts."""

    run_ids: set[str] = field(default_factory=set)
    history: list[dict[str, Any]] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    folders: list[Path] = field(default_factory=list)

    def epochs(self) -> dict[str, set[int]]:
        """The epochs held per metric name (rows carry their epoch under ``epoch``)."""
        held: dict[str, set[int]] = {}
        for row in self.history:
            epoch = _whole(row.get("epoch"))
            if epoch is not None:
                for key in row:
                    if not key.startswith("_") and key != "epoch":
                        held.setdefault(key, set()).add(epoch)
        return held

    def last_step(self) -> int:
        """The last ``_step`` written (-1 when none); a step that is not a whole number is not one."""
        return max((s for row in self.history if (s := _whole(row.get("_step"))) is not None), default=-1)


def _whole(value: Any) -> int | None:
    """A record's epoch or step as an int: a whole number of at least 0 (``2`` or ``2.0``), else None (text, a
    boolean, NaN, an infinity: a damaged record is not an epoch)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value < 2**63 else None


def run_folders(wandb_dir: Path, run_id: str) -> list[Path]:
    """The folders W&B made for ``run_id`` under ``<wandb_dir>/wandb`` (one per process), oldest first."""
    root = Path(wandb_dir) / "wandb"
    return sorted(p for p in root.glob(f"*-{run_id}") if p.is_dir() and (p / f"run-{run_id}.wandb").exists())


def read_run(wandb_dir: Path, run_id: str) -> WandbRunFiles:
    """Everything the .wandb files of ``run_id`` under ``wandb_dir`` hold."""
    from wandb.proto import wandb_internal_pb2

    out = WandbRunFiles(folders=run_folders(wandb_dir, run_id))
    for folder in out.folders:
        for raw in record_bytes(folder / f"run-{run_id}.wandb"):
            record = cast(Any, wandb_internal_pb2).Record()  # a protobuf class made at import, unseen by the checker
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.run_ids.add(record.run.run_id)
            elif kind == "history":
                out.history.append(
                    {
                        item.nested_key[0] if item.nested_key else item.key: _value(item.value_json)
                        for item in record.history.item
                        if len(item.nested_key) <= 1
                    }
                )
            elif kind == "files":
                out.files.update(f.path for f in record.files.files)
    return out


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
