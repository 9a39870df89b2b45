"""The scripts' command lines agree (utils/cli.py), their help shows defaults and groups, runs go under ./runs,
the training presets (demo vs any other data) and the inference image size taken from the checkpoint."""

from __future__ import annotations

import argparse
import logging
import os
import types
from pathlib import Path

import pytest
import torch
import yaml

import check_data
import detect
import export
import shards
import train
import val
from models.yolo import Model
from utils.checkpoint import latest_last_checkpoint, model_state, save_checkpoint
from utils.engine.resume import resumed_config
from utils.formats import open_runner
from utils.formats.metadata import ModelMeta
from utils.log import LOGGER

SCRIPTS = {
    "train.py": train,
    "val.py": val,
    "detect.py": detect,
    "export.py": export,
    "shards.py": shards,
    "check_data.py": check_data,
}
# Which scripts take each shared option (as YOLOv5 has them); "imgsz" is also --img and --img-size everywhere.
SHARED = {
    "imgsz": {"train.py", "val.py", "detect.py", "export.py", "check_data.py"},
    "workers": {"train.py", "val.py", "shards.py", "check_data.py"},
    "device": {"train.py", "val.py", "detect.py", "export.py"},
    "project": {"train.py", "val.py", "detect.py"},
    "name": {"train.py", "val.py", "detect.py"},
    "exist_ok": {"train.py", "val.py", "detect.py"},
    "half": {"val.py", "detect.py", "export.py"},
    "end2end": {"val.py", "detect.py", "export.py"},
}


def _actions(script: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in SCRIPTS[script].build_parser()._actions}


def test_shared_options_have_one_spelling_alias_default_and_help_in_every_script() -> None:
    for dest, scripts in SHARED.items():
        specs = {}
        for script in SCRIPTS:
            action = _actions(script).get(dest)
            assert (action is not None) == (script in scripts), (dest, script)
            if action is None:
                continue
            help_text = action.help
            if dest == "imgsz":  # the first clause is shared; what a left-out size means is the script's
                help_text = help_text.split(";")[0].replace(" (one value, or h w)", "")
            default = action.default
            if dest == "project":  # runs/<the script's task>
                assert default == str(Path("runs") / script.removesuffix(".py"))
                default = "runs/<task>"
            if dest == "device" and script == "export.py":  # traced on the CPU unless asked, as YOLOv5 does
                assert default == "cpu"
                default = ""
            specs[script] = (tuple(action.option_strings), action.type, default, help_text, action.required)
        assert len(set(specs.values())) == 1, (dest, specs)
    assert _actions("train.py")["imgsz"].option_strings == ["--imgsz", "--img", "--img-size"]
    assert _actions("val.py")["project"].default == os.path.join("runs", "val")
    amp = _actions("train.py")["amp"]
    assert amp.option_strings == ["--amp", "--no-amp"] and amp.default is True


def test_inference_scripts_describe_a_left_out_image_size_alike() -> None:
    helps = {s: _actions(s)["imgsz"].help.split(";", 1)[1] for s in ("val.py", "detect.py", "export.py")}
    assert len(set(helps.values())) == 1 and "checkpoint" in helps["val.py"], helps


def test_help_shows_every_default_and_groups_the_options() -> None:
    for script, module in SCRIPTS.items():
        parser = module.build_parser()
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert action.required or "default" in shown, (script, action.dest, shown)
        ungrouped = [a.dest for a in parser._optionals._group_actions if not isinstance(a, argparse._HelpAction)]
        assert ungrouped == [], (script, ungrouped)  # every option sits in a named group
        assert "(default: 16)" in train.build_parser().format_help()
    titles = [g.title for g in train.build_parser()._action_groups]
    for word in ("data", "model", "schedule", "augmentation", "distributed", "output"):
        assert any(word in title for title in titles), (word, titles)


def test_export_half_writes_fp16_files_on_the_cpu(trained_at_64) -> None:
    """In export.py --half is the precision of the written file, on any device; the name says it."""
    (path,) = export.run(weights=str(trained_at_64), half=True, device="cpu", include=["torchscript"])
    assert path.name == "at64_fp16.torchscript" and open_runner(path).meta.precision == "fp16"


def test_detect_needs_a_source(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        detect.build_parser().parse_args(["--weights", "x.pt"])
    assert e.value.code == 2 and "--source" in capsys.readouterr().err


# ---- the training presets --------------------------------------------------------------------------------


def test_the_demo_preset_applies_to_the_built_in_data_only(rectangles_yaml) -> None:
    for argv in ([], ["--data", "shapes.yaml"], ["--data", str(train.ROOT / "data/shapes.yaml")]):
        opt, explicit = train.parse_opt(argv)
        assert (opt.cfg, opt.imgsz, opt.epochs) == ("yolo11n.yaml", 192, 22), argv
        assert train.preset_line(opt, explicit) == (
            "defaults: --cfg yolo11n.yaml --imgsz 192 --epochs 22, fewer if the "
            "whole run would not end within 270 s (preset: the built-in demo's)"
        )
    opt, explicit = train.parse_opt(["--data", str(rectangles_yaml)])
    assert (opt.cfg, opt.imgsz, opt.epochs) == ("yolov5n.yaml", 640, 100)
    assert "--cfg yolov5n.yaml --imgsz 640 --epochs 100 (preset: YOLOv5's, for any --data but" in train.preset_line(
        opt, explicit
    )
    opt, explicit = train.parse_opt(["--data", str(rectangles_yaml), "--img", "320"])  # explicit flags win
    assert (opt.imgsz, opt.epochs) == (320, 100)
    assert train.preset_line(opt, explicit).startswith("defaults: --cfg yolov5n.yaml --epochs 100 ")
    opt, explicit = train.parse_opt(["--cfg", "yolov8n.yaml", "--epochs", "3", "--imgsz", "64"])
    assert (opt.cfg, opt.imgsz, opt.epochs) == ("yolov8n.yaml", 64, 3) and train.preset_line(opt, explicit) is None
    # --cfg '' (YOLOv5's way of saying "none") is the same as leaving it out.
    opt, explicit = train.parse_opt(["--cfg", "", "--epochs", "3", "--imgsz", "64"])
    assert opt.cfg == "yolo11n.yaml" and train.preset_line(opt, explicit).startswith("defaults: --cfg yolo11n.yaml ")
    # A model from --weights is the checkpoint's own: the preset gives no --cfg then.
    opt, explicit = train.parse_opt(["--weights", "some.pt", "--epochs", "3", "--imgsz", "64"])
    assert opt.cfg is None and train.preset_line(opt, explicit) is None
    # The other defaults do not depend on the data.
    assert vars(train.parse_opt([])[0]).keys() == vars(train.parse_opt(["--data", str(rectangles_yaml)])[0]).keys()
    assert train.parse_opt(["--data", str(rectangles_yaml)])[0].batch_size == train.parse_opt([])[0].batch_size


def _budget(*argv: str) -> tuple:
    config = train.make_launch(*train.parse_opt(list(argv))).config
    return config.epochs, config.time, config.time_includes_startup, config.time_max_epochs


def test_the_demo_budgets_the_whole_run_unless_epochs_or_time_are_given(rectangles_yaml, tmp_path) -> None:
    assert _budget() == (22, 270 / 3600, True, 22)  # at most its 22 epochs, as many as end within 270 s
    assert _budget("--epochs", "5") == (5, None, False, None)  # an explicit length is kept as it is
    assert _budget("--time", "0.5") == (22, 0.5, False, None)  # --time: the training's hours, no cap
    assert _budget("--data", str(rectangles_yaml)) == (100, None, False, None)  # any other data: no budget
    assert _budget("--evolve", "2") == (22, None, False, None)  # generations would share one process's budget
    assert _budget("--resume", str(tmp_path / "last.pt")) == (22, None, False, None)  # a run keeps its own


def test_a_resumed_run_keeps_its_own_size_and_length_unless_epochs_is_given(tmp_path) -> None:
    last = tmp_path / "exp/weights/last.pt"
    run_opt = vars(train.parse_opt(["--data", "some/data.yaml", "--imgsz", "96", "--epochs", "7"])[0])
    ckpt = {"optimizer": {}, "epoch": 3, "opt": run_opt}  # the options as checkpoints before config_schema 1 held them
    for stored in (
        ckpt,
        {
            "optimizer": {},
            "epoch": 3,
            "config_schema": 1,
            "config": train.make_launch(
                *train.parse_opt(["--data", "some/data.yaml", "--imgsz", "96", "--epochs", "7"])
            ).config.to_dict(),
        },
    ):
        opt, explicit = train.parse_opt(["--resume", str(last)])  # the demo's defaults: not the run's
        assert train.preset_line(opt, explicit) is None
        launch = train.make_launch(opt, explicit)
        restored = resumed_config(launch.config, launch.resume.explicit, last, stored)
        assert (restored.imgsz, restored.epochs, restored.data, restored.time) == (96, 7, "some/data.yaml", None)
        launch = train.make_launch(*train.parse_opt(["--resume", str(last), "--epochs", "12"]))
        assert resumed_config(launch.config, launch.resume.explicit, last, stored).epochs == 12


# ---- run folders -----------------------------------------------------------------------------------------


def test_every_script_saves_runs_under_the_current_directory() -> None:
    for script, task in (("train.py", "train"), ("val.py", "val"), ("detect.py", "detect")):
        assert _actions(script)["project"].default == str(Path("runs") / task)
    assert "runs/evolve" in _actions("train.py")["evolve"].help


def test_evolve_goes_under_the_current_directory_with_its_absolute_folder(tmp_path, monkeypatch) -> None:
    import utils.engine.evolve as evolution
    import utils.search.records as records
    from utils.distributed import DistInfo

    trained = []
    monkeypatch.setattr(
        evolution,
        "train",
        lambda config, *a, **k: trained.append(config.project) or types.SimpleNamespace(results=[0.5] * 7),
    )
    monkeypatch.setattr(records, "plot_evolve", lambda *a: None)
    monkeypatch.chdir(tmp_path)
    launch = train.make_launch(*train.parse_opt(["--evolve", "1"]))
    folder = evolution.evolve(launch.config, torch.device("cpu"), DistInfo(rank=-1, local_rank=-1, world_size=1))
    assert folder == tmp_path.resolve() / "runs/evolve/exp" and trained == [str(folder)]
    assert (folder / "evolve.csv").is_file()


def test_resume_without_a_path_takes_the_newest_last_pt_here_or_beside_train_py(tmp_path, monkeypatch) -> None:
    here, legacy = tmp_path / "work", tmp_path / "install"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "ROOT", legacy)
    new_style = here / "runs/train/exp/weights/last.pt"
    old_style = legacy / "runs/train/exp3/weights/last.pt"
    for path in (new_style, old_style):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    os.utime(old_style, (1000, 1000))
    monkeypatch.chdir(here)

    def newest(*argv: str) -> Path:
        return latest_last_checkpoint(*train.make_launch(*train.parse_opt(list(argv))).resume.latest_under)

    assert newest("--resume") == new_style
    os.utime(new_style, (10, 10))  # the run beside train.py is the newer one
    assert newest("--resume") == old_style
    assert newest("--resume", "--project", "runs/train") == new_style  # an explicit project: only there


@pytest.mark.slow
def test_a_run_under_the_current_directory_records_its_absolute_folder_and_resumes_from_anywhere(
    train_here, rectangles_yaml, tmp_path, monkeypatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    status, log = train_here("--data", rectangles_yaml, "--epochs", "1", "--noval")
    assert status == 0, log
    folder = tmp_path / "a/runs/train/exp"
    recorded = yaml.safe_load((folder / "opt.yaml").read_text())["save_dir"]
    assert recorded == str(folder.resolve()) and Path(recorded).is_absolute()
    monkeypatch.chdir(tmp_path / "b")  # another working directory: the relative path given is resolved once
    status, log = train_here("--resume", "../a/runs/train/exp/weights/last.pt", "--epochs", "2", "--noval")
    assert status == 0, log
    ckpt = torch.load(folder / "weights/last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["config"]["save_dir"] == str(folder.resolve())
    assert not (tmp_path / "b/runs").exists()


# ---- inference image size --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_at_64(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Model("models/yolov5n.yaml", nc=2)
    model.names = ["red", "blue"]
    path = tmp_path_factory.mktemp("weights") / "at64.pt"
    save_checkpoint({**model_state(model), "opt": {"imgsz": 64}}, path)
    return path


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = _Lines()
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)  # the scripts' run() log at INFO without setup_logging; conftest restores the level
    yield handler.lines
    LOGGER.removeHandler(handler)


def test_trained_size_is_read_from_ours_yolov5s_and_ultralytics_records() -> None:
    from utils.checkpoint import trained_imgsz
    from utils.formats.metadata import default_imgsz

    assert trained_imgsz({"opt": {"imgsz": 64}}) == 64
    assert trained_imgsz({"yolov5": {"opt": {"imgsz": 320}}}) == 320
    assert trained_imgsz({"yolov5": {"opt": {"img_size": [512, 512]}}}) == 512  # older YOLOv5
    assert trained_imgsz({"yolov5": {"train_args": {"imgsz": 416}}}) == 416
    assert trained_imgsz({"yolov5": {"opt": {}}}) is None and trained_imgsz({}) is None
    meta = ModelMeta(names=["a"], stride=32, kind="pytorch")
    assert default_imgsz(meta) == (640, "the default; the checkpoint does not record its training size")
    meta.trained_imgsz = 96
    assert default_imgsz(meta) == (96, "from the checkpoint")
    meta.imgsz = (128, 128)  # an exported file takes only its own size
    assert default_imgsz(meta) == (128, "from the exported file")


def test_one_image_size_policy_for_val_detect_export_and_the_predictor(log_lines, monkeypatch) -> None:
    """inference_imgsz: left out, the trained size (logged); not a stride multiple, raised to one (warned), one value
    or h w; an exported file's fixed shape wins (logged); nonsense is one line. The predictor's detect(), val.py,
    detect.py and export.py all take their size from it."""
    from utils.errors import UserError
    from utils.evaluation.predictor import Predictor
    from utils.formats.metadata import inference_imgsz

    meta = ModelMeta(names=["a"], stride=32, kind="pytorch", trained_imgsz=96)
    assert inference_imgsz(meta, None) == (96, 96) and "image size 96 (from the checkpoint)" in log_lines
    assert inference_imgsz(meta, 100) == (128, 128) and inference_imgsz(meta, [100]) == (128, 128)
    assert "image size 100 is not a multiple of the stride 32: using 128" in log_lines
    assert inference_imgsz(meta, [64, 100]) == (64, 128) and inference_imgsz(meta, [320, 640]) == (320, 640)
    for bad in ([1, 2, 3], [0], -32):
        with pytest.raises(UserError, match="--imgsz"):
            inference_imgsz(meta, bad)
    fixed = ModelMeta(names=["a"], stride=32, kind="onnx", imgsz=(160, 160))
    assert inference_imgsz(fixed, 640, "m.onnx") == (160, 160) and inference_imgsz(fixed, None) == (160, 160)
    assert "m.onnx: exported for 160x160 input; using that size" in log_lines
    seen = []
    real = inference_imgsz
    monkeypatch.setattr(
        "utils.formats.metadata.inference_imgsz", lambda *a: seen.append(a[1]) or real(*a)
    )  # the predictor looks it up at call time, as the scripts do
    predictor = Predictor.__new__(Predictor)
    predictor.letterboxed = lambda images, shape: seen.append(shape) or iter(())
    predictor.runner = types.SimpleNamespace(meta=meta)
    assert predictor.detect([], 100) == [] and seen == [100, (128, 128)]
    for script in (val, detect, export):  # each script's one size: through the policy, never its own rule
        source = Path(script.__file__).read_text(encoding="utf-8")
        assert "inference_imgsz(" in source and "default_imgsz" not in source and "% meta.stride" not in source


@pytest.mark.slow
def test_val_detect_and_export_default_to_the_size_the_checkpoint_was_trained_at(
    trained_at_64, rectangles_yaml, tmp_path, monkeypatch, log_lines, capsys
) -> None:
    import utils.data.loader

    sizes = []
    real = utils.data.loader.create_dataloader
    monkeypatch.setattr(
        utils.data.loader,
        "create_dataloader",
        lambda path, imgsz, *a, **k: sizes.append(imgsz) or real(path, imgsz, *a, **k),
    )
    val.run(
        data=str(rectangles_yaml),
        weights=str(trained_at_64),
        device="cpu",
        workers=0,
        noplots=True,
        project=str(tmp_path / "val"),
    )
    assert sizes == [64] and "image size 64 (from the checkpoint)" in log_lines
    log_lines.clear()
    source = Path(rectangles_yaml).parent / "images/val"
    detect.run(
        weights=str(trained_at_64),
        source=str(next(source.iterdir())),
        device="cpu",
        nosave=True,
        project=str(tmp_path / "detect"),
    )
    assert "image size 64 (from the checkpoint)" in log_lines and ": 64x64 " in capsys.readouterr().out
    log_lines.clear()
    (path,) = export.run(weights=str(trained_at_64), include=["torchscript"])
    assert "image size 64 (from the checkpoint)" in log_lines
    assert open_runner(path).meta.imgsz == (64, 64)
    log_lines.clear()
    detect.run(
        weights=str(path),
        source=str(next(source.iterdir())),
        device="cpu",
        nosave=True,
        project=str(tmp_path / "detect"),
    )
    assert "image size 64 (from the exported file)" in log_lines


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (train, ["--batchsize", "4"], "unrecognized arguments: --batchsize 4 (did you mean --batch-size?)"),
        (train, ["--epoch", "1"], "unrecognized arguments: --epoch 1 (did you mean --epochs?)"),  # no abbreviation
        (val, ["--weights", "w.pt", "--conf", "0.1"], "(did you mean --conf-thres?)"),
        (train, ["--imgsz", "0"], "argument --imgsz/--img/--img-size: '0' is not an integer of at least 1"),
        (train, ["--seed", "-1"], "argument --seed: '-1' is not an integer from 0"),
        (train, ["--freeze", "-3"], "argument --freeze: '-3' is not an integer from 0"),
        (train, ["--time", "inf"], "argument --time: 'inf' is not a finite number above 0"),
        (train, ["--time", "nan"], "argument --time: 'nan' is not a finite number above 0"),
        (train, ["--epochs", "0"], "argument --epochs: '0' is not an integer of at least 1"),
        (val, ["--weights", "w.pt", "--batch-size", "0"], "argument --batch-size: '0' is not an integer of at least 1"),
        (detect, ["--weights", "w.pt", "--imgsz", "-640"], "'-640' is not an integer of at least 1"),
    ],
)
def test_bad_flags_are_argparse_error_lines_with_a_suggestion(script, argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        script.build_parser().parse_args(["--data", "d.yaml", *argv] if script is not detect else argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_weights_help_names_ultralytics_checkpoints() -> None:
    for script in (train, val, detect, export):
        assert "Ultralytics'" in _actions(f"{script.__name__}.py")["weights"].help, script.__name__


def test_device_has_one_parser_that_the_scripts_and_the_device_code_read(capsys) -> None:
    """--device is read by utils/cli.py: parse_device alone: argparse gives its one written form (or its error line)
    and select_device, CUDA_VISIBLE_DEVICES, the shared-GPU check and the one-process check read the same form."""
    from utils.cli import DeviceRequest, device_option, parse_device
    from utils.distributed import DistInfo, check_one_process_per_gpu
    from utils.errors import UserError
    from utils.torch_utils import local_ranks_share_a_gpu

    assert parse_device(" CUDA:0, 1 ") == DeviceRequest(gpus=(0, 1)) and str(parse_device("2,2")) == "2,2"
    assert parse_device("CPU") == DeviceRequest(cpu=True) and parse_device("") == DeviceRequest()
    assert parse_device("1,0,1").distinct == (1, 0)
    for bad in ("gpu", "0,", "-1", "\u0663", "0;1"):
        with pytest.raises(UserError, match="not valid"):
            parse_device(bad)
    for script in SHARED["device"]:
        assert _actions(script)["device"].type is device_option, script
    assert train.build_parser().parse_args(["--device", "Cuda:1, 2"]).device == "1,2"
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--device", "gpu"])
    assert "argument --device: 'gpu' is not valid" in capsys.readouterr().err
    one_process = DistInfo(rank=-1, local_rank=-1, world_size=1)
    with pytest.raises(UserError, match="names 2 GPUs but this is one process"):
        check_one_process_per_gpu("CUDA:0, CUDA:1", one_process, "train.py")
    check_one_process_per_gpu("CPU", one_process, "train.py")
    assert local_ranks_share_a_gpu("cuda:0,cuda:0", 2) and not local_ranks_share_a_gpu("CPU", 2)
