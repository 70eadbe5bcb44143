"""/api/v1 for people and CI: token scopes, project isolation, one error format, pagination."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from forgeboard.accounts.services import api_token_create, project_create
from forgeboard.runs.models import Run
from forgeboard.runs.states import RunState
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.telemetry_wire import TelemetryBatch


@pytest.fixture
def tokens(team):
    _, write = api_token_create(actor=team.member, project=team.project, name="ci-write", scope="write")
    _, read = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    _, foreign = api_token_create(actor=team.outsider, project=other, name="beta-ci", scope="write")
    return {"write": write, "read": read, "foreign": foreign}


def call(client, method: str, path: str, token: str | None = None, body: dict | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(f"/api/v1{path}", **kwargs, **headers)


def test_token_sees_only_its_project(client, team, tokens):
    listed = call(client, "get", "/projects", tokens["write"]).json()
    assert [p["slug"] for p in listed["items"]] == ["alpha"] and listed["count"] == 1
    assert call(client, "get", "/projects/beta", tokens["write"]).status_code == 404
    assert call(client, "get", "/projects/alpha", tokens["foreign"]).status_code == 404
    assert call(client, "get", f"/experiments/{team.experiment.pk}", tokens["foreign"]).status_code == 404


def test_launch_read_cancel_through_the_api(client, team, tokens, grpo_yaml):
    created = call(client, "post", f"/experiments/{team.experiment.pk}/runs", tokens["write"],
                   {"config_yaml": grpo_yaml, "overrides": ["trainer.steps=9"], "priority": 5})
    assert created.status_code == 201, created.content
    run = created.json()
    assert run["state"] == "queued" and run["config"]["trainer"]["steps"] == 9 and run["priority"] == 5
    assert call(client, "get", f"/runs/{run['id']}", tokens["read"]).json()["config_yaml"] == grpo_yaml
    assert call(client, "get", f"/runs/{run['id']}", tokens["foreign"]).status_code == 404
    assert call(client, "post", f"/runs/{run['id']}/cancel", tokens["foreign"]).status_code == 404
    cancelled = call(client, "post", f"/runs/{run['id']}/cancel", tokens["write"])
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    again = call(client, "post", f"/runs/{run['id']}/cancel", tokens["write"])
    assert again.status_code == 409 and again.json()["code"] == "conflict"


def test_read_only_tokens_cannot_write(client, team, tokens, grpo_yaml):
    launch = call(client, "post", f"/experiments/{team.experiment.pk}/runs", tokens["read"],
                  {"config_yaml": grpo_yaml})
    assert launch.status_code == 403 and launch.json() == {
        "code": "permission_denied", "message": "this API token is read-only", "errors": []}
    made = call(client, "post", "/projects/alpha/experiments", tokens["read"], {"name": "x", "recipe": "sft"})
    assert made.status_code == 403
    assert Run.objects.count() == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"config_yaml": "recipe: grpo\nmodel: {path: /m}\ntrainer: {steps: 0}\n"}, "config.trainer.steps"),
        ({"config_yaml": "recipe: [unclosed"}, "config"),
        ({"config_yaml": "recipe: grpo\nmodel: {path: /m}\n", "priority": 1000}, "priority"),
        ({"config_yaml": "recipe: grpo\nmodel: {path: /m}\n", "priority": True}, "priority"),
        ({}, "config_yaml"),
    ],
)
def test_bad_launches_name_the_field(client, team, tokens, body, field):
    response = call(client, "post", f"/experiments/{team.experiment.pk}/runs", tokens["write"], body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "validation_failed"
    assert field in [e["field"] for e in response.json()["errors"]]
    assert Run.objects.count() == 0


def test_experiments_and_pagination(client, team, tokens):
    for i in range(5):
        made = call(client, "post", "/projects/alpha/experiments", tokens["write"],
                    {"name": f"exp-{i}", "recipe": "sft", "tags": ["a"]})
        assert made.status_code == 201
    duplicate = call(client, "post", "/projects/alpha/experiments", tokens["write"], {"name": "exp-1", "recipe": "sft"})
    assert duplicate.status_code == 409 and duplicate.json()["errors"][0]["field"] == "name"  # a taken name
    page = call(client, "get", "/projects/alpha/experiments?limit=2&offset=2", tokens["read"]).json()
    assert page["count"] == 6 and len(page["items"]) == 2


def test_the_api_docs_page_loads_nothing_from_another_site(client, team):
    """/api/v1/docs was a blank page on a machine offline: its Swagger UI came from cdn.jsdelivr.net."""
    client.force_login(team.member)
    page = client.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert any(s.endswith("swagger-ui-bundle.js") for s in sources), sources
    assert [s for s in sources if not s.startswith("/")] == [], "every script, style and icon from this server"
    for source in sources:
        served = client.get(source)
        assert served.status_code == 200, source
        if hasattr(served, "close"):
            served.close()
    assert '"url": "/api/v1/openapi.json"' in html


def test_the_openapi_document_has_no_key_twice(client):
    """Swagger UI refused the document ("Parser error: duplicated mapping key"): the operations with a body had
    ninja's 413 (an int key) and the 413 added for the body limit (a string key), both written as "413"."""
    twice: list[tuple[str, list[str]]] = []

    def pairs(items: list[tuple[str, object]]) -> dict:
        keys = [key for key, _ in items]
        twice.extend((key, keys) for key in set(keys) if keys.count(key) > 1)
        return dict(items)

    document = json.loads(client.get("/api/v1/openapi.json").content, object_pairs_hook=pairs)
    assert twice == []
    launch = document["paths"]["/api/v1/experiments/{experiment_id}/runs"]["post"]["responses"]
    assert launch["413"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")


@pytest.mark.parametrize("path", ["/api/v1/openapi.json", "/api/v1/docs"])
@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_the_api_document_and_its_page_are_only_read(client, path, method):
    answer = getattr(client, method)(path)
    assert answer.status_code == 405 and answer["Allow"] == "GET, HEAD"
    assert answer.json()["code"] == "method_not_allowed"


def test_the_openapi_document_is_built_once(client, monkeypatch):
    from ninja import NinjaAPI

    from forgeboard.api.base import api

    builds = []
    build = NinjaAPI.get_openapi_schema
    monkeypatch.setattr(NinjaAPI, "get_openapi_schema", lambda self, **kw: builds.append(kw) or build(self, **kw))
    monkeypatch.setattr(api, "_schemas", {}, raising=False)
    first, second = client.get("/api/v1/openapi.json"), client.get("/api/v1/openapi.json")
    assert first.status_code == second.status_code == 200 and first.content == second.content
    assert len(builds) == 1


@pytest.mark.parametrize("things", ["experiments", "suites", "artifacts", "tokens"])
def test_the_openapi_document_states_a_taken_name_is_a_409(client, things):
    responses = client.get("/api/v1/openapi.json").json()["paths"][f"/api/v1/projects/{{slug}}/{things}"]["post"]["responses"]
    assert responses["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")


def test_commands_metrics_and_events(client, team, tokens, running_run):
    run, _ = running_run
    sent = call(client, "post", f"/runs/{run.pk}/commands", tokens["write"], {"kind": "checkpoint"})
    assert sent.status_code == 201 and sent.json()["state"] == "pending"
    unknown = call(client, "post", f"/runs/{run.pk}/commands", tokens["write"], {"kind": "explode"})
    assert unknown.status_code == 400 and unknown.json()["errors"][0]["field"] == "kind"
    telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate({
        "seq": 1, "metrics": [{"key": "loss", "step": s, "value": 1.0 / (s + 1), "time": 1.0} for s in range(100)],
        "events": [{"kind": "eval", "payload": {"accuracy": 0.5}, "time": 1.0}]})])
    series = call(client, "get", f"/runs/{run.pk}/metrics", tokens["read"]).json()
    assert series == [{"key": "loss", "point_count": 100, "first_step": 0, "last_step": 99, "last_value": 0.01,
                       "min_value": 0.01, "max_value": 1.0}]
    full = call(client, "get", f"/runs/{run.pk}/metrics/loss?start_step=10&end_step=19", tokens["read"]).json()
    assert full["steps"] == list(range(10, 20)) and not full["downsampled"]
    coarse = call(client, "get", f"/runs/{run.pk}/metrics/loss?buckets=10", tokens["read"]).json()
    assert coarse["downsampled"] and len(coarse["steps"]) == 10 and coarse["high"][0] == 1.0
    assert call(client, "get", f"/runs/{run.pk}/metrics/loss?buckets=0", tokens["read"]).status_code == 400
    # a whole number in exponent form is the number (JSON Schema reads it so); a fraction is refused
    exponent = call(client, "get", f"/runs/{run.pk}/metrics/loss?start_step=1e%2B1&end_step=1.9e1", tokens["read"])
    assert exponent.status_code == 200 and exponent.json()["steps"] == full["steps"]
    far = call(client, "get", f"/runs/{run.pk}/metrics/loss?end_step=1e%2B18", tokens["read"])
    assert far.status_code == 200 and len(far.json()["steps"]) == 100
    for bad in ("start_step=1.5e0", "buckets=1e5", "end_step=1e%2B99"):
        refused = call(client, "get", f"/runs/{run.pk}/metrics/loss?{bad}", tokens["read"])
        assert refused.status_code == 400 and refused.json()["errors"][0]["field"] == bad.split("=")[0], bad
    events = call(client, "get", f"/runs/{run.pk}/events?after_seq=0", tokens["read"]).json()
    kinds = [e["kind"] for e in events]
    assert kinds[-1] == "eval" and "command_issued" in kinds
    last = events[-1]["seq"]
    assert call(client, "get", f"/runs/{run.pk}/events?after_seq={last}", tokens["read"]).json() == []
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    late = call(client, "post", f"/runs/{run.pk}/commands", tokens["write"], {"kind": "pause"})
    assert late.status_code == 409


def test_missing_and_bad_tokens_get_401(client, tokens):
    assert call(client, "get", "/projects").status_code == 401
    response = call(client, "get", "/projects", "fb_000000000000_nope")
    assert response.status_code == 401 and response.json()["code"] == "unauthenticated"


def test_session_writes_need_csrf(team, grpo_yaml):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(team.member)
    assert browser.get("/api/v1/projects").status_code == 200
    refused = browser.post(f"/api/v1/experiments/{team.experiment.pk}/runs",
                           data=json.dumps({"config_yaml": grpo_yaml}), content_type="application/json")
    assert refused.status_code == 403
    assert Run.objects.count() == 0


def test_config_schema_is_public_json_schema(client):
    schema = client.get("/api/v1/config-schema").json()
    assert schema["title"] == "RunConfig" and "trainer" in schema["properties"]


def test_repeated_invalid_tokens_are_rate_limited(client, tokens, settings):
    from django.core.cache import cache

    cache.clear()
    settings.API_AUTH_FAILURES_PER_MINUTE = 5
    codes = [call(client, "get", "/projects", f"fb_{7:012d}_wrong").status_code for _ in range(8)]
    assert codes == [401] * 5 + [429] * 3
    limited = call(client, "get", "/projects", f"fb_{7:012d}_wrong")
    assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
    assert call(client, "get", "/projects", tokens["write"]).status_code == 200, \
        "a valid token is checked first and never refused by the brake"
    malformed = [call(client, "get", "/projects", f"nonsense-{i}").status_code for i in range(7)]
    assert malformed == [401] * 5 + [429] * 2, "malformed tokens are counted per address"
    assert call(client, "get", "/projects", tokens["read"]).status_code == 200
    cache.clear()


def test_each_token_has_a_request_budget(client, tokens, settings):
    from django.core.cache import cache

    cache.clear()
    settings.API_RATE_PER_MINUTE = 3
    codes = [call(client, "get", "/projects", tokens["read"]).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    assert call(client, "get", "/projects", tokens["write"]).status_code == 200, "budgets are per token"
    cache.clear()
