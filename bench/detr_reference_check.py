"""Our DETR families against the official repositories, by hand (the official code never enters this repository).

    python bench/detr_reference_check.py --family dfine --repo /path/to/D-FINE [--scales n s m l x]
    python bench/detr_reference_check.py --family rtdetrv2 --repo /path/to/RT-DETR/rtdetrv2_pytorch

For each scale, a fresh process builds the official model from its COCO config with random weights (the
backbone's pretrained download off), counts its parameters, saves its state dict as a release file
(``{"model": ..., "ema": {"module": ...}}``) and runs its deploy model and post-processor on a seeded batch of
images (random uint8 pixels / 255) at 640 x 640 (the official deploy size). This process then reads that ``.pth`` through
``--weights``' importer, runs our model on the same batch and compares: parameter counts; per image, the sorted
scores (within 1e-4) and each of our detections against the official one of the same class and score (boxes within
1e-3 px; near-ties may reorder). The official repositories need ``faster_coco_eval`` and ``calflops`` at import.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Each scale's official config and the backbone entry whose pretrained download is turned off.
OFFICIAL = {
    "dfine": {
        "backbone": "HGNetv2",
        "configs": {s: f"configs/dfine/dfine_hgnetv2_{s}_coco.yml" for s in "nsmlx"},
    },
    "rtdetrv2": {
        "backbone": "PResNet",
        "configs": {
            "r18": "configs/rtdetrv2/rtdetrv2_r18vd_120e_coco.yml",
            "r34": "configs/rtdetrv2/rtdetrv2_r34vd_120e_coco.yml",
            "r50": "configs/rtdetrv2/rtdetrv2_r50vd_6x_coco.yml",
            "r50m": "configs/rtdetrv2/rtdetrv2_r50vd_m_7x_coco.yml",
            "r101": "configs/rtdetrv2/rtdetrv2_r101vd_6x_coco.yml",
        },
    },
}
SIZE, BATCH, SEED = 640, 2, 0

# The narrowed D-FINE of tests/fixtures/detr/dfine_tiny.yaml in the official config's terms (an HGNetV2 arch of its
# own, registered in the official class for this build only).
TINY_DFINE = {
    "arch": {
        "stem_channels": [3, 8, 8],
        "stage_config": {
            "stage1": [8, 8, 16, 1, False, False, 3, 2],
            "stage2": [16, 8, 32, 1, True, False, 3, 2],
            "stage3": [32, 16, 64, 1, True, True, 5, 2],
            "stage4": [64, 16, 128, 1, True, True, 5, 2],
        },
        "url": "",
    },
    "overrides": {
        "num_classes": 3,
        "eval_spatial_size": [128, 128],
        "HGNetv2": {"name": "T", "use_lab": True, "return_idx": [1, 2, 3], "freeze_at": -1, "freeze_norm": False},
        "HybridEncoder": {
            "in_channels": [32, 64, 128],
            "hidden_dim": 32,
            "nhead": 4,
            "dim_feedforward": 64,
            "expansion": 0.5,
            "depth_mult": 0.34,
        },
        "DFINETransformer": {
            "feat_channels": [32, 32, 32],
            "hidden_dim": 32,
            "nhead": 4,
            "dim_feedforward": 64,
            "num_layers": 2,
            "eval_idx": -1,
        },
    },
    "size": 128,
}

# Run inside the official repository (its working directory and import path), in a fresh process per config:
# their registry keeps state between builds. argv: config, backbone entry, output folder, JSON of extra settings.
OFFICIAL_RUN = """
import json, sys, torch
sys.path.insert(0, '.')
from src.core import YAMLConfig
config, backbone, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed({seed})
overrides = extra.get('overrides', {{}})
if extra.get('arch'):
    from src.nn.backbone.hgnetv2 import HGNetv2
    HGNetv2.arch_configs['T'] = extra['arch']
overrides[backbone] = {{**overrides.get(backbone, {{}}), 'pretrained': False}}
cfg = YAMLConfig(config, **overrides)
model = cfg.model
params = sum(p.numel() for p in model.parameters())
state = model.state_dict()
torch.save({{'model': state, 'ema': {{'module': state}}}}, out + '/release.pth')
deploy, post = model.deploy().eval(), cfg.postprocessor.deploy()
pixels = torch.randint(0, 256, ({batch}, 3, {size}, {size}), generator=torch.Generator().manual_seed({seed}))
images = pixels.float() / 255
with torch.no_grad():
    labels, boxes, scores = post(deploy(images), torch.tensor([[{size}, {size}]] * {batch}))
torch.save({{'pixels': pixels.to(torch.uint8), 'labels': labels, 'boxes': boxes, 'scores': scores}}, out + '/official.pt')
print(json.dumps({{'params': params}}))
"""


def run_official(repo: Path, config: str, backbone: str, out: Path, extra: dict | None = None) -> int:
    code = OFFICIAL_RUN.format(seed=SEED, batch=BATCH, size=(extra or {}).get("size", SIZE))
    result = subprocess.run(
        [sys.executable, "-c", code, config, backbone, str(out), json.dumps(extra or {})],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{config}: the official build failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["params"]


def compare(ours: torch.Tensor, ref: dict[str, torch.Tensor]) -> tuple[float, float, int, int]:
    """Largest score difference (sorted), largest box difference of matched detections, how many of ours found no
    official detection of the same class and score within 1e-4 and box within 1e-3 px, and how many of those lie
    within 1e-4 of the 300th score (a near-tie at the cut: the other side of it holds the official one)."""
    score_diff = box_diff = 0.0
    unmatched = at_cut = 0
    for i, det in enumerate(ours):
        scores, boxes, labels = ref["scores"][i], ref["boxes"][i], ref["labels"][i]
        score_diff = max(score_diff, (det[:, 4].sort().values - scores.sort().values).abs().max().item())
        cut = float(scores.min())
        for row in det:
            same = (labels == row[5].long()) & ((scores - row[4]).abs() <= 1e-4)
            gap = (boxes[same] - row[:4]).abs().max(1).values.min().item() if same.any() else float("inf")
            if gap <= 1e-3:
                box_diff = max(box_diff, gap)
                continue
            unmatched += 1
            at_cut += float(row[4]) - cut <= 1e-4
    return score_diff, box_diff, unmatched, at_cut


def check_scale(family_name: str, scale: str, repo: Path) -> dict:
    from models.families import family_of
    from models.loading import load_model

    spec = OFFICIAL[family_name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        params = run_official(repo, spec["configs"][scale], spec["backbone"], out)
        ref = torch.load(out / "official.pt", weights_only=True)
        model, ckpt = load_model(out / "release.pth")
        with torch.no_grad():
            output0, _ = model(ref["pixels"].float() / 255)
    ours_params = sum(p.numel() for p in model.parameters())
    family = family_of(model)
    score_diff, box_diff, unmatched, at_cut = compare(output0, ref)
    return {
        "scale": f"{family.name}-{scale}",
        "read as": ckpt["model_cfg"]["yaml_file"],
        "official params": params,
        "our params": ours_params,
        "YAML params": ckpt["model_cfg"]["params"],
        "max score diff": f"{score_diff:.2e}",
        "max box diff px": f"{box_diff:.2e}",
        "unmatched of 600": unmatched,
        "of which near-ties at the 300th score": at_cut,
    }


def make_fixture(repo: Path, folder: Path) -> None:
    """tests/fixtures/detr/: the narrowed official D-FINE's release file and its deploy outputs."""
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        params = run_official(repo, OFFICIAL["dfine"]["configs"]["s"], "HGNetv2", Path(tmp), TINY_DFINE)
        release = torch.load(Path(tmp) / "release.pth", weights_only=True)
        # One copy of the weights (the file is a fixture in the repository); the importer prefers ``ema.module``.
        torch.save({"ema": {"module": release["model"]}}, Path(tmp) / "release.pth")
        shutil.copyfile(Path(tmp) / "release.pth", folder / "dfine_tiny_official.pth")
        shutil.copyfile(Path(tmp) / "official.pt", folder / "dfine_tiny_official_out.pt")
    print(f"{folder}: the narrowed official D-FINE ({params} parameters) and its outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(OFFICIAL), required=True)
    parser.add_argument("--repo", type=Path, required=True, help="the official repository (outside this project)")
    parser.add_argument("--scales", nargs="*", help="default: every scale")
    parser.add_argument("--make-fixture", type=Path, help="write the narrowed D-FINE's fixture to this folder")
    opt = parser.parse_args()
    if opt.make_fixture:
        return make_fixture(opt.repo.resolve(), opt.make_fixture)
    for scale in opt.scales or list(OFFICIAL[opt.family]["configs"]):
        print(json.dumps(check_scale(opt.family, scale, opt.repo.resolve())), flush=True)


if __name__ == "__main__":
    main()
