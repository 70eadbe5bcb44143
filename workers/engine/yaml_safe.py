"""YAML loading with limits: size, nesting depth, no aliases, no duplicate keys.

Configs come from browsers and API clients, so a malicious document (an alias
"billion laughs" bomb, a deeply nested list, a huge file) must be refused with
a clear message before it costs memory or time.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from yaml.nodes import MappingNode, Node

MAX_CONFIG_BYTES = 64 * 1024
MAX_DEPTH = 16


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

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise YamlProblem(f"duplicate key {key!r}", key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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
    if not isinstance(data, dict):
        raise YamlProblem(f"config must be a mapping of sections, got {type(data).__name__}")
    return data
