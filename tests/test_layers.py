"""The library's layers (docs/design.md, "Layers"): import-linter's contracts in pyproject.toml hold, fail on a planted
upward import and on a planted ``import train``, and place every module in exactly one layer; no module outside
models/families/ names a model family in its code."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from test_import_cycles import project_modules

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def contracts() -> dict[str, dict]:
    """import-linter's contracts in pyproject.toml, by id."""
    with open(CONFIG, "rb") as f:
        settings = tomllib.load(f)["tool"]["importlinter"]
    return {contract["id"]: contract for contract in settings["contracts"]}


def layers() -> list[list[tuple[str, bool]]]:
    """The layers contract's layers, highest first: (module, optional) per entry."""
    return [
        [(entry.strip().strip("()"), entry.strip().startswith("(")) for entry in line.split(":")]
        for line in contracts()["layers"]["layers"]
    ]


def lint(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LINT], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_the_contracts_hold_and_fail_on_a_planted_upward_import_and_on_import_train(tmp_path) -> None:
    """The tree keeps both contracts; a copy of the library where a block imports the families (upward) and a core
    module imports train breaks both, each naming the import."""
    for package in ("models", "utils"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copyfile(CONFIG, tmp_path / CONFIG.name)
    with open(tmp_path / "models/common.py", "a", encoding="utf-8") as f:
        f.write("\nfrom models.families import FAMILIES  # planted: a block importing the families\n")
    with open(tmp_path / "utils/boxes.py", "a", encoding="utf-8") as f:
        f.write("\nimport train  # planted: library code importing an entry script\n")
    tree, planted = lint(ROOT), lint(tmp_path)  # both at once: two cores
    tree_out, planted_out = tree.communicate(timeout=120)[0], planted.communicate(timeout=120)[0]
    assert tree.returncode == 0 and "Contracts: 2 kept, 0 broken." in tree_out, tree_out
    assert planted.returncode != 0 and "Contracts: 0 kept, 2 broken." in planted_out, planted_out
    assert "models.common is not allowed to import models.families" in planted_out
    assert "utils is not allowed to import train" in planted_out and "utils.boxes -> train" in planted_out


def test_every_module_sits_in_exactly_one_layer() -> None:
    """Each module of models/ and utils/ in one layer of the contract; every other module is an entry script the
    second contract forbids the library to import (docs/ holds tools of the documentation)."""
    entries = [name for layer in layers() for name, _ in layer]
    present = [name for layer in layers() for name, optional in layer if not optional]
    modules = project_modules()
    for name in present:
        assert name in modules, f"{name}: a layer of pyproject.toml's contracts that does not exist"
    roots = {"models", "utils"}
    scripts = set(contracts()["scripts"]["forbidden_modules"])
    for module in modules:
        if module.split(".")[0] not in roots:
            assert module in scripts or module.startswith("docs."), f"{module}: an entry script not forbidden"
        elif module not in roots:
            homes = [e for e in entries if module == e or module.startswith(e + ".")]
            assert len(homes) == 1, f"{module}: in {len(homes)} layers ({homes})"
    assert scripts == {"train", "val", "detect", "export", "shards", "check_data"}


# ---- no module outside models/families/ names a family ----------------------------------------------------

# A family's name as a word in code ("yolov5", "yolo11"; a config file such as "yolov5n.yaml" names a model), and
# the pieces that build such names: regexes ("YOLO(v8|11)"), templates (f"yolo{n}").
_NAME = re.compile(r"(?<![a-z0-9])yolov?\d+(?![a-z0-9])")
_IDENTIFIER = re.compile(r"yolov?\d+", re.IGNORECASE)
_BUILDER = re.compile(r"yolov?(\(|\[|\\d|\{)", re.IGNORECASE)
_TEMPLATE_HEAD = re.compile(r"yolov?$", re.IGNORECASE)


_IDENTIFIER_FIELDS = {
    ast.Name: "id",
    ast.Attribute: "attr",
    ast.FunctionDef: "name",
    ast.AsyncFunctionDef: "name",
    ast.ClassDef: "name",
    ast.arg: "arg",
    ast.keyword: "arg",
    ast.alias: "asname",
}


def family_names_in(source: str) -> list[str]:
    """Where ``source`` names a model family in its code (docstrings and comments aside): 'line: text'."""
    if not re.search("yolo", source, re.IGNORECASE):
        return []
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Constant:
            if (
                isinstance(node.value, str)
                and id(node) not in docstrings
                and (_NAME.search(node.value) or _BUILDER.search(node.value))
            ):
                found.append(f"{node.lineno}: {node.value}")
        elif kind is ast.JoinedStr:
            parts = node.values
            found += [
                f"{node.lineno}: {p.value}"
                for p, after in zip(parts, [*parts[1:], None])
                if isinstance(p, ast.Constant)
                and isinstance(after, ast.FormattedValue)
                and _TEMPLATE_HEAD.search(str(p.value))
            ]
        elif kind in _IDENTIFIER_FIELDS:
            identifier = getattr(node, _IDENTIFIER_FIELDS[kind])
            if isinstance(identifier, str) and _IDENTIFIER.search(identifier):
                found.append(f"{getattr(node, 'lineno', '?')}: {identifier}")
    return found


def test_the_check_for_family_names_finds_literals_regexes_templates_and_identifiers() -> None:
    code = '''"""Docstrings may say yolov5 and yolo11."""
def pick(cfg):
    """So may this one: YOLO26."""
    if cfg["family"] == "yolov8":  # a comment may, too: yolo26
        return re.compile(r"YOLO(v8|11|26)"), f"yolo{cfg['n']}", DETECT_IOU_YOLOV5
    return "yolov5n.yaml", "YOLOv5's detect.py uses 0.45", "yolo_train"
'''
    assert sorted(family_names_in(code)) == ["4: yolov8", "5: DETECT_IOU_YOLOV5", "5: YOLO(v8|11|26)", "5: yolo"]


def test_no_module_outside_the_families_names_a_family() -> None:
    offenders = {}
    for module, path in project_modules().items():
        if module == "models.families" or module.startswith("models.families."):
            continue
        hits = family_names_in(path.read_text(encoding="utf-8"))
        if hits:
            offenders[module] = hits
    assert offenders == {}
