"""Write the option tables of the docs from the scripts' own parsers.

A page asks for a script's table with a pair of markers; everything between them is generated:

    <!-- options: train.py -->
    ...
    <!-- end options -->

    python docs/make_option_tables.py           # rewrite the tables in docs/*.md and README.md
    python docs/make_option_tables.py --check   # exit 1 and name the pages whose tables differ from the parsers

tests/test_docs.py runs the check, so a default changed in a parser and not in the docs fails the suite.
The parser comes from the script's ``build_parser()``; importing a script has no side effects.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(<!-- options: (?P<script>[\w./-]+\.py) -->\n)(?P<body>.*?)(<!-- end options -->)", re.S)
DEFAULT_GROUP_TITLES = {"options", "optional arguments", "positional arguments"}


def load_parser(script: str) -> argparse.ArgumentParser:
    """``build_parser()`` of a script of the repository (``train.py``, ``bench/x.py``), imported as a module."""
    path = ROOT / script
    if not path.is_file():
        raise FileNotFoundError(f"{script}: no such script in {ROOT}")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(".".join(Path(script).with_suffix("").parts))
    build = getattr(module, "build_parser", None)
    if build is None:
        raise AttributeError(f"{script} has no build_parser()")
    return build()


def _text(value: object) -> str:
    """A value as the docs show it: paths inside the repository relative to it, so pages are the same anywhere."""
    text = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text.replace(f"{ROOT}/", "").replace(str(ROOT), ".")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    default = action.default
    if default is None or default is False:
        shown = "none" if default is None else "off"
    else:
        shown = f"`{_text(default)}`" if _text(default) != "" else "`''`"
    if action.nargs == "?" and action.const is not None:
        const = "on" if action.const is True else f"`{_text(action.const)}`"
        shown += f"; alone: {const}"
    return shown


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    try:
        text = text % params
    except (KeyError, TypeError, ValueError):
        text = text.replace("%%", "%")
    if action.choices is not None and not all(str(c) in text for c in action.choices):
        text = f"{text} (one of: {', '.join(map(str, action.choices))})".lstrip()
    return _text(text)


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}` (positional)"
    return ", ".join(f"`{s}`" for s in action.option_strings)


def option_table(script: str) -> str:
    """A markdown table of the script's options (one per argument group the parser declares)."""
    parser = load_parser(script)
    out: list[str] = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        if not actions:
            continue
        if group.title and group.title not in DEFAULT_GROUP_TITLES:
            out += [f"**{group.title}**", ""]
        out += ["| option | default | meaning |", "| --- | --- | --- |"]
        out += [f"| {_names(a)} | {_cell(_default(a))} | {_cell(_help(a, Path(script).name))} |" for a in actions]
        out.append("")
    return "\n".join(out)


def render(text: str) -> str:
    """The page with every marked table generated again."""
    return MARKER.sub(lambda m: f"{m.group(1)}{option_table(m.group('script'))}{m.group(4)}", text)


def pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def stale_pages() -> dict[Path, str]:
    """Pages whose committed tables differ from what the parsers give, with the text they should have."""
    out = {}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            out[page] = new
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the option tables of the docs from the parsers")
    parser.add_argument("--check", action="store_true", help="only report pages that are out of date")
    opt = parser.parse_args(argv)
    stale = stale_pages()
    for page, text in stale.items():
        if opt.check:
            print(
                f"{page.relative_to(ROOT)}: option tables differ from the parsers; run python docs/make_option_tables.py"
            )
        else:
            page.write_text(text, encoding="utf-8")
            print(f"{page.relative_to(ROOT)}: option tables written")
    return 1 if opt.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
