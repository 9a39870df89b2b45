"""Reading users' YAML files in bounded time and memory: PyYAML's safe loader, without aliases and without deep nesting.

A 400-byte file of nested aliases expands to billions of nodes, and a few thousand nested brackets exhaust the
recursion (or, in PyYAML's scanner, take minutes): no data, hyp, model or metadata YAML has a use for either, so
both are refused while the file is read, before the rest of it is scanned.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 50  # nesting of lists and mappings: a real file has a handful


class RefusedYaml(yaml.YAMLError):
    """A YAML construct refused while reading (an alias, nesting deeper than MAX_DEPTH)."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases and nesting deeper than MAX_DEPTH, so that reading is bounded by the
    file's size. ``what`` names the kind of file in the refusal."""

    what = "this file"
    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise RefusedYaml(f"aliases (*{self.peek_event().anchor}) are not accepted in {self.what}")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise RefusedYaml(f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def load_yaml(text: str, what: str = "this file") -> Any:
    """``text`` as YAML read it, bounded; raises ``yaml.YAMLError`` (RefusedYaml among them) or ValueError (a
    5000-digit integer) for a file that cannot be read so."""
    loader = BoundedLoader(text)
    loader.what = what
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
