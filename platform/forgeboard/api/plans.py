"""/api/v1/plans: what a GRPO config's step will cost at several scales, before it is launched (#18).

The config is checked as a launch checks it (in the project); a calibration run, when named, must be a GRPO run of
that project with step timelines. Nothing is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field

from forgeboard.accounts.selectors import project_get
from forgeboard.api.auth import USER_AUTH, actor_of
from forgeboard.api.schemas import BODY_ERRORS, RecipeName, text
from forgeboard.experiments.config_problems import MAX_OVERRIDE_LENGTH
from forgeboard.experiments.services import MAX_OVERRIDES
from forgeboard.runs.planning import config_plan
from workers.engine.planning.devices import DEVICE_NAMES
from workers.engine.planning.report import DEFAULT_DEVICE, MAX_DEVICES, MAX_SCALES
from workers.engine.planning.shapes import KNOWN_SHAPES
from workers.engine.planning.whatif import DEFAULT_SCALES
from workers.engine.yaml_safe import MAX_CONFIG_BYTES

router = Router(auth=USER_AUTH, tags=["plans"])

DeviceName = Literal[DEVICE_NAMES]  # type: ignore[valid-type]
ShapeName = Literal[tuple(KNOWN_SHAPES)]  # type: ignore[valid-type]


class PlanIn(Schema):
    project: text(min_length=1, max_length=63) = Field(description="slug of the project the run would be launched in")
    recipe: RecipeName
    yaml: text(max_length=MAX_CONFIG_BYTES)
    overrides: Annotated[list[text(max_length=MAX_OVERRIDE_LENGTH)], Field(max_length=MAX_OVERRIDES)] = []
    device: DeviceName = DEFAULT_DEVICE
    gpus: Annotated[list[Annotated[int, Field(ge=2, le=MAX_DEVICES)]], Field(min_length=1, max_length=MAX_SCALES)] = \
        list(DEFAULT_SCALES)
    model: ShapeName | None = Field(default=None, description="a known shape instead of the config's model folder")
    calibration_run: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = Field(
        default=None, description="a GRPO run of the project whose step timelines calibrate the model (used when it "
                                  "ran on `device`)")
    batch: Literal["scaled", "fixed"] = "scaled"


@router.post("/plans", response={200: dict[str, Any], **BODY_ERRORS})
def make_plan(request: HttpRequest, body: PlanIn):  # noqa: ANN201
    """The predicted step at each scale for the placement as written and for the best generator/trainer split."""
    project = project_get(actor=actor_of(request), slug=body.project)
    return config_plan(project=project, recipe=body.recipe, yaml_text=body.yaml, overrides=body.overrides,
                       device=body.device, scales=tuple(body.gpus), model=body.model,
                       calibration_run_id=body.calibration_run, batch=body.batch)
