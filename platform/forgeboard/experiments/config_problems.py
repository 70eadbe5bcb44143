"""A run config's problems where a user sees them: each at its field, its 1-based YAML line (or that of its
nearest parent the text has), and the override line that set it.

The check is the launch's own (`validate_and_resolve`: the engine's schema, the experiment's recipe, the paths and
references resolved in the project, the inventory); the live check (/api/v1/configs/validate) and the launch form
(runs/launching.py) read it from here. Nothing is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from forgeboard.accounts.models import Project
from forgeboard.errors import ValidationFailed
from forgeboard.experiments.services import MAX_OVERRIDES, validate_and_resolve
from workers.engine.config import RunConfig
from workers.engine.yaml_safe import MAX_CONFIG_BYTES, YamlProblem, load_yaml_mapping

MAX_OVERRIDE_LENGTH = 1000


@dataclass(frozen=True)
class ConfigProblem:
    """One problem: `field` is a path in the config ("trainer.steps"), "" for the whole document,
    or "overrides"; `line` is its YAML line; `override` the 1-based override line that set it."""

    field: str
    message: str
    line: int | None = None
    override: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {"field": self.field, "message": self.message, "line": self.line, "override": self.override}

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.field or 'config'}{where}: {self.message}"


def yaml_line_of(text: str, field: str) -> int | None:
    """1-based line of `field` ("a.b.0.c") in the YAML text, or of its nearest parent the text has.

    None when not even the first part is there, or the text cannot be parsed.
    """
    try:
        node: Node | None = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in field.split(".") if field else ():
        child = None
        if isinstance(node, MappingNode):
            for key, value in node.value:
                if getattr(key, "value", None) == part:
                    child, line = value, key.start_mark.line + 1
                    break
        elif isinstance(node, SequenceNode) and part.isdigit() and int(part) < len(node.value):
            child = node.value[int(part)]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def _override_index(overrides: Sequence[str], field: str) -> int | None:
    """The last override line (1-based) that sets this field or one of its parents, or None."""
    found = None
    for index, override in enumerate(overrides, start=1):
        key = override.partition("=")[0].strip()
        if key and (field == key or field.startswith(key + ".")):
            found = index
    return found


@dataclass(frozen=True)
class ConfigCheck:
    """A config checked for a launch: its problems, located; or (none) the validated config and resolved paths."""

    problems: list[ConfigProblem]
    config: RunConfig | None = None
    artifact_paths: dict[str, str] = field(default_factory=dict)


def config_check(*, yaml_text: str, overrides: Sequence[str], recipe: str,
                 project: Project | None = None) -> ConfigCheck:
    """Every problem with this config for an experiment of this recipe in `project` (its paths and artifact
    references resolved there), located; without any, what `validate_and_resolve` made of it."""
    problems = []
    if len(overrides) > MAX_OVERRIDES:
        return ConfigCheck([ConfigProblem("overrides", f"at most {MAX_OVERRIDES} overrides, got {len(overrides)}")])
    for index, override in enumerate(overrides, start=1):
        key, sep, _ = override.partition("=")
        if not sep or not key.strip():
            problems.append(ConfigProblem("overrides", f"{override[:60]!r} must look like section.key=value",
                                          override=index))
        elif len(override) > MAX_OVERRIDE_LENGTH:
            problems.append(ConfigProblem("overrides", f"over {MAX_OVERRIDE_LENGTH} characters", override=index))
    try:
        load_yaml_mapping(yaml_text, max_bytes=MAX_CONFIG_BYTES)
    except YamlProblem as exc:
        return ConfigCheck([ConfigProblem("", exc.message, line=exc.line), *problems])
    if problems:
        return ConfigCheck(problems)
    try:
        config, artifact_paths = validate_and_resolve(yaml_text=yaml_text, overrides=overrides, recipe=recipe,
                                                      project=project)
    except ValidationFailed as exc:
        return ConfigCheck(located_problems(exc, yaml_text=yaml_text, overrides=overrides))
    return ConfigCheck([], config=config, artifact_paths=artifact_paths)


def located_problems(exc: ValidationFailed, *, yaml_text: str, overrides: Sequence[str]) -> list[ConfigProblem]:
    """A refused config's problems at their YAML lines and override lines."""
    problems = []
    for problem in exc.problems:
        path = problem.field.removeprefix("config").removeprefix(".")
        problems.append(ConfigProblem(path, problem.message, line=yaml_line_of(yaml_text, path),
                                      override=_override_index(overrides, path)))
    return problems


def config_problems(*, yaml_text: str, overrides: Sequence[str], recipe: str,
                    project: Project | None = None) -> list[ConfigProblem]:
    """`config_check`'s problems: [] when the config can be launched."""
    return config_check(yaml_text=yaml_text, overrides=overrides, recipe=recipe, project=project).problems
