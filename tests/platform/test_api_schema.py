"""schemathesis against the OpenAPI document with every check (`--checks all`): no 5xx, every response matches
the schema, data the document allows is accepted and data it forbids is refused. Examples are derandomized so
a CI run is repeatable."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from forgeboard.accounts.services import api_token_create
from forgeboard.wsgi import application

# Where a body that matches the document is still refused for a reason JSON Schema cannot express, 400 is
# expected for that operation only (each operation's description says why); everywhere else positive data
# must be accepted. The default statuses that stay accepted: 2xx, 401/403/404 (not yours, not there),
# 409 (a state conflict, e.g. a drill for a single-process run) and 429.
ACCEPTED = ["2xx", "401", "403", "404", "409", "429"]
REFUSED_BEYOND_SCHEMA = [
    # config_yaml is YAML checked against the run config schema (with its overrides applied).
    ("POST", r"/experiments/\{experiment_id\}/runs$"),
    # Stage configs (YAML), experiments of this project, unique stage and check names.
    ("POST", r"/projects/\{slug\}/suites$"),
    # A plan's config is YAML checked as a launch checks it; its calibration run must be a GRPO run with timelines.
    ("POST", r"/plans$"),
    # The payload of a drill, placement change or load redirect is the engine's typed operation.
    ("POST", r"/runs/\{run_id\}/commands$"),
]
# The run controller's telemetry is validated item by item (a NUL anywhere in a free-form event payload, say):
# a refused item is answered 422 `items_refused` with its index, and the rest of the batch is kept.
REFUSED_ITEM_BY_ITEM = [("POST", r"/controller/runs/\{run_id\}/telemetry$")]


def _expecting(operations: list[tuple[str, str]], status: str) -> list[dict]:
    # One filter on the operation's name ("POST /api/v1/..."): separate method and path filters would OR.
    return [{"include-name-regex": f"^{method} .*{path}",
             "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, status]}}}
            for method, path in operations]


CONFIG = schemathesis.config.SchemathesisConfig.from_dict({"operations": [
    *_expecting(REFUSED_BEYOND_SCHEMA, "400"), *_expecting(REFUSED_ITEM_BY_ITEM, "422")]})
schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application, config=CONFIG)


def on_real_objects(case, ids: dict[str, object]) -> None:
    """Send a positive example to the fixture's project, experiment and run: generated ids name nothing, so
    every such request would be a 404 and "valid data is accepted" would never be tried. Negative examples
    keep their generated (invalid) path."""
    if case.meta is not None and case.meta.generation.mode.is_positive and case.path_parameters:
        case.path_parameters = {k: ids.get(k, v) for k, v in case.path_parameters.items()}


@pytest.fixture(autouse=True)
def _in_process(wsgi_in_process):
    pass


@pytest.fixture
def bearer(team, running_run) -> dict[str, str]:
    _, token = api_token_create(actor=team.member, project=team.project, name="fuzz", scope="write")
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def ids(team, running_run) -> dict[str, object]:
    return {"slug": team.project.slug, "experiment_id": team.experiment.pk, "run_id": running_run[0].pk}


@pytest.fixture
def controller_bearer(running_run) -> dict[str, str]:
    return {"Authorization": f"Bearer {running_run[1]}"}


@schema.exclude(path_regex="^/api/v1/controller/").parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_public_api(case, bearer, ids):
    on_real_objects(case, ids)
    case.call_and_validate(headers=bearer)


@schema.include(path_regex="^/api/v1/controller/").parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_controller_api(case, controller_bearer, ids):
    # A schema-valid batch can still be out of sequence (409).
    on_real_objects(case, ids)
    case.call_and_validate(headers=controller_bearer)
