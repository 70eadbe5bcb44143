"""/api/v1/configs/validate: a run config checked as the user types, each problem at its field and YAML line.

The check is the launch's own, located (experiments/config_problems.py). Nothing is stored.
"""

from __future__ import annotations

from typing import Annotated

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field

from forgeboard.accounts.selectors import project_get
from forgeboard.api.auth import USER_AUTH, actor_of
from forgeboard.api.schemas import BODY_ERRORS, RecipeName, text
from forgeboard.experiments.config_problems import MAX_OVERRIDE_LENGTH, config_problems
from forgeboard.experiments.services import MAX_OVERRIDES
from workers.engine.yaml_safe import MAX_CONFIG_BYTES

router = Router(auth=USER_AUTH, tags=["configs"])


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
