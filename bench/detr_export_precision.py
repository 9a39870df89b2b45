"""The DETR families' exports at every precision through export.py's accuracy gate, on narrowed models whose val
split is labelled with the PyTorch model's own detections.

    python bench/detr_export_precision.py --out /tmp/detr-precision

A narrowed model with random weights detects nothing real, so on a real val split both it and its files score 0
and the gate says nothing. Here the val images (random pixels, written losslessly) are labelled with what the
PyTorch model itself detects on them (its best detections lying inside the image, ``--per-image`` per image on
average): the PyTorch model scores close to 1, and a file's mAP50-95 is how closely it reproduces those detections,
ranked as PyTorch ranks them. The models: D-FINE from tests/fixtures/detr/dfine_tiny_official.pth (the official
code's initialisation) and the narrowed RT-DETRv2 of tests/test_detr.py with its convolutions and norms
initialised as PyTorch initialises them (transformers' initialisation ties every encoder score: docs/deploy.md).

For each family and precision (fp32, fp16, int8: INT8 calibrated on as many train images, random pixels too) it
runs ``export.py --include onnx openvino --data ...`` and prints the gate's table (and the one line naming
the files set aside or the refusal). Only mAP is measured: the gate's latency runs are cut to 3 (``--latency-runs``) to save time.

    python bench/detr_export_precision.py --out /tmp/detr-trained --trained 40

measures models that have learnt something instead: each family's narrowed model of tests/test_detr_train.py
(``--queries`` 30 of a 128 px image's 336 tokens) trained by train.py for that many epochs on generated rectangles,
the gate on their val split (a finished run in ``--out`` is reused). ``--int8-scope`` widens or narrows what INT8
keeps float, to see what the family's ``Int8Scope`` buys.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the narrowed models of tests/test_detr.py and test_detr_train.py

import export  # noqa: E402
from models.families import DFINE  # noqa: E402
from models.loading import load_model  # noqa: E402
from utils.checkpoint import save_checkpoint  # noqa: E402
from utils.errors import UserError  # noqa: E402

SIZE = 128
FIXTURES = ROOT / "tests" / "fixtures" / "detr"


def dfine_checkpoint(folder: Path) -> Path:
    """The narrowed D-FINE the official code built (tests/fixtures/detr), as a checkpoint of ours."""
    table = yaml.safe_load((FIXTURES / "dfine_tiny.yaml").read_text())
    DFINE.scales = lambda: table  # type: ignore[method-assign]  # the narrowed scale, for this process only
    model, _ = load_model(FIXTURES / "dfine_tiny_official.pth")
    path = folder / "dfine_tiny.pt"
    save_checkpoint({"model_cfg": model.yaml, "model": model.state_dict(), "names": ["a", "b", "c"]}, path)
    return path


def rtdetrv2_checkpoint(folder: Path) -> Path:
    """The narrowed RT-DETRv2 of tests/test_detr.py, convolutions and norms as PyTorch initialises them."""
    from test_detr import narrowed_rtdetrv2

    hf = narrowed_rtdetrv2()
    for module in hf.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.BatchNorm2d)):
            module.reset_parameters()
    hf.save_pretrained(folder / "rtdetrv2_tiny")
    model, ckpt = load_model(folder / "rtdetrv2_tiny")
    path = folder / "rtdetrv2_tiny.pt"
    save_checkpoint({"model_cfg": model.yaml, "model": model.state_dict(), "names": ["a", "b"]}, path)
    return path


def trained_checkpoint(name: str, folder: Path, epochs: int, queries: int) -> tuple[Path, Path]:
    """A narrowed model of the family (tests/test_detr_train.py's, ``queries`` queries) trained by train.py for
    ``epochs`` epochs on generated rectangles at SIZE x SIZE, without augmentation, at a rate a short run learns
    at; its last.pt and the data YAML (whose val split the gate reads). A finished run in ``folder`` is reused."""
    import train
    from tests.conftest import write_rectangles_dataset
    from tests.test_detr_train import FAMILIES

    family, table = FAMILIES[name]
    table = {**table, "config": {**table["config"], "num_queries": queries}}
    family.scales = lambda: table  # type: ignore[method-assign]  # the narrowed scale, for this process only
    weights = folder / "run" / "weights" / "last.pt"
    if weights.exists() and (folder / "data" / "rectangles.yaml").exists():
        return weights, folder / "data" / "rectangles.yaml"
    data = write_rectangles_dataset(folder / "data", n_train=64, n_val=32, size=SIZE, n_classes=3)
    recipe = yaml.safe_load((ROOT / family.default_hyp).read_text())
    short = {"lr0": 5e-4, "warmup_steps": 20, "ema_tau": 20.0, "photometric": 0.0, "zoom_out": 0.0, "iou_crop": 0.0}
    hyp = folder / "hyp.yaml"
    hyp.write_text(yaml.safe_dump({**recipe, **short}))
    status = train.main(
        ["--cfg", f"{name}-tiny.yaml", "--data", str(data), "--hyp", str(hyp), "--epochs", str(epochs),
         "--imgsz", str(SIZE), "--batch-size", "8", "--workers", "0", "--device", "cpu", "--noplots", "--noval",
         "--seed", "0", "--project", str(folder), "--name", "run", "--exist-ok"]
    )  # fmt: skip
    if status:
        raise SystemExit(f"train.py stopped with status {status}")
    return weights, data


def self_labelled_split(weights: Path, folder: Path, n_train: int, n_val: int, per_image: int) -> Path:
    """Random-pixel images (PNG), the val ones labelled with the model's own best detections (those lying inside
    the image, above one score chosen so that there are ``per_image`` per image on average); the data YAML."""
    model, _ = load_model(weights)
    model.eval()
    rng = np.random.default_rng(0)
    found = []
    for split, n in (("train", n_train), ("val", n_val)):
        (folder / "images" / split).mkdir(parents=True, exist_ok=True)
        (folder / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            rgb = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            cv2.imwrite(str(folder / "images" / split / f"{i:04d}.png"), rgb[..., ::-1])
            (folder / "labels" / split / f"{i:04d}.txt").write_text("")
            if split == "val":
                with torch.no_grad():
                    det, _ = model(torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255)
                inside = [
                    d for d in det[0].tolist() if 0 <= d[0] < d[2] - 2 <= SIZE - 2 and 0 <= d[1] < d[3] - 2 <= SIZE - 2
                ]
                found.append(inside)
    scores = sorted((d[4] for dets in found for d in dets), reverse=True)
    cut = scores[min(per_image * n_val, len(scores)) - 1]
    for i, dets in enumerate(found):
        rows = [
            f"{int(c)} {(x1 + x2) / 2 / SIZE:.6f} {(y1 + y2) / 2 / SIZE:.6f} {(x2 - x1) / SIZE:.6f} {(y2 - y1) / SIZE:.6f}"
            for x1, y1, x2, y2, score, c in dets
            if score >= cut
        ]
        (folder / "labels" / "val" / f"{i:04d}.txt").write_text("\n".join(rows) + "\n" if rows else "")
    names = list(model.names)
    data = {"path": str(folder), "train": "images/train", "val": "images/val", "nc": len(names), "names": names}
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump(data))
    print(
        f"{weights.name}: val labels its {sum(s >= cut for s in scores)} detections scoring >= {cut:.4f} on {n_val} images"
    )
    return path


def set_int8_scope(kind: str) -> None:
    """Both families' INT8 scope, for this process: ``encoder`` widens it (the whole encoder, its convolutions too,
    and the input projections float: the backbone alone quantized); ``decoding`` narrows it to the detectors' own
    operations (anchors, top-k, output): the decoder, the encoder's attention and heads quantized too."""
    import dataclasses

    from models.families import RTDETRV2

    widened = ("detr.model.encoder", "detr.model.encoder_input_proj", "detr.model.decoder_input_proj")
    for family in (DFINE, RTDETRV2):
        own = family.int8_float_scope

        def changed(model: torch.nn.Module, own=own):  # type: ignore[no-untyped-def]
            scope = own(model)
            modules = scope.modules + widened if kind == "encoder" else ()
            return dataclasses.replace(scope, modules=modules)

        family.int8_float_scope = changed  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="working folder (models, data, exported files)")
    parser.add_argument("--families", nargs="+", default=["dfine", "rtdetrv2"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"])
    parser.add_argument("--formats", nargs="+", default=["onnx", "openvino"])
    parser.add_argument("--n-train", type=int, default=16, help="train images (INT8 calibration)")
    parser.add_argument("--n-val", type=int, default=8)
    parser.add_argument("--per-image", type=int, default=8, help="labels per val image: PyTorch's best detections")
    parser.add_argument("--latency-runs", type=int, default=3, help="the gate's latency runs (mAP only is measured)")
    parser.add_argument(
        "--trained", type=int, default=0, metavar="EPOCHS",
        help="instead: train each narrowed model this many epochs on generated rectangles, gate on their val split",
    )  # fmt: skip
    parser.add_argument("--queries", type=int, default=30, help="--trained: the decoder's queries (of 336 tokens)")
    parser.add_argument(
        "--int8-scope",
        choices=("family", "encoder", "decoding"),
        default="family",
        help="INT8: what stays float: the family's Int8Scope; or also the whole encoder; or only the anchors and top-k",
    )
    opt = parser.parse_args()
    from utils.evaluation import gate

    gate.LATENCY_RUNS, gate.LATENCY_WARMUP = opt.latency_runs, 1
    if opt.int8_scope != "family":
        set_int8_scope(opt.int8_scope)
    makers = {"dfine": dfine_checkpoint, "rtdetrv2": rtdetrv2_checkpoint}
    for name in opt.families:
        folder = opt.out / name
        folder.mkdir(parents=True, exist_ok=True)
        if opt.trained:
            weights, data = trained_checkpoint(name, folder, opt.trained, opt.queries)
        else:
            weights = makers[name](folder)
            data = self_labelled_split(weights, folder / "data", opt.n_train, opt.n_val, opt.per_image)
        for precision in opt.precisions:
            print(f"=== {name} {precision}", flush=True)
            try:  # a file set aside is named in the UserError after the gate's table is printed
                export.run(
                    weights=str(weights),
                    include=opt.formats,
                    imgsz=[SIZE],
                    data=str(data),
                    half=precision == "fp16",
                    int8=precision == "int8",
                )
            except UserError as e:
                print(f"{name} {precision}: {e}", flush=True)


if __name__ == "__main__":
    main()
