"""The shape of the code (the developer guide): no library function (models/, utils/) over 80 lines, and no function
anywhere over 10 parameters (``self`` and ``cls`` not counted, keyword-only ones counted): a longer list is said
better by a small typed object (a dataclass of options, as ``utils/data/loader.py: LoaderOptions``)."""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("models", "utils")
MAX_LINES = 80
MAX_PARAMETERS = 10

Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(source: str) -> list[Function]:
    """Every function of a module's source, methods and nested functions included."""
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def n_lines(function: Function) -> int:
    """From the ``def`` line to the last line of the body, docstring included (decorators not)."""
    return function.end_lineno - function.lineno + 1


def parameters(function: Function) -> list[str]:
    """Named parameters: positional-only, ordinary and keyword-only, less a leading ``self`` or ``cls``."""
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def python_files() -> list[Path]:
    """The project's Python files (library, scripts, benches, tests); not those under fixtures or generated runs."""
    skipped = {".git", "__pycache__", "fixtures", "runs", "datasets"}
    return sorted(p for p in ROOT.rglob("*.py") if not skipped & set(p.relative_to(ROOT).parts))


@functools.cache
def shapes(path: Path) -> list[tuple[str, int, int, int]]:
    """(name, line, lines, parameters) of each function of a file, parsed once for both checks."""
    return [(f.name, f.lineno, n_lines(f), len(parameters(f))) for f in functions(path.read_text(encoding="utf-8"))]


def problems(paths: list[Path], check: str) -> list[str]:
    """``path:line name: n`` for each function over the limit of ``check`` ("lines" or "parameters")."""
    found = []
    for path in paths:
        for name, line, lines, params in shapes(path):
            n = lines if check == "lines" else params
            if n > (MAX_LINES if check == "lines" else MAX_PARAMETERS):
                found.append(f"{path.relative_to(ROOT)}:{line} {name}: {n} {check}")
    return found


def test_no_library_function_is_over_80_lines() -> None:
    library = [p for p in python_files() if p.relative_to(ROOT).parts[0] in LIBRARY]
    assert len(library) > 50  # the walk found the library
    assert problems(library, "lines") == []


def test_no_function_has_over_10_parameters() -> None:
    assert problems(python_files(), "parameters") == []


def test_the_counts_of_lines_and_parameters() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    source = (
        f"def at_the_limit():\n{body}\n\ndef over():\n{body}    return 0\n\n\n"
        "class C:\n    def wide(self, a, b, c, d, e, f, g, h, i, j, *, k):\n        pass\n\n"
        "    def fits(self, a, /, b, c, d, e, f, g, h, i, *args, j, **options):\n        pass\n"
    )
    found = {f.name: f for f in functions(source)}
    assert n_lines(found["at_the_limit"]) == MAX_LINES and n_lines(found["over"]) == MAX_LINES + 1
    assert len(parameters(found["wide"])) == MAX_PARAMETERS + 1 and len(parameters(found["fits"])) == MAX_PARAMETERS


def test_train_py_is_the_command_line_on_one_screen() -> None:
    """train.py holds the options, the presets and one call into the engine: at most 160 logical lines (statements,
    not the formatter's wrapping of one call over several lines; 153 when the limit was set)."""
    source = (ROOT / "train.py").read_text(encoding="utf-8")
    n = sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NEWLINE)
    assert n <= 160, f"train.py has {n} logical lines; the engine's work belongs in utils/engine/"
