"""The documentation agrees with the code.

- every option of a documented ``python X.py ...`` command (also after ``python -m torch.distributed.run`` or
  ``torchrun``, across ``\\`` continuations, in code blocks and inline code) is an option of X.py's parser,
  and every launcher option is one of torch.distributed.run's;
- every relative link resolves (files and ``#anchors``);
- every YAML block parses, and every data YAML among them has the form the data loader accepts;
- the option tables equal what the parsers give (docs/make_option_tables.py);
- no page tells its own history or points to the issue tracker;
- the README starts with the commands .ci/run runs and links every page of docs/.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("train.py", "val.py", "detect.py", "export.py", "shards.py", "check_data.py")
PYTHONS = {"python", "python3"}
LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_option_tables", ROOT / "docs" / "make_option_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---- reading markdown ------------------------------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first line inside the fence
    text: str


def code_blocks(text: str) -> list[Block]:
    blocks, current, start, lang, fence = [], None, 0, "", ""
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if current is None and m:
            current, start, lang, fence = [], i + 1, m.group(3).lower(), m.group(2)
        elif current is not None and line.strip().startswith(fence):
            blocks.append(Block(lang, start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks."""
    out, inside, fence = [], False, ""
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not inside and m:
            inside, fence = True, m.group(2)
        elif inside and line.strip().startswith(fence):
            inside = False
        elif not inside:
            out.append((i, line))
    return out


def command_lines(text: str) -> list[tuple[int, str]]:
    """Shell lines shown in the page: code-block lines joined across ``\\`` continuations, and inline code
    spans of prose that start with a command."""
    out = []
    for block in code_blocks(text):
        if block.lang in ("yaml", "yml", "json", "python", "py", "csv", "text", "txt"):
            continue
        pending, first = "", 0
        for k, line in enumerate(block.text.splitlines()):
            stripped = line.strip()
            if not pending:
                first = block.line + k
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            out.append((first, pending + stripped))
            pending = ""
        if pending:
            out.append((first, pending))
    for number, line in prose_lines(text):
        for span in re.findall(r"`([^`]+)`", line):
            if re.match(r"\s*(\S+=\S+\s+)*(python3?|torchrun)\s", span):
                out.append((number, span))
    return out


@dataclass
class Invocation:
    script: str  # path relative to the repository root, e.g. "train.py", "bench/x.py", "utils/convert_yolov5.py"
    options: list[str]  # the script's option names as written ("--batch-size")
    launcher_options: list[str]  # torch.distributed.run's options given before the script
    args: list[str] = field(default_factory=list)  # the tokens after the script, as written

    def value_of(self, option: str) -> str | None:
        """The token after ``option`` (or after ``option=``), None when the option is not given."""
        for k, token in enumerate(self.args):
            if token == option and k + 1 < len(self.args):
                return self.args[k + 1]
            if token.startswith(option + "="):
                return token.split("=", 1)[1]
        return None


def _options(tokens: list[str]) -> list[str]:
    names = []
    for token in tokens:
        token = token.strip("[]")
        if re.match(r"^--?[A-Za-z]", token):
            names.append(token.split("=", 1)[0])
    return names


def invocations(line: str) -> list[Invocation]:
    """The project scripts a shell line runs, with the options it gives them."""
    line = re.sub(r"^\s*\$\s+", "", line)
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        tokens = line.split(" #")[0].split()
    commands, current = [], []
    for token in tokens:
        if token in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(token.rstrip(";"))
    commands.append(current)
    found = []
    for tokens in commands:
        found += _invocation(tokens)
    return found


def _invocation(tokens: list[str]) -> list[Invocation]:
    for i, token in enumerate(tokens):
        name = Path(token).name
        if name in PYTHONS:
            rest = tokens[i + 1 :]
            launcher: list[str] = []
            if len(rest) >= 2 and rest[0] == "-m":
                if rest[1] in LAUNCHER_MODULES:
                    rest = rest[2:]
                    script_at = next((k for k, t in enumerate(rest) if t.endswith(".py")), None)
                    if script_at is None:
                        return []
                    launcher, rest = rest[:script_at], rest[script_at:]
                else:
                    module_file = Path(*rest[1].split(".")).with_suffix(".py")
                    if not (ROOT / module_file).is_file():
                        return []  # python -m pytest, pip, ...: not a script of this project
                    return [Invocation(module_file.as_posix(), _options(rest[2:]), [], rest[2:])]
            if not rest or not rest[0].endswith(".py"):
                return []
            return [Invocation(rest[0].removeprefix("./"), _options(rest[1:]), _options(launcher), rest[1:])]
        if name == "torchrun":
            rest = tokens[i + 1 :]
            script_at = next((k for k, t in enumerate(rest) if t.endswith(".py")), None)
            if script_at is None:
                return []
            return [
                Invocation(
                    rest[script_at].removeprefix("./"),
                    _options(rest[script_at + 1 :]),
                    _options(rest[:script_at]),
                    rest[script_at + 1 :],
                )
            ]
    return []


# ---- what the scripts accept -----------------------------------------------------------------------------

_OPTION_CACHE: dict[str, set[str]] = {}


def script_options(script: str) -> set[str]:
    """Option strings a script accepts: its build_parser()'s; scripts without one (bench/, utils/ tools) by
    reading their ``add_argument`` calls."""
    if script not in _OPTION_CACHE:
        source = (ROOT / script).read_text(encoding="utf-8")
        if "def build_parser(" in source:
            _OPTION_CACHE[script] = set(GENERATOR.load_parser(script)._option_string_actions)
        else:
            _OPTION_CACHE[script] = declared_options(source)
    return _OPTION_CACHE[script]


def declared_options(source: str) -> set[str]:
    names = {"-h", "--help"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return names


def launcher_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return set(get_args_parser()._option_string_actions)


def model_config_problem(name: str) -> str | None:
    """Why the model loader cannot build ``--cfg name`` (a YAML of models/ by name), None when it can."""
    from models.yolo import load_model_config
    from utils.errors import UserError

    try:
        load_model_config(name)
    except UserError as e:
        return str(e)
    return None


def check_commands(text: str, options_of=script_options) -> list[str]:
    """Problems with the commands of one page: a script that does not exist, an option it does not take."""
    problems = []
    launcher = None
    for number, line in command_lines(text):
        for inv in invocations(line):
            if not (ROOT / inv.script).is_file():
                problems.append(f"line {number}: {inv.script} does not exist ({line.strip()})")
                continue
            accepted = options_of(inv.script)
            problems += [
                f"line {number}: {inv.script} has no option {o} ({line.strip()})"
                for o in inv.options
                if o not in accepted
            ]
            model = inv.value_of("--cfg")
            if model and "/" not in model and (why := model_config_problem(model)):
                problems.append(f"line {number}: --cfg {model}: {why} ({line.strip()})")
            if inv.launcher_options:
                launcher = launcher if launcher is not None else launcher_options()
                problems += [
                    f"line {number}: torch.distributed.run has no option {o} ({line.strip()})"
                    for o in inv.launcher_options
                    if o not in launcher
                ]
    return problems


def test_documented_commands_use_existing_options():
    problems, seen = [], 0
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        seen += sum(len(invocations(line)) for _, line in command_lines(text))
        problems += [f"{page.relative_to(ROOT)}: {p}" for p in check_commands(text)]
    assert seen > 20, f"only {seen} documented commands found: is the extraction broken?"
    assert not problems, "\n".join(problems)


def all_project_options() -> set[str]:
    """Every option some script of the project (or the launcher) accepts."""
    scripts = [
        *ENTRY_POINTS,
        *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "bench").glob("*.py"))),
        *(
            p.relative_to(ROOT).as_posix()
            for p in sorted((ROOT / "utils").rglob("*.py"))
            if "add_argument(" in p.read_text(encoding="utf-8")
        ),
    ]
    names = launcher_options()
    for script in scripts:
        names |= script_options(script)
    return names


def prose_option_problems(text: str, known: set[str]) -> list[str]:
    """Options named in inline code of prose (``--cache disk``) that no script of the project accepts."""
    problems = []
    for number, line in prose_lines(text):
        for span in re.findall(r"`([^`]+)`", line):
            for name in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span):
                if name not in known:
                    problems.append(f"line {number}: {name} is no option of any script ({span})")
    return problems


def test_options_named_in_prose_exist():
    known = all_project_options()
    problems = []
    for page in doc_pages():
        problems += [f"{page.relative_to(ROOT)}: {p}" for p in prose_option_problems(page.read_text("utf-8"), known)]
    assert not problems, "\n".join(problems)


def test_entry_points_build_their_parser_without_running():
    for script in ENTRY_POINTS:
        parser = GENERATOR.load_parser(script)
        assert isinstance(parser, argparse.ArgumentParser)
        assert "--help" in parser._option_string_actions


SYNTHETIC_PAGE = """\
# Page

```bash
python train.py --data d.yaml --batch-size 16   # a comment with --not-an-option
python -m torch.distributed.run --nnodes 2 --node_rank 0 --nproc_per_node 4 \\
    --master_addr 10.0.0.1 --master_port 29500 train.py --device 0,1,2,3 \\
    --batch-size 128
torchrun --standalone --nproc-per-node 2 train.py --imgsz=320 --batch-size 8
cd x && python val.py --data d.yaml --weights w.pt
python -m pytest -q
```

Prose with `python train.py --resume --batch-size 4` inline and `--batch-size` alone.
"""


def test_checker_reads_continuations_launchers_and_inline_code():
    lines = command_lines(SYNTHETIC_PAGE)
    found = [inv for _, line in lines for inv in invocations(line)]
    assert [inv.script for inv in found] == ["train.py", "train.py", "train.py", "val.py", "train.py"]
    assert found[0].options == ["--data", "--batch-size"]  # the comment is not read
    assert found[1].options == ["--device", "--batch-size"]  # the continued line
    assert found[1].launcher_options == [
        "--nnodes",
        "--node_rank",
        "--nproc_per_node",
        "--master_addr",
        "--master_port",
    ]
    assert found[2].options == ["--imgsz", "--batch-size"] and found[2].launcher_options[0] == "--standalone"
    assert found[4].options == ["--resume", "--batch-size"]
    assert check_commands(SYNTHETIC_PAGE) == []


def test_checker_fails_when_a_documented_flag_is_renamed():
    """Rename train.py's --batch-size in its parser: every page line that uses it is reported."""
    real = GENERATOR.load_parser("train.py")

    def renamed(script: str) -> set[str]:
        accepted = script_options(script)
        if script == "train.py":
            accepted = (accepted - {"--batch-size"}) | {"--batch"}
        return accepted

    assert "--batch-size" in real._option_string_actions
    problems = check_commands(SYNTHETIC_PAGE, options_of=renamed)
    assert len(problems) == 4 and all("train.py has no option --batch-size" in p for p in problems), problems
    bad_launcher = SYNTHETIC_PAGE.replace("--nproc_per_node 4", "--procs-per-node 4")
    assert any("torch.distributed.run has no option --procs-per-node" in p for p in check_commands(bad_launcher))
    no_model = SYNTHETIC_PAGE.replace("--batch-size 16", "--cfg yolov5q.yaml --batch-size 16")
    assert any("--cfg yolov5q.yaml: " in p and "not found" in p for p in check_commands(no_model))
    missing = SYNTHETIC_PAGE.replace("python val.py", "python valid.py")
    assert any("valid.py does not exist" in p for p in check_commands(missing))
    known = all_project_options()
    assert prose_option_problems(SYNTHETIC_PAGE, known) == []
    assert len(prose_option_problems(SYNTHETIC_PAGE, known - {"--batch-size"})) == 2  # inline command and alone
    # The real pages use train.py's --batch-size, so renaming it fails the real check too.
    pages_problems = [
        p for page in doc_pages() for p in check_commands(page.read_text(encoding="utf-8"), options_of=renamed)
    ]
    assert any("--batch-size" in p for p in pages_problems)


# ---- links -----------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a page."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_|\[([^\]]*)\]\([^)]*\)", lambda x: x.group(1) or "", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def check_links(page: Path, text: str, root: Path = ROOT) -> list[str]:
    problems = []
    for number, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            if not path_part:
                if anchor not in heading_anchors(text):
                    problems.append(f"line {number}: {target}: no heading with anchor #{anchor}")
                continue
            dest = (page.parent / path_part).resolve()
            if not dest.exists():
                problems.append(f"line {number}: {target} does not exist")
                continue
            if root.resolve() not in dest.parents and dest != root.resolve():
                problems.append(f"line {number}: {target} points outside the repository")
            if anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"line {number}: {target}: no heading with anchor #{anchor}")
    return problems


def test_relative_links_resolve():
    problems = []
    for page in doc_pages():
        problems += [f"{page.relative_to(ROOT)}: {p}" for p in check_links(page, page.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_link_checker_finds_missing_files_and_anchors(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    page = root / "page.md"
    (root / "other.md").write_text("# Other page\n\n## The `--cache` option\n")
    text = (
        "# Title\n\n[ok](other.md) [ok](other.md#the---cache-option) [ok](#title) [web](https://x.y/z)\n"
        "[gone](missing.md) [bad anchor](other.md#nothing) `[not a link](nowhere.md)` [up](../x.md)\n"
        "[here](#nowhere)\n"
    )
    (tmp_path / "x.md").touch()
    problems = check_links(page, text, root=root)
    assert len(problems) == 4, problems
    assert "missing.md does not exist" in problems[0] and "other.md#nothing: no heading" in problems[1]
    assert "../x.md points outside" in problems[2] and "#nowhere: no heading" in problems[3]


# ---- data YAML blocks ------------------------------------------------------------------------------------

DATA_KEYS = {"path", "train", "val", "test", "names", "nc", "download", "builtin", "annotations"}


def _split_problem(key: str, value: object) -> str | None:
    """What is wrong with one split entry, None when its form is one the loader takes."""
    if isinstance(value, float) and not isinstance(value, bool):
        return None if key == "val" and 0 < value < 1 else f"'{key}' {value}: only 'val' may be a fraction in (0, 1)"
    if isinstance(value, dict):
        if "annotations" in value:
            ok = set(value) <= {"annotations", "images"} and all(isinstance(v, str) and v for v in value.values())
            return None if ok else f"'{key}': a COCO split is {{annotations: <json>, images: <folder>}}"
        if "voc" in value:
            folders = value["voc"] if isinstance(value["voc"], list) else [value["voc"]]
            ok = (
                set(value) == {"voc", "set"}
                and isinstance(value["set"], str)
                and all(isinstance(f, str) for f in folders)
            )
            return None if ok else f"'{key}': a VOC split is {{voc: <folder or list>, set: <image set>}}"
        return f"'{key}': a mapping must be {{annotations, images}} (COCO JSON) or {{voc, set}} (Pascal VOC)"
    entries = value if isinstance(value, list) else [value]
    if not all(isinstance(e, str) and e for e in entries):
        return f"'{key}' must be a path, a pattern or URL, or a list of those"
    return None


def _brings_names(split: object) -> bool:
    """COCO JSON and VOC splits bring their own class names."""
    return isinstance(split, dict) or (isinstance(split, str) and split.lower().endswith(".json"))


def data_yaml_problems(cfg: object) -> list[str]:
    """Form errors of a data YAML as the loader (utils/data/config.py) reads it; paths need not exist."""
    if not isinstance(cfg, dict):
        return ["not a mapping"]
    problems = [f"unknown key '{k}'" for k in cfg if k not in DATA_KEYS]
    for key in ("train", "val"):
        if cfg.get(key) in (None, "", [], {}):
            problems.append(f"missing key '{key}'")
    names = cfg.get("names")
    if names in (None, "", [], {}) and not _brings_names(cfg.get("train")):
        problems.append("missing key 'names' (only COCO JSON and VOC splits bring their own)")
    if isinstance(names, dict):
        if not all(isinstance(k, int) for k in names) or sorted(names) != list(range(len(names))):
            problems.append(f"'names' keys must be the class indices 0..{len(names) - 1}")
    elif names not in (None, "") and not isinstance(names, list):
        problems.append("'names' must be a list or an {index: name} mapping")
    if cfg.get("nc") is not None and isinstance(names, (list, dict)) and names and cfg["nc"] != len(names):
        problems.append(f"'nc' is {cfg['nc']} but 'names' has {len(names)} classes")
    for key in ("train", "val", "test"):
        if cfg.get(key) not in (None, "", []):
            problem = _split_problem(key, cfg[key])
            if problem:
                problems.append(problem)
    if cfg.get("path") is not None and not isinstance(cfg["path"], str):
        problems.append("'path' must be a string")
    return problems


def is_data_yaml(cfg: object) -> bool:
    return isinstance(cfg, dict) and bool({"train", "val", "names"} & set(cfg))


def test_yaml_blocks_parse_and_data_yamls_have_the_loaders_form():
    problems, data_yamls = [], 0
    for page in doc_pages():
        for block in code_blocks(page.read_text(encoding="utf-8")):
            if block.lang not in ("yaml", "yml"):
                continue
            where = f"{page.relative_to(ROOT)}: line {block.line}"
            try:
                cfg = yaml.safe_load(block.text)
            except yaml.YAMLError as e:
                problems.append(f"{where}: does not parse ({str(e).splitlines()[0]})")
                continue
            if is_data_yaml(cfg):
                data_yamls += 1
                problems += [f"{where}: {p}" for p in data_yaml_problems(cfg)]
    assert data_yamls >= 2, "the data YAML examples are gone"
    assert not problems, "\n".join(problems)


def test_data_yaml_form_check_matches_the_loader(tmp_path):
    """The form check above accepts what load_data_config accepts and rejects what it rejects, on YAMLs whose
    paths exist."""
    from utils.data.config import load_data_config
    from utils.errors import UserError

    (tmp_path / "images").mkdir()
    (tmp_path / "VOC2007").mkdir()
    (tmp_path / "a.json").write_text('{"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}]}')
    base = "path: .\ntrain: images\n"
    cases = {
        base + "val: images\nnames: [a, b]\n": True,
        base + "val: images\nnames: {0: a, 1: b}\nnc: 2\n": True,
        base + "val: 0.1\nnames: [a]\n": True,
        "path: .\ntrain: {annotations: a.json, images: images}\nval: a.json\n": True,
        base + "val: {voc: VOC2007, set: val}\nnames: [a]\n": True,
        base + "names: [a]\n": False,
        base + "val: images\n": False,
        base + "val: images\nnames: {0: a, 2: b}\n": False,
        base + "val: images\nnames: [a, b]\nnc: 3\n": False,
        base + "val: 1.5\nnames: [a]\n": False,
        base + "val: images\ntest: 0.1\nnames: [a]\n": False,
        base + "val: {voc: VOC2007}\nnames: [a]\n": False,
        base + "val: {annotations: a.json, labels: x}\nnames: [a]\n": False,
    }
    for k, (text, ok) in enumerate(cases.items()):
        file = tmp_path / f"d{k}.yaml"
        file.write_text(text)
        try:
            load_data_config(file)
            loader_ok = True
        except UserError:
            loader_ok = False
        assert loader_ok == ok, f"the loader {'rejects' if ok else 'accepts'}:\n{text}"
        assert (not data_yaml_problems(yaml.safe_load(text))) == ok, f"the form check disagrees on:\n{text}"


# ---- generated option tables -----------------------------------------------------------------------------


def test_option_tables_equal_what_the_parsers_give():
    pages_with_tables = [p for p in doc_pages() if GENERATOR.MARKER.search(p.read_text(encoding="utf-8"))]
    scripts = {
        m.group("script") for p in pages_with_tables for m in GENERATOR.MARKER.finditer(p.read_text(encoding="utf-8"))
    }
    assert set(ENTRY_POINTS) <= scripts, f"no option table for {sorted(set(ENTRY_POINTS) - scripts)}"
    stale = [str(page.relative_to(ROOT)) for page in GENERATOR.stale_pages()]
    assert not stale, (
        f"{', '.join(stale)}: option tables differ from the parsers; run python docs/make_option_tables.py"
    )


def test_option_table_follows_a_changed_default(monkeypatch):
    parser = GENERATOR.load_parser("train.py")
    monkeypatch.setattr(GENERATOR, "load_parser", lambda script: _with_default(parser, "epochs", 1234))
    table = GENERATOR.option_table("train.py")
    assert "| `--epochs` | `1234` |" in table
    page = "<!-- options: train.py -->\nthe table before\n<!-- end options -->\n"
    assert "`1234`" in GENERATOR.render(page) and "the table before" not in GENERATOR.render(page)


def _with_default(parser: argparse.ArgumentParser, dest: str, value: object) -> argparse.ArgumentParser:
    parser.set_defaults(**{dest: value})
    for action in parser._actions:
        if action.dest == dest:
            action.default = value
    return parser


# ---- no history, no tracker ------------------------------------------------------------------------------

HISTORY = [
    r"\btoday'?s?\b",
    r"\byesterday\b",
    r"\bearlier\b",
    r"\bpreviously\b",
    r"\bno longer\b",
    r"\bnot met\b",
    r"\bthis (round|session|change|PR|pull request)\b",
    r"\b(a|the|this|that) session (later|before)\b",
    r"\b(was|were|has been|have been) (changed|fixed|added|removed|renamed|introduced|replaced|rewritten)\b",
    r"\bbefore (this|the|these|those) (change|changes|fix|fixes)\b",
    r"\bwe (now|changed|fixed|added|removed)\b",
    r"\bnow (works|supports|handles|runs)\b",
    r"\bnew in\b",
    r"\bthe goal\b",
    r"\bissues? #?\d+\b",
    r"(?<![\w(])#\d+\b",
    r"\bissue tracker\b",
    r"\bbug tracker\b",
    r"github\.com/[^)\s]*/(issues|pull)\b",
]
HISTORY_RE = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.I)


def history_phrases(text: str) -> list[str]:
    return [
        f"line {n}: '{m.group(0)}' in: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        for m in HISTORY_RE.finditer(line)
    ]


def test_pages_tell_no_history_and_do_not_point_to_the_tracker():
    problems = []
    for page in doc_pages():
        problems += [f"{page.relative_to(ROOT)}: {p}" for p in history_phrases(page.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_history_check_fires_on_stories_only():
    stories = [
        "Earlier, the run took 5 s.",
        "Today's code is faster.",
        "This was fixed in issue 12.",
        "See #31 for the story.",
        "The loss was changed to CIoU.",
        "Not met: 2x in fp32.",
        "Reported at https://github.com/o/r/issues/3.",
    ]
    plain = [
        "The checkpoint was written by YOLOv5.",
        "The seed is used to draw the samples.",
        "A run that was interrupted resumes.",
        "Measured on 2026-11-23 on 2 cores.",
        "See [the table](#options) and `--max-det 300`.",
        "The epoch is the earliest one kept.",
    ]
    assert all(history_phrases(s) for s in stories), [s for s in stories if not history_phrases(s)]
    assert not any(history_phrases(s) for s in plain), [history_phrases(s) for s in plain]


# ---- the README ------------------------------------------------------------------------------------------


def test_readme_starts_with_the_commands_ci_runs_and_links_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = code_blocks(readme)[0].text
    ci = [
        line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip().startswith("python ")
    ]
    assert ci, ".ci/run runs no python command"
    for command in ci:
        assert any(
            line.split("#")[0].strip().startswith(command) or f"&& {command}" in line
            for line in first_block.splitlines()
        ), f"README's first block lacks: {command}"
    linked = {
        (ROOT / m.group(1).partition("#")[0]).resolve()
        for m in LINK.finditer(readme)
        if m.group(1) and not re.match(r"^[a-z]+:", m.group(1))
    }
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link: {', '.join(unlinked)}"
