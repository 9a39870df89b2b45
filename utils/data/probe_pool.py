"""Probe many image files (size, usable or not) at once: in a process pool for large sets, in order."""

from __future__ import annotations

import multiprocessing
import os

from tqdm import tqdm

from utils.data.image_io import ImageError, probe_image

MIN_POOL_SIZE = 512  # below this many images a process pool costs more than it saves
Probe = tuple[tuple[int, int], str, str]  # (w, h) displayed, warning, error ('' when usable)


def _probe_one(path: str) -> Probe:
    try:
        shape, warning = probe_image(path)
        return shape, warning, ""
    except ImageError as e:
        return (0, 0), "", str(e)
    except OSError as e:
        return (0, 0), "", f"cannot read ({e.strerror or e})"


def _probe_chunk(paths: list[str]) -> list[Probe]:
    return [_probe_one(p) for p in paths]


def probe_files(paths: list[str], workers: int, desc: str = "", show_progress: bool = True) -> list[Probe]:
    """``probe_image`` of every path, in order; errors are returned, never raised."""
    n = len(paths)
    workers = max(1, min(workers, os.cpu_count() or 1))
    pooled = n >= MIN_POOL_SIZE and workers > 1
    step = max(16, min(1024, n // (workers * 8))) if pooled else 256
    chunks = [paths[i : i + step] for i in range(0, n, step)]
    out: list[Probe] = []
    with tqdm(total=n, desc=desc, unit="img", disable=not show_progress, leave=False) as bar:
        if pooled:
            methods = multiprocessing.get_all_start_methods()
            with multiprocessing.get_context("fork" if "fork" in methods else None).Pool(workers) as pool:
                for part in pool.imap(_probe_chunk, chunks):
                    out += part
                    bar.update(len(part))
        else:
            for chunk in chunks:
                out += _probe_chunk(chunk)
                bar.update(len(chunk))
    return out
