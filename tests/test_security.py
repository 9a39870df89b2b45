"""Hostile input (issue 49, "Security"): names that are paths, pipe: sources, image bombs, undecodable images."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

import check_data
import detect
from utils.data.config import load_data_config
from utils.data.labels import load_labels
from utils.data.sources import Frame
from utils.errors import UserError
from utils.safe_paths import MAX_BYTES, PathParts, safe_part


def test_safe_part_and_collisions() -> None:
    assert safe_part("../../../../outside") == "_._.._.._.._outside"
    assert safe_part("/srv/outside") == "_srv_outside"
    assert safe_part(".hidden") == "_hidden" and safe_part("") == "_" and safe_part("traffic light") == "traffic_light"
    assert len(safe_part("é" * 300).encode()) == MAX_BYTES
    parts = PathParts(["a/b", "a_b", "A_B", "a/b"])
    assert [parts.part(t) for t in ("a/b", "a_b", "A_B")] == ["a_b", "a_b_2", "A_B_3"]
    assert parts.part("x" * 300) == "x" * MAX_BYTES and parts.part("x" * 301) == "x" * (MAX_BYTES - 2) + "_2"


def _frame_outputs(save_dir: Path, names: list[str], path: str, kind: str = "image") -> None:
    """detect.py's outputs of one frame with two detections, one of each class, without running a model."""
    frame = Frame(path=path, image=np.full((64, 64, 3), 120, np.uint8), kind=kind, index=3, n_frames=5)
    det = np.array([[4, 4, 30, 30, 0.9, 0], [20, 20, 60, 60, 0.8, 1]], np.float32)
    opt = argparse.Namespace(
        save_txt=True, save_conf=True, save_crop=True, nosave=False, hide_labels=False, hide_conf=False
    )
    writers = detect._Writers(save_dir, names)
    try:
        detect._handle_frame(frame, det, names, opt, save_dir, writers, False, detect.DetectResults(save_dir))
    finally:
        writers.close()


def test_hostile_class_names_write_nothing_outside_the_run_folder(tmp_path) -> None:
    """Class names (from a data YAML or a checkpoint) climbing out with ../ or absolute, as detect.py's crop
    folders; a hostile stem too: nothing is written outside the run folder."""
    outside = tmp_path / "abs_outside"
    names = ["../../../../outside", str(outside)]
    save_dir = tmp_path / "a" / "b" / "runs" / "exp"
    save_dir.mkdir(parents=True)
    (save_dir / "labels").mkdir()
    before = set(tmp_path.rglob("*"))
    _frame_outputs(save_dir, names, str(tmp_path / "..jpg"))
    _frame_outputs(save_dir, names, str(tmp_path / "clip.mp4"), kind="video")
    new = set(tmp_path.rglob("*")) - before
    assert [p for p in new if save_dir.resolve() not in p.resolve().parents] == [] and not outside.exists()
    crops = {p.relative_to(save_dir).parts[1] for p in save_dir.glob("crops/*/*.jpg")}
    assert crops == {"_._.._.._.._outside", safe_part(str(outside))}
    assert {p.name for p in save_dir.glob("labels/*.txt")} == {"_.txt", "clip_3.txt"}


def _pipe_yaml(tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """A data YAML whose train entry is a pipe: command, and one whose shard list holds one."""
    command = f"pipe:touch {marker}; exit 1"
    direct = tmp_path / "direct.yaml"
    direct.write_text(f'path: {tmp_path}\ntrain: "{command}"\nval: "{command}"\nnames: [a]\n')
    (tmp_path / "shards.txt").write_text(f"{command}\n")
    listed = tmp_path / "listed.yaml"
    listed.write_text(f"path: {tmp_path}\ntrain: shards.txt\nval: shards.txt\nnames: [a]\n")
    return direct, listed


def test_pipe_sources_run_nothing_without_the_opt_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    for data in _pipe_yaml(tmp_path, marker):
        with pytest.raises(UserError, match="pipe: URL, which runs a shell command.*--allow-pipe"):
            load_labels(load_data_config(data)["train"], nc=1)
        assert check_data.main(["--data", str(data), "--workers", "0", "--noplots"]) == 1
        assert not marker.exists()


def test_pipe_sources_run_with_the_opt_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YOLO_TRAIN_SHARD_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    direct, listed = _pipe_yaml(tmp_path, marker)
    assert check_data.main(["--data", str(direct), "--workers", "0", "--noplots", "--allow-pipe"]) == 1  # exit 1
    assert marker.is_file()
    marker.unlink()
    monkeypatch.setenv("YOLO_ALLOW_PIPE", "1")
    with pytest.raises(UserError, match="cannot fetch shard"):  # the command ran, and failed as it was written to
        load_labels(load_data_config(listed)["train"], nc=1)
    assert marker.is_file()
