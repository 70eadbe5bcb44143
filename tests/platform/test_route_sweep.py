"""Every route answers every kind of bad input below 500, without a traceback, and another project's ids are 404.

The routes come from Django's resolver and the API's OpenAPI document: a route added without a place here fails
test_the_sweep_covers_every_route. Each route is sent, by a session and with an API token of the first project's
owner (a platform operator too, so that every form reaches its service), by the run's own token (the controller
API), by an agent token (the agent API) and anonymously: its path with the project's own ids, another project's ids
and hostile values; hostile query strings (the params its view reads, and a few it does not); for a write, hostile
bodies (JSON or form). Every method on every route. One seed for the module, rolled back at its end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import transaction
from django.test import Client, override_settings
from django.urls import URLPattern, URLResolver, get_resolver
from forgeboard.accounts.models import Project, User
from forgeboard.accounts.services import api_token_create, project_create
from forgeboard.api.urls import api
from forgeboard.artifacts.models import Artifact
from forgeboard.cluster.services import agent_token_create, host_register
from forgeboard.experiments.services import experiment_create
from forgeboard.regressions.services import suite_create, suite_launch
from forgeboard.runs.models import Run
from forgeboard.runs.services import command_create, run_launch
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_issue
from forgeboard.telemetry.ingest import telemetry_ingest

from tests.platform.conftest import TINY_GRPO_YAML
from workers.engine.telemetry_wire import TelemetryBatch
from workers.launch.local import run_dir

VIEWS = Path(__file__).resolve().parents[2] / "platform" / "forgeboard" / "web" / "views"
API = "/api/v1"
# Not swept, and why: Django's own admin (staff only; tested in test_admin.py).
EXCLUDED = ("admin/",)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

NOWHERE_ID = "987654321"
CHECKPOINT_STEP = 10
HOSTILE_SEGMENTS = ("0", "-1", str(2**63), "99999999999999999999", "x" * 5000, quote("ü名\u202e🙂"), "%ED%A0%80",
                    "%00", "a%2Fb")
HOSTILE_VALUES = ("-1", "0", "abc", "99999999999999999999", str(2**63), "1e999", "NaN", "", "x" * 10_000,
                  "%ED%A0%80", quote("ü名\u202e"))
FORM_VALUES = ("", "-1", "99999999999999999999", "1e999", "NaN", "x" * 10_000, "%ED%A0%80", "%00")
HOSTILE_QUERIES = ("page=-1", "page=abc", "page=99999999999999999999", "last=1e999", "after_seq=-5", "step=NaN",
                   "limit=0", "offset=99999999999999999999", "order=__class__", "after=", "q=" + "x" * 10_000,
                   "%ED%A0%80=%ED%A0%80&a[]=1&=&")
HOSTILE_JSON = (None, -1, 2**63, 10**20, 1.5, "1e999", "x" * 5000, "\ud800", [], {}, True)
HOSTILE_BODIES = (b"", b"{}", b"[]", b'"a string"', b"null", b"1e999", b"9" * 5000, b'{"a":', b"\xff\xfe")


@dataclass
class World:
    own: dict[str, str]
    foreign: dict[str, str]
    user: User
    bearer: str
    run_token: str
    agent_token: str


@dataclass(frozen=True)
class Op:
    route: str  # the resolver's pattern
    method: str
    template: str  # the URL with {param} for each path parameter
    area: str  # api, tokens (a person's only), controller, agent or page
    query: tuple[str, ...] = ()
    body: dict | None = None  # a valid JSON body (api, agent) or form (page)
    form_values: tuple[str, ...] = ()

    @property
    def params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.template)

    def __str__(self) -> str:
        return f"{self.method} {self.template}"


@dataclass(frozen=True)
class Page:
    methods: tuple[str, ...]
    query: tuple[str, ...] = ()
    form: dict[str, str] = field(default_factory=dict)
    form_values: tuple[str, ...] = FORM_VALUES


# The launch form read again (with a parent run, or its checkpoint): its fields are read as at /p/<slug>/launch/, which
# is sent every FORM_VALUES; here the few that reach run_launch_submit differently.
LAUNCH_FORM_AGAIN = ("", "99999999999999999999", "%00", "%ED%A0%80")
LAUNCH_FORM = {"experiment": "{experiment_id}", "new_name": "", "new_recipe": "grpo", "preset": "",
               "config_yaml": TINY_GRPO_YAML, "overrides": "trainer.steps=3", "priority": "0", "hosts": "node-1",
               "idempotency_key": "sweep-key"}
PAGES = {
    "healthz": Page(("GET",)),
    "login/": Page(("GET", "POST"), query=("next",), form={"username": "sweeper", "password": "wrong"}),
    "logout/": Page(("POST",), query=("next",)),
    "": Page(("GET",)),
    "p/<slug:slug>/": Page(("GET",), query=("q", "state", "experiment", "tag", "user", "page")),
    "p/<slug:slug>/members/": Page(("GET", "POST"), form={"username": "vera", "action": "set", "role": "viewer"}),
    "p/<slug:slug>/artifacts/": Page(("GET", "POST"), form={"action": "register", "name": "smoke", "kind": "model",
                                                            "path": "/models/tiny", "description": "d"}),
    "p/<slug:slug>/launch/": Page(("GET", "POST"), query=("experiment", "preset"), form=LAUNCH_FORM),
    "p/<slug:slug>/compare/": Page(("GET",), query=("runs", "only")),
    "p/<slug:slug>/suites/": Page(("GET",)),
    "p/<slug:slug>/suites/<str:name>/": Page(("GET",), query=("run",)),
    "runs/<int:run_id>/": Page(("GET",)),
    "runs/<int:run_id>/rollouts/": Page(("GET",)),
    "runs/<int:run_id>/checkpoints/": Page(("GET",)),
    "runs/<int:run_id>/cancel/": Page(("POST",)),
    "runs/<int:run_id>/commands/": Page(("POST",), form={"kind": "drill", "payload.kind": "kill",
                                                         "payload.role": "trainer", "payload.rank": "0"}),
    "runs/<int:run_id>/checkpoints/<int:step>/launch/": Page(("POST",), form={"idempotency_key": "sweep-key"}),
    "runs/<int:run_id>/clone/": Page(("GET", "POST"), query=("experiment", "preset"), form=LAUNCH_FORM,
                                     form_values=LAUNCH_FORM_AGAIN),
    "runs/<int:run_id>/checkpoints/<int:step>/new/": Page(("GET", "POST"), query=("experiment", "preset"),
                                                          form=LAUNCH_FORM, form_values=LAUNCH_FORM_AGAIN),
    "cluster/": Page(("GET", "POST"), form={"hostname": "node-1", "intent": "cordoned", "reason": "r"}),
    "settings/tokens/": Page(("GET", "POST"), form={"project": "{slug}", "name": "t", "scope": "read",
                                                    "expires": "30"}),
    "settings/tokens/<int:token_id>/revoke/": Page(("POST",)),
}

# A valid body for each API operation that takes one; {param} is the seeded project's value.
SUITE_SPEC = {"stages": [{"name": "s1", "experiment_id": "{experiment_id}", "config_yaml": TINY_GRPO_YAML,
                          "checks": [{"name": "r", "metric": "eval/reward_mean", "direction": "higher_is_better"}]}]}
API_BODIES = {
    ("POST", "/api/v1/projects/{slug}/experiments"): {"name": "sweep", "recipe": "grpo", "description": "",
                                                       "tags": ["a"]},
    ("POST", "/api/v1/experiments/{experiment_id}/runs"): {"config_yaml": TINY_GRPO_YAML,
                                                           "overrides": ["trainer.steps=3"], "priority": 0},
    ("POST", "/api/v1/runs/{run_id}/commands"): {"kind": "pause", "payload": {}},
    ("POST", "/api/v1/runs/{run_id}/checkpoints/{step}/runs"): {"experiment_id": "{experiment_id}",
                                                                "config_yaml": TINY_GRPO_YAML, "overrides": [],
                                                                "priority": 0},
    ("POST", "/api/v1/projects/{slug}/suites"): {"name": "sweep", "description": "", "spec": SUITE_SPEC},
    ("POST", "/api/v1/configs/validate"): {"recipe": "grpo", "project": "{slug}", "yaml": TINY_GRPO_YAML,
                                           "overrides": []},
    ("POST", "/api/v1/plans"): {"project": "{slug}", "recipe": "grpo", "yaml": TINY_GRPO_YAML, "overrides": [],
                                "gpus": [2, 4], "model": "qwen3-0.6b"},
    ("POST", "/api/v1/projects/{slug}/tokens"): {"name": "sweep-new", "scope": "read", "expires_in_days": 30},
    ("POST", "/api/v1/hosts/{hostname}/intent"): {"intent": "cordoned", "reason": "sweep"},
    ("POST", "/api/v1/projects/{slug}/artifacts"): {"name": "sweep", "kind": "model", "path": "/models/tiny",
                                                    "description": ""},
    ("POST", "/api/v1/controller/runs/{run_id}/telemetry"): {"batches": [{"seq": 1, "metrics": [
        {"key": "loss", "step": 1, "value": 0.5, "time": 1.0}]}]},
    ("POST", "/api/v1/controller/runs/{run_id}/commands/{command_id}/result"): {"ok": True, "result": {}},
}
AGENT_BODIES = {
    "api/agent/v1/hosts/register": {"hostname": "node-1", "pool": "default", "labels": {"a": "b"}, "cpu_count": 4,
                                    "memory_bytes": 1024, "devices": [{"kind": "gpu", "index": 0, "model": "H100"}]},
    "api/agent/v1/hosts/heartbeat": {"hostname": "node-1", "cpu_utilization": 1.0, "memory_utilization": 2.0,
                                     "devices": [{"kind": "gpu", "index": 0, "utilization": 3.0}]},
}
# Body fields that name another object: another project's must be answered as one that does not exist.
FOREIGN_BODY_FIELDS = {"project": "slug", "experiment_id": "experiment_id", "calibration_run": "run_id"}
# Path parameters with no other project's value: a step or metric key is looked up in the run the path names, and a
# host belongs to no project.
NO_OTHER_PROJECTS = ("step", "key", "hostname")
# Credentials refused whatever the path names (a run's token names its one run; an API token may not manage tokens):
# another project's id is answered as an id of nothing is.
REFUSED_WHATEVER_THE_ID = {("controller", "run token"), ("tokens", "bearer")}


def _patterns(resolver: URLResolver, prefix: str = "") -> Iterator[tuple[str, URLPattern]]:
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            yield from _patterns(pattern, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def _routes() -> set[str]:
    return {route for route, _ in _patterns(get_resolver()) if not route.startswith(EXCLUDED)}


def _template(route: str) -> str:
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def _openapi_ops(schema: dict) -> list[Op]:
    ops = []
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            route = re.sub(r"{(\w+)}", r"<\1>", path.removeprefix("/"))
            if "{key}" in path:
                route = route.replace("<key>", "<path:key>")
            query = tuple(p["name"] for p in operation.get("parameters", []) if p["in"] == "query")
            area = "controller" if path.startswith(f"{API}/controller/") else \
                "tokens" if operation.get("tags") == ["tokens"] else "api"
            ops.append(Op(route, method.upper(), path, area, query, API_BODIES.get((method.upper(), path))))
    return ops


SCHEMA = api.get_openapi_schema(path_prefix=f"{API}/")
UNDOCUMENTED = {("GET", f"{API}/{tail}") for tail in ("openapi.json", "docs", "")}
OPS = [
    *_openapi_ops(SCHEMA),
    *(Op(f"api/v1/{tail}", "GET", f"{API}/{tail}", "api") for tail in ("openapi.json", "docs", "")),
    *(Op(route, "POST", f"/{route}", "agent", body=body) for route, body in AGENT_BODIES.items()),
    *(Op(route, method, _template(route), "page", page.query, page.form or None, page.form_values)
      for route, page in PAGES.items() for method in page.methods),
]


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[World]:
    """Two projects, each with an experiment, a running run with a command and a checkpoint, a suite run, an artifact
    and a token. The sweep's user owns the first and is a platform operator (so every form reaches its service), and
    is not in the second. Rolled back when the module is done."""
    data_dir = tmp_path_factory.mktemp("sweep-data")
    with django_db_blocker.unblock(), override_settings(DATA_DIR=data_dir), transaction.atomic():
        user = User.objects.create_user("sweeper", password="pw-sweep-1", is_operator=True)
        User.objects.create_user("vera", password="pw-vera-1")
        stranger = User.objects.create_user("stranger", password="pw-sweep-2")
        own, foreign = (_seed_project(project=project_create(actor=actor, slug=slug, name=slug.title()), actor=actor)
                        for slug, actor in (("alpha", user), ("beta", stranger)))
        _, bearer = api_token_create(actor=user, project=Project.objects.get(slug="alpha"), name="sweep",
                                     scope="write")
        agent, agent_token = agent_token_create(actor=user, name="sweep-agent")
        host_register(actor=agent, hostname="node-1", cpu_count=4, memory_bytes=1024)
        yield World(own=own | {"hostname": "node-1"}, foreign=foreign, user=user, bearer=bearer,
                    run_token=own["run_token"], agent_token=agent_token)
        transaction.set_rollback(True)


def _seed_project(*, project: Project, actor: User) -> dict[str, str]:
    experiment = experiment_create(actor=actor, project=project, name="math", recipe="grpo")
    run = run_launch(actor=actor, experiment=experiment, config_yaml=TINY_GRPO_YAML)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    run.refresh_from_db()
    checkpoint = run_dir(run) / "checkpoints" / f"step_{CHECKPOINT_STEP:06d}" / "trainer.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"x")
    telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate(
        {"seq": 1, "metrics": [{"key": "loss", "step": 1, "value": 0.5, "time": 1.0}]})])
    command = command_create(actor=actor, run=run, kind="pause")
    spec = json.loads(json.dumps(SUITE_SPEC).replace('"{experiment_id}"', str(experiment.pk)))
    suite_run = suite_launch(actor=actor, suite=suite_create(actor=actor, project=project, name="smoke", spec=spec))
    Artifact.objects.create(project=project, name="smoke", kind="model", path="/models/tiny", created_by=actor)
    token, _ = api_token_create(actor=actor, project=project, name="victim", scope="read")
    return {"slug": project.slug, "experiment_id": str(experiment.pk), "run_id": str(run.pk),
            "step": str(CHECKPOINT_STEP), "key": "loss", "name": "smoke", "suite_run_id": str(suite_run.pk),
            "token_id": str(token.pk), "command_id": str(command.pk), "run_token": run_token_issue(run=run)}


# --- requests and what every answer must be ---------------------------------------------------------------------

@dataclass
class Sweep:
    world: World
    failures: list[str] = field(default_factory=list)
    sent: int = 0

    def clients(self, op: Op) -> list[tuple[str, Client, dict[str, str]]]:
        session = Client(raise_request_exception=False)
        session.force_login(self.world.user)
        if op.area == "page":
            return [("session", session, {})]
        if op.area == "controller":
            return [("run token", Client(raise_request_exception=False),
                     {"HTTP_AUTHORIZATION": f"Bearer {self.world.run_token}"})]
        if op.area == "agent":
            return [("agent token", Client(raise_request_exception=False),
                     {"HTTP_AUTHORIZATION": f"Bearer {self.world.agent_token}"})]
        return [("session", session, {}), ("bearer", Client(raise_request_exception=False),
                                           {"HTTP_AUTHORIZATION": f"Bearer {self.world.bearer}"})]

    def send(self, client: Client, method: str, url: str, headers: dict[str, str], *, body: bytes | str = b"",
             content_type: str = "application/json", label: str = ""):
        self.sent += 1
        kwargs = {"data": body, "content_type": content_type} if method != "GET" else {}
        response = client.generic(method, url, **kwargs, **headers) if method != "GET" else client.get(url, **headers)
        where = f"{label}: {method} {url[:200]} -> {response.status_code}"
        content = b"".join(response.streaming_content) if response.streaming else response.content
        if response.status_code >= 500:
            self.failures.append(f"{where} {content[:300]!r}")
        elif b"Traceback" in content:
            self.failures.append(f"{where} shows a traceback")
        elif url.startswith("/api/") and response.status_code >= 400:
            self.check_error_shape(response, content, where)
        return response

    def check_error_shape(self, response, content: bytes, where: str) -> None:
        try:
            assert response["Content-Type"].startswith("application/json")
            error = json.loads(content)
            assert set(error) == {"code", "message", "errors"} and isinstance(error["message"], str)
            assert all(set(e) == {"field", "message"} for e in error["errors"])
        except (AssertionError, ValueError, TypeError, KeyError):
            self.failures.append(f"{where} is not the API's error shape: {content[:300]!r}")

    def expect(self, response, statuses: set[int], label: str) -> None:
        if response.status_code not in statuses:
            self.failures.append(f"{label}: {response.status_code}, expected {sorted(statuses)}: "
                                 f"{response.content[:300]!r}")


def body_fields(op: Op) -> set[str]:
    if op.area == "agent":
        return set()
    body = SCHEMA["paths"][op.template][op.method.lower()].get("requestBody", {})
    ref = body.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return set(SCHEMA["components"]["schemas"][ref.rsplit("/", 1)[-1]]["properties"]) if ref else set()


def fill(template: str, values: dict[str, str]) -> str:
    return re.sub(r"{(\w+)}", lambda m: values[m.group(1)], template)


def own_path(op: Op, world: World, **swap: str) -> str:
    return fill(op.template, world.own | swap)


def json_leaves(value, path=()) -> Iterator[tuple]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_leaves(item, (*path, index))


def replaced(value, path: tuple, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def dumped(body) -> bytes:
    """JSON, with the text "1e999" sent as the number it spells (one a float cannot hold)."""
    return json.dumps(body).replace('"1e999"', "1e999").encode()


def with_values(body, values: dict[str, str]):
    """The body with each "{param}" text replaced by the value, an int where it is all digits."""
    text = json.dumps(body)
    for name, value in values.items():
        text = text.replace(f'"{{{name}}}"', value if value.isdigit() else json.dumps(value))
    return json.loads(text)


def form_body(form: dict[str, str | list[str]]) -> str:
    """A form body; a value is sent as is (already percent-encoded where the sweep means it)."""
    return "&".join(f"{quote(name)}={value}" for name, values in form.items()
                    for value in (values if isinstance(values, list) else [values]))


OP_IDS = [str(op) for op in OPS]


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_every_route_answers_bad_input_below_500_and_hides_other_projects(db, world, op):
    sweep = Sweep(world)
    clients = sweep.clients(op)
    _paths(sweep, op, clients)
    if op.method == "GET":
        _queries(sweep, op, clients)
    elif op.area == "page":
        _forms(sweep, op, clients)
    else:
        _bodies(sweep, op, clients)
    assert not sweep.failures, f"{len(sweep.failures)} of {sweep.sent} requests:\n" + "\n".join(sweep.failures[:40])


def _valid_body(op: Op, world: World, values: dict[str, str]) -> tuple[bytes | str, str]:
    if op.body is None:
        return b"", "application/json"
    if op.area == "page":
        form = {name: fill(value, values) if value.startswith("{") else quote(value) for name, value in op.body.items()}
        return form_body(form), "application/x-www-form-urlencoded"
    return dumped(with_values(op.body, values)), "application/json"


def _paths(sweep: Sweep, op: Op, clients) -> None:
    world = sweep.world
    anonymous = Client(raise_request_exception=False)
    body, content_type = _valid_body(op, world, world.own)
    sweep.send(anonymous, op.method, own_path(op, world), {}, body=body, content_type=content_type, label="anonymous")
    for label, client, headers in clients:
        sweep.send(client, op.method, own_path(op, world), headers, body=body, content_type=content_type, label=label)
        for param in op.params:
            if param not in NO_OTHER_PROJECTS:
                _foreign_path(sweep, op, param, label, client, headers)
    label, client, headers = clients[-1]
    for param in op.params:
        for value in HOSTILE_SEGMENTS:
            sweep.send(client, op.method, own_path(op, world, **{param: value}), headers, body=body,
                       content_type=content_type, label=f"{label}, {param}={value[:20]}")


def _foreign_path(sweep: Sweep, op: Op, param: str, label: str, client: Client, headers: dict) -> None:
    world = sweep.world
    swap = {param: world.foreign[param]}
    if param == "name":  # the same name in another project's path
        swap["slug"] = world.foreign["slug"]
    body, content_type = _valid_body(op, world, world.own | swap)
    foreign = sweep.send(client, op.method, own_path(op, world, **swap), headers, body=body, content_type=content_type,
                         label=f"{label}, another project's {param}")
    what = f"{label}: {op.method} {op.template} with another project's {param}"
    if (op.area, label) in REFUSED_WHATEVER_THE_ID:
        nowhere = sweep.send(client, op.method, own_path(op, world, **{param: NOWHERE_ID}), headers, body=body,
                             content_type=content_type, label=f"{label}, {param} of nothing")
        sweep.expect(foreign, {nowhere.status_code}, f"{what} (answered as one that does not exist)")
    else:
        sweep.expect(foreign, {404}, what)


def _queries(sweep: Sweep, op: Op, clients) -> None:
    url = own_path(op, sweep.world)
    for label, client, headers in clients[-1:]:
        for query in HOSTILE_QUERIES:
            sweep.send(client, "GET", f"{url}?{query}", headers, label=label)
        for name in op.query:
            for value in (*HOSTILE_VALUES, sweep.world.foreign["run_id"], sweep.world.foreign["experiment_id"]):
                sweep.send(client, "GET", f"{url}?{name}={value}", headers, label=label)
            sweep.send(client, "GET", f"{url}?{name}=1&{name}=2&{name}=x", headers, label=label)
    if op.route == "p/<slug:slug>/compare/":
        _compare_foreign(sweep, url, clients)


def _compare_foreign(sweep: Sweep, url: str, clients) -> None:
    own, foreign = sweep.world.own["run_id"], sweep.world.foreign["run_id"]
    for label, client, headers in clients:
        response = sweep.send(client, "GET", f"{url}?runs={own},{foreign}", headers, label=label)
        sweep.expect(response, {404}, f"{label}: compare with another project's run")


def _bodies(sweep: Sweep, op: Op, clients) -> None:
    world = sweep.world
    url = own_path(op, world)
    for label, client, headers in clients[-1:]:
        for raw in HOSTILE_BODIES:
            sweep.send(client, op.method, url, headers, body=raw, label=f"{label}, body {raw[:20]!r}")
        sweep.send(client, op.method, url, headers, body=b"a=1&b=2", content_type="application/x-www-form-urlencoded",
                   label=f"{label}, a form")
        sweep.send(client, op.method, url, headers, body=b"<x/>", content_type="text/plain", label=f"{label}, text")
    if op.body is None:
        return
    label, client, headers = clients[-1]
    valid = with_values(op.body, world.own)
    for path in json_leaves(valid):
        if not path:
            continue
        for value in HOSTILE_JSON:
            sweep.send(client, op.method, url, headers, body=dumped(replaced(valid, path, value)),
                       label=f"{label}, {'.'.join(map(str, path))}={str(value)[:20]!r}")
    for name, param in FOREIGN_BODY_FIELDS.items():
        naming = op.body | ({name: f"{{{param}}}"} if name in body_fields(op) else {})
        if f'"{{{param}}}"' not in json.dumps(naming):
            continue
        answers = []
        for values in (world.foreign, {param: NOWHERE_ID if param != "slug" else "nowhere"}):
            body = dumped(with_values(naming, world.own | values))
            answers.append(sweep.send(client, op.method, url, headers, body=body, label=f"{label}, {name}"))
        foreign, nowhere = answers
        codes = [(r.status_code, r.json().get("code") if r.status_code >= 400 else None) for r in answers]
        sweep.expect(foreign, {nowhere.status_code} - {200, 201, 202}, f"{label}: {op} with another project's {name}")
        if codes[0] != codes[1]:
            sweep.failures.append(f"{label}: {op} tells another project's {name} ({codes[0]}) from none ({codes[1]})")


def _forms(sweep: Sweep, op: Op, clients) -> None:
    world = sweep.world
    url = own_path(op, world)
    form_type = "application/x-www-form-urlencoded"
    for label, client, headers in clients:
        sweep.send(client, op.method, url, headers, body="", content_type=form_type, label=f"{label}, empty form")
        sweep.send(client, op.method, url, headers, body=b"{}", label=f"{label}, JSON")
        sweep.send(client, op.method, url, headers, body="a=%ZZ&&=&b", content_type=form_type, label=f"{label}, junk")
        if op.body is None:
            continue
        valid = {name: fill(value, world.own) if value.startswith("{") else quote(value)
                 for name, value in op.body.items()}
        for name in valid:
            for value in (*op.form_values, world.foreign["experiment_id"], world.foreign["slug"]):
                sweep.send(client, op.method, url, headers, body=form_body(valid | {name: value}),
                           content_type=form_type, label=f"{label}, {name}={value[:20]}")
            sweep.send(client, op.method, url, headers, body=form_body(valid | {name: ["1", "x"]}),
                       content_type=form_type, label=f"{label}, {name} twice")
            sweep.send(client, op.method, url, headers, body=form_body({k: v for k, v in valid.items() if k != name}),
                       content_type=form_type, label=f"{label}, no {name}")


@pytest.mark.parametrize("route", sorted(_routes()))
def test_every_method_on_every_route_answers_below_500(db, world, route):
    sweep = Sweep(world)
    op = next(op for op in OPS if op.route == route)
    for label, client, headers in sweep.clients(op)[-1:]:
        for method in METHODS:
            sweep.send(client, method, own_path(op, world), headers, body=b"{}", label=label)
    assert not sweep.failures, "\n".join(sweep.failures)


def test_the_sweep_covers_every_route(client):
    """A new route, API operation, query parameter or form field that the sweep does not send fails here."""
    assert {op.route for op in OPS} == _routes()
    served = client.get(f"{API}/openapi.json").json()
    documented = {(method.upper(), path) for path, item in served["paths"].items() for method in item}
    assert documented == {(op.method, op.template) for op in OPS if op.area in ("api", "controller", "tokens")} - UNDOCUMENTED
    with_body = {(m.upper(), p) for p, item in served["paths"].items() for m, o in item.items() if "requestBody" in o}
    assert with_body == set(API_BODIES)
    read = set()
    for source in VIEWS.glob("*.py"):
        read |= set(re.findall(r"request\.(?:GET|POST)\.(?:get|getlist)\(\s*\"(\w+)\"", source.read_text()))
    declared = {name for page in PAGES.values() for name in (*page.query, *page.form)}
    assert read <= declared | {"action"}, read - declared
