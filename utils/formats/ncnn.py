"""NCNN (``best_ncnn_model/``, ``best_fp16_ncnn_model/``): converted by pnnx, run with the ncnn package (for ARM
phones and boards). The folder holds ``model.ncnn.param``, ``model.ncnn.bin`` and ``metadata.yaml``, as
Ultralytics' NCNN folders do; pnnx's intermediate files are removed.

fp16: weights stored in fp16 (pnnx ``fp16=True``), run with ncnn's fp16 storage; an fp32 folder runs with fp16
storage off, so that it computes what PyTorch computes. No INT8: ncnn's calibration and quantization tools
(ncnn2table, ncnn2int8) are not on the package registry.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from utils.errors import UserError
from utils.formats.base import ExportJob, ExportOptions, Format, Runner
from utils.formats.metadata import ModelMeta
from utils.log import LOGGER

PARAM, BIN = "model.ncnn.param", "model.ncnn.bin"
INPUT, OUTPUT = "in0", "out0"  # the blob names pnnx gives the first input and output
# pnnx's intermediate files: a TorchScript trace, its own graph, a PyTorch and an ncnn Python script, an ONNX file.
INTERMEDIATES = {
    "ptpath": "model.pt",
    "pnnxparam": "model.pnnx.param",
    "pnnxbin": "model.pnnx.bin",
    "pnnxpy": "model_pnnx.py",
    "pnnxonnx": "model.pnnx.onnx",
    "ncnnpy": "model_ncnn.py",
}


def _convert(job: ExportJob, folder: Path, scratch: Path) -> None:
    """Trace, then pnnx's converter on the trace (the command line ``pnnx.export`` runs, here run in a scratch
    folder, where it also writes its debug files, and with its output kept for the error message)."""
    import pnnx

    trace = scratch / INTERMEDIATES["ptpath"]
    with warnings.catch_warnings():  # tracing is deprecated in favour of torch.export; pnnx reads traces
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the head's shape arithmetic, fixed in the trace
        torch.jit.trace(job.module, job.example, strict=False, check_trace=False).save(str(trace))
    shape = ",".join(str(v) for v in job.example.shape)
    command = [
        pnnx.EXEC_PATH,
        str(trace),
        f"inputshape=[{shape}]f32",
        "device=cpu",
        "optlevel=2",
        f"ncnnparam={folder / PARAM}",
        f"ncnnbin={folder / BIN}",
        f"fp16={int(job.precision == 'fp16')}",
    ]
    command += [f"{key}={scratch / name}" for key, name in INTERMEDIATES.items() if key != "ptpath"]
    done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, check=False)
    LOGGER.debug(done.stdout + done.stderr)
    if done.returncode or not (folder / PARAM).is_file() or not (folder / BIN).is_file():
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"{job.path}: pnnx could not convert the model (exit status {done.returncode}: {last})")


class NcnnRunner(Runner):
    """An NCNN folder run by the ncnn package, one image per extractor (any batch)."""

    def __init__(self, path: Path, device: torch.device):
        import ncnn

        self.meta = ModelMeta.from_yaml(path, "ncnn")
        self.meta.batch = None  # ncnn takes one image at a time whatever batch the folder was exported at
        fp16 = self.meta.precision == "fp16"
        self.net = ncnn.Net()
        self.net.opt.num_threads = torch.get_num_threads()
        self.net.opt.use_vulkan_compute = False
        self.net.opt.use_fp16_packed = self.net.opt.use_fp16_storage = fp16
        self.net.opt.use_fp16_arithmetic = False  # fp16 storage, fp32 arithmetic: what the gate checks against
        self.net.opt.use_bf16_storage = False
        if self.net.load_param(str(path / PARAM)) or self.net.load_model(str(path / BIN)):
            raise UserError(f"{path}: ncnn cannot read {PARAM} / {BIN}")
        self._mat = ncnn.Mat
        self.device = torch.device("cpu")

    def run(self, images: torch.Tensor) -> torch.Tensor:
        outputs = []
        for image in images.detach().cpu().float().numpy():
            with self.net.create_extractor() as extractor:
                extractor.input(INPUT, self._mat(np.ascontiguousarray(image)).clone())
                status, out = extractor.extract(OUTPUT)
                if status:
                    raise UserError(f"ncnn: extracting {OUTPUT} failed (status {status})")
                outputs.append(np.array(out))
        return torch.from_numpy(np.stack(outputs)).float()


class NcnnFormat(Format):
    name = "ncnn"
    suffix = "_ncnn_model"
    precisions = ("fp32", "fp16")
    packages = ("ncnn", "pnnx")
    description = "NCNN (ARM phones and boards)"

    def check_request(self, options: ExportOptions, precision: str) -> None:
        if precision == "int8":
            raise UserError(
                "--include ncnn: no int8 files (ncnn's INT8 tools, ncnn2table and ncnn2int8, are not on "
                "the package registry); ncnn writes fp32 and fp16"
            )
        if options.end2end:
            raise UserError(
                "--end2end: ncnn has no top-k and gather layers, which the end-to-end output needs; export "
                "ncnn without --end2end (its NMS then runs after the network)"
            )
        super().check_request(options, precision)

    def write(self, job: ExportJob) -> str:
        """Into a scratch folder beside the target, which replaces the target only when complete."""
        with tempfile.TemporaryDirectory(dir=job.path.parent, prefix=f".{job.path.name}.") as scratch:
            folder = Path(scratch) / job.path.name
            folder.mkdir()
            _convert(job, folder, Path(scratch))
            job.meta.copy(batch=job.export_batch).write_yaml(folder, export_batch=job.export_batch)
            if job.path.exists():
                shutil.rmtree(job.path)
            folder.rename(job.path)
        return "pnnx" + (", fp16 weights" if job.precision == "fp16" else "")

    def open(self, path: Path, device: torch.device) -> Runner:
        return NcnnRunner(path, device)


FORMAT = NcnnFormat()
