"""/api/v1 regression suites: define, launch (202 with a status URL), and read verdicts."""

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema, Status
from pydantic import Field

from forgeboard.accounts.selectors import project_get
from forgeboard.api.auth import USER_AUTH, actor_of, require_write_scope
from forgeboard.api.idempotent import idempotent
from forgeboard.api.schemas import BODY_ERRORS, ERRORS, IDEMPOTENT_ERRORS, NOT_BLANK, text
from forgeboard.errors import NotFound, is_db_id
from forgeboard.accounts.permissions import project_role
from forgeboard.regressions.models import Suite, SuiteRun
from forgeboard.regressions.spec import SuiteSpec
from forgeboard.regressions.services import suite_create, suite_launch, suite_run_refresh

router = Router(auth=USER_AUTH, tags=["regressions"])


class SuiteIn(Schema):
    name: text(min_length=1, max_length=100, pattern=NOT_BLANK)
    description: text(max_length=10_000) = ""
    spec: SuiteSpec


class SuiteOut(Schema):
    id: int
    name: str
    description: str
    spec: dict[str, Any]
    created_at: datetime


class CheckOut(Schema):
    name: str
    metric: str
    gate: bool
    value: float | None
    baseline: float | None
    threshold: float | None
    verdict: str
    detail: str


class StageOut(Schema):
    name: str
    run_id: int
    run_state: str
    verdict: str
    predicted_step_s: float | None = Field(description="the what-if model's step seconds for this stage's config, "
                                                       "calibrated on the suite run's first stage")
    measured_step_s: float | None = Field(description="the median step seconds of the stage's run")
    prediction_error: float | None = Field(description="(predicted - measured) / measured")
    prediction_note: str
    checks: list[CheckOut]

    @staticmethod
    def resolve_run_state(stage) -> str:  # noqa: ANN001
        return stage.run.state

    @staticmethod
    def resolve_checks(stage) -> list:  # noqa: ANN001
        return list(stage.checks.all())


class SuiteRunOut(Schema):
    id: int
    suite: str
    verdict: str
    created_at: datetime
    finished_at: datetime | None
    status_url: str
    stages: list[StageOut]

    @staticmethod
    def resolve_suite(suite_run) -> str:  # noqa: ANN001
        return suite_run.suite.name

    @staticmethod
    def resolve_status_url(suite_run) -> str:  # noqa: ANN001
        return f"/api/v1/suite-runs/{suite_run.pk}"

    @staticmethod
    def resolve_stages(suite_run) -> list:  # noqa: ANN001
        return list(suite_run.stages.select_related("run").prefetch_related("checks"))


def _suite(request: HttpRequest, slug: str, name: str) -> Suite:
    project = project_get(actor=actor_of(request), slug=slug)
    suite = Suite.objects.filter(project=project, name=name).first()
    if suite is None:
        raise NotFound(f"no suite {name!r} in {slug}")
    return suite


@router.post("/projects/{slug}/suites", response={201: SuiteOut, **BODY_ERRORS, **IDEMPOTENT_ERRORS})
@idempotent
def create_suite(request: HttpRequest, slug: str, body: SuiteIn):
    """Define a suite. Beyond the spec's shape, each stage must name an experiment of this project and a
    config that experiment can run (YAML checked as a launch checks it), and names must be unique: a body
    that matches this document can still be refused with 400 and the field (`spec.stages.0.config_yaml`)."""
    require_write_scope(request)
    project = project_get(actor=actor_of(request), slug=slug)
    suite = suite_create(actor=actor_of(request), project=project, name=body.name,
                         spec=body.spec.model_dump(mode="json", exclude_unset=True),
                         description=body.description)
    return Status(201, suite)


@router.get("/projects/{slug}/suites", response={200: list[SuiteOut], **ERRORS})
def list_suites(request: HttpRequest, slug: str):
    return list(Suite.objects.filter(project=project_get(actor=actor_of(request), slug=slug)).order_by("name"))


@router.post("/projects/{slug}/suites/{name}/runs", response={202: SuiteRunOut, **ERRORS, **IDEMPOTENT_ERRORS})
@idempotent
def launch_suite(request: HttpRequest, slug: str, name: str):
    """Launch every stage; poll `status_url` for the verdict."""
    require_write_scope(request)
    return Status(202, suite_launch(actor=actor_of(request), suite=_suite(request, slug, name)))


@router.get("/suite-runs/{suite_run_id}", response={200: SuiteRunOut, **ERRORS})
def get_suite_run(request: HttpRequest, suite_run_id: int):
    suite_run = (SuiteRun.objects.select_related("suite__project").filter(pk=suite_run_id).first()
                 if is_db_id(suite_run_id) else None)
    if suite_run is None or project_role(actor=actor_of(request), project=suite_run.suite.project) is None:
        raise NotFound(f"no suite run {suite_run_id}")
    return suite_run_refresh(suite_run=suite_run)
