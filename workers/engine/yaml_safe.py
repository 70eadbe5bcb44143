"""YAML loading with limits: size, nesting depth, no aliases, no duplicate keys, and only what JSON can hold.

Configs come from browsers and API clients, so a malicious document (an alias
"billion laughs" bomb, a deeply nested list, a huge file) must be refused with
a clear message before it costs memory or time; and what it parses to is stored
as JSON, so a value YAML cannot build, a key that is a list, .nan or a tag that
builds bytes or a set is refused with its line, never raised as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import yaml
from yaml.nodes import MappingNode, Node

MAX_CONFIG_BYTES = 64 * 1024
MAX_DEPTH = 16
UNREADABLE_VALUE = (ValueError, TypeError, OverflowError)  # what building a tagged or implicitly typed value raises


@dataclass(frozen=True)
class YamlProblem(Exception):
    message: str
    line: int | None = None

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and duplicate keys, and bounds nesting depth."""

    def compose_node(self, parent: Node | None, index: object) -> Node:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YamlProblem("YAML aliases (*name) are not allowed", event.start_mark.line + 1)
        if self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent):
            self._depth = getattr(self, "_depth", 0) + 1
            if self._depth > MAX_DEPTH:
                event = self.peek_event()
                raise YamlProblem(f"nesting deeper than {MAX_DEPTH} levels", event.start_mark.line + 1)
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)

    def construct_object(self, node: Node, deep: bool = False) -> object:  # type: ignore[override]
        try:
            return super().construct_object(node, deep=deep)
        except UNREADABLE_VALUE as exc:  # a date with month 13, `!!int abc`, an integer of 5000 digits
            raise YamlProblem(f"malformed YAML: {exc}", node.start_mark.line + 1) from None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict, set)):
                raise YamlProblem("a key must be a plain value, not a list or a mapping", key_node.start_mark.line + 1)
            if key in seen:
                raise YamlProblem(f"duplicate key {key!r}", key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _refuse_tag(loader: _LimitedLoader, node: Node) -> None:
    raise YamlProblem(f"the YAML tag !!{node.tag.rsplit(':', 1)[-1]} is not allowed: a config holds text, numbers, "
                      "true/false, null, lists and mappings", node.start_mark.line + 1)


def _finite_float(loader: _LimitedLoader, node: Node) -> float:
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    if not math.isfinite(value):
        raise YamlProblem(f"{node.value} is not a finite number", node.start_mark.line + 1)
    return value


# Only what JSON can hold: a date stays the text it was written as (JSON has no dates), .nan and .inf are refused, and
# so are the tags that build bytes, sets or ordered pairs.
_LimitedLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)
_LimitedLoader.add_constructor("tag:yaml.org,2002:float", _finite_float)
for _tag in ("binary", "set", "omap", "pairs"):
    _LimitedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)


def load_yaml_mapping(text: str, *, max_bytes: int = MAX_CONFIG_BYTES) -> dict:
    """Parse one YAML document that must be a mapping; raise YamlProblem with a reason."""
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise YamlProblem(f"config is {size} bytes, over the limit of {max_bytes} bytes")
    if not text.strip():
        raise YamlProblem("config is empty")
    try:
        loader = _LimitedLoader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except YamlProblem:
        raise
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise YamlProblem(f"malformed YAML: {exc.problem or exc.context}", line) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"malformed YAML: {exc}") from None
    except UNREADABLE_VALUE as exc:  # raised where the loader fills in a mapping or a list after building it
        raise YamlProblem(f"malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise YamlProblem(f"config must be a mapping of sections, got {type(data).__name__}")
    return data
