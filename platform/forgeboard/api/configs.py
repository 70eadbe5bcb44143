"""/api/v1/configs/validate: a run config checked as the user types, each problem at its field and YAML line.

The check is the launch's own (`validate_run_config`, the engine's schema plus the experiment's recipe);
this module only adds where each problem is: the 1-based line of the field in the YAML text (or of
its nearest parent that the text has), and which override line set it. Nothing is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import yaml
from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field
from yaml.nodes import MappingNode, Node, SequenceNode

from forgeboard.accounts.models import Project
from forgeboard.accounts.selectors import project_get
from forgeboard.api.auth import USER_AUTH, actor_of
from forgeboard.api.schemas import BODY_ERRORS, RecipeName, text
from forgeboard.errors import ValidationFailed
from forgeboard.experiments.services import MAX_OVERRIDES, validate_run_config
from workers.engine.yaml_safe import MAX_CONFIG_BYTES, YamlProblem, load_yaml_mapping

router = Router(auth=USER_AUTH, tags=["configs"])
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


def config_problems(*, yaml_text: str, overrides: Sequence[str], recipe: str,
                    project: Project | None = None) -> list[ConfigProblem]:
    """Every problem with this config for an experiment of this recipe in `project` (its paths and artifact
    references resolved there), located; [] when it can be launched."""
    problems = []
    if len(overrides) > MAX_OVERRIDES:
        return [ConfigProblem("overrides", f"at most {MAX_OVERRIDES} overrides, got {len(overrides)}")]
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
        return [ConfigProblem("", exc.message, line=exc.line), *problems]
    if problems:
        return problems
    try:
        validate_run_config(yaml_text=yaml_text, overrides=overrides, recipe=recipe, project=project)
    except ValidationFailed as exc:
        for problem in exc.problems:
            field = problem.field.removeprefix("config").removeprefix(".")
            problems.append(ConfigProblem(field, problem.message, line=yaml_line_of(yaml_text, field),
                                          override=_override_index(overrides, field)))
    return problems


class ConfigCheckIn(Schema):
    recipe: RecipeName
    project: text(min_length=1, max_length=63) | None = Field(
        default=None, description="slug of the project the run would be launched in: its artifact references and "
                                  "run: references resolve there; without it they are reported unresolved")
    yaml: text(max_length=MAX_CONFIG_BYTES)
    # Any text: a malformed override (being typed) is answered 200 with a located problem, not refused.
    overrides: Annotated[list[text(max_length=MAX_OVERRIDE_LENGTH)], Field(max_length=MAX_OVERRIDES)] = []


class ConfigProblemOut(Schema):
    field: str = Field(description='path in the config, e.g. "trainer.steps"; "" for the whole document')
    message: str
    line: int | None = Field(description="1-based YAML line of the field, or of its nearest parent in the text")
    override: int | None = Field(description="1-based index of the override that set the field, if one did")


class ConfigCheckOut(Schema):
    ok: bool
    errors: list[ConfigProblemOut]


@router.post("/configs/validate", response={200: ConfigCheckOut, **BODY_ERRORS})
def validate_config(request: HttpRequest, body: ConfigCheckIn):  # noqa: ANN201
    """Check a run config as a launch would (nothing is stored); each problem with its field and YAML line."""
    project = project_get(actor=actor_of(request), slug=body.project) if body.project is not None else None
    problems = config_problems(yaml_text=body.yaml, overrides=body.overrides, recipe=body.recipe, project=project)
    return {"ok": not problems, "errors": [p.as_dict() for p in problems]}
