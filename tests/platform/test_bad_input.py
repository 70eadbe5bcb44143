"""Bad input gets a clear error that names the problem, and nothing is stored."""

from __future__ import annotations

import json
import select
import socket

import pytest
from django.conf import settings
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from forgeboard.accounts.services import api_token_create
from forgeboard.audit.models import AuditEvent
from forgeboard.errors import AlreadyExists, ValidationFailed
from forgeboard.experiments.models import ConfigSnapshot, Experiment
from forgeboard.experiments.services import experiment_create
from forgeboard.regressions.models import Suite
from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import run_launch
from forgeboard.stream_limits import CLIENT_FRAME_MAX_BYTES, CLIENT_FRAME_MAX_CHARS
from forgeboard.telemetry.models import RunEvent
from tests.support.processes import free_port, web_server
from workers.engine.wire_limits import MAX_JSON_DEPTH, MAX_REQUEST_BYTES
from workers.engine.yaml_safe import MAX_CONFIG_BYTES, MAX_DEPTH

ALIAS_BOMB = """\
recipe: grpo
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]
"""


def _stored() -> tuple[int, int, int, int, int]:
    return (Run.objects.count(), ConfigSnapshot.objects.count(), Experiment.objects.count(),
            RunEvent.objects.count(), AuditEvent.objects.count())


def _nested(depth: int) -> str:
    return "recipe: grpo\nmodel: {path: /m}\nextra: " + "[" * depth + "1" + "]" * depth + "\n"


BAD_CONFIGS = {
    "malformed": ("recipe: grpo\nmodel: [unclosed\n", "config", "malformed YAML"),
    "not a mapping": ("- just\n- a list\n", "config", "must be a mapping"),
    "empty": ("   \n", "config", "empty"),
    "too big": ("recipe: grpo\n# " + "x" * MAX_CONFIG_BYTES + "\n", "config", "over the limit"),
    "too deep": (_nested(MAX_DEPTH + 5), "config", f"deeper than {MAX_DEPTH}"),
    "alias bomb": (ALIAS_BOMB, "config", "aliases"),
    "duplicate key": ("recipe: grpo\nrecipe: sft\nmodel: {path: /m}\n", "config", "duplicate key 'recipe'"),
    "unreadable tagged value": ("recipe: grpo\nmodel: {path: /m}\ntrainer: {steps: !!int abc}\n", "config",
                                "invalid literal for int()"),
    "5000-digit integer": ("recipe: grpo\nmodel: {path: /m}\ntrainer: {steps: " + "9" * 5000 + "}\n", "config",
                           "Exceeds the limit (4300 digits)"),
    "list as a key": ("recipe: grpo\nmodel: {path: /m}\n? [a, b]\n: 1\n", "config", "a key must be a plain value"),
    "nan": ("recipe: grpo\nmodel: {path: /m}\nloss: {entropy_coef: .nan}\n", "config", ".nan is not a finite number"),
    "bytes": ("recipe: grpo\nmodel: {path: !!binary aGk=}\n", "config", "the YAML tag !!binary is not allowed"),
    "unknown recipe": ("recipe: ppo\nmodel: {path: /m}\n", "config.recipe", "'grpo' or 'sft'"),
    "unknown key": ("recipe: grpo\nmodel: {path: /m}\ntrainer: {stepz: 3}\n", "config.trainer.stepz", "unknown key"),
    "out of range": ("recipe: grpo\nmodel: {path: /m}\ngrpo: {group_size: 1}\n", "config.grpo.group_size",
                     "greater than or equal to 2"),
    "missing model": ("recipe: grpo\n", "config.model", "Field required"),
    "recipe mismatch": ("recipe: sft\nmodel: {path: /m}\n", "config.recipe", "experiment's recipe is 'grpo'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_refused_with_the_field_and_nothing_is_stored(team, case):
    text, field, message = BAD_CONFIGS[case]
    before = _stored()
    with pytest.raises(ValidationFailed) as caught:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=text)
    fields = [p.field for p in caught.value.problems]
    assert field in fields, fields
    assert message in caught.value.message
    assert _stored() == before


def test_bad_override_names_the_field(team, grpo_yaml):
    before = _stored()
    with pytest.raises(ValidationFailed) as caught:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                   overrides=["trainer.steps=-3"])
    assert [p.field for p in caught.value.problems] == ["config.trainer.steps"]
    assert _stored() == before


def test_overrides_are_applied_and_snapshotted(team, grpo_yaml):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                     overrides=["trainer.steps=7"])
    assert run.config.parsed["trainer"]["steps"] == 7
    assert run.config.overrides == ["trainer.steps=7"]
    assert run.config.yaml_text == grpo_yaml


def test_same_config_reuses_one_immutable_snapshot(team, grpo_yaml):
    first = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    second = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    assert first.config_id == second.config_id
    assert (first.number, second.number) == (1, 2)
    snapshot = first.config
    snapshot.yaml_text = "recipe: sft"
    with pytest.raises(Exception, match="cannot be changed"):
        snapshot.save()


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"recipe": "ppo"}, "recipe", "unknown recipe 'ppo'"),
        ({"name": "math"}, "name", "already exists"),
        ({"name": "   "}, "name", "must not be empty"),
        ({"name": "x" * 201}, "name", "at most 200"),
        ({"tags": "not-a-list"}, "tags", "list of text tags"),
        ({"tags": [f"t{i}" for i in range(30)]}, "tags", "at most 20 tags"),
    ],
)
def test_bad_experiment_is_refused(team, kwargs, field, message):
    before = _stored()
    args = {"name": "new-one", "recipe": "grpo"} | kwargs
    with pytest.raises(ValidationFailed) as caught:
        experiment_create(actor=team.member, project=team.project, **args)
    assert caught.value.problems[0].field == field
    assert message in caught.value.message
    assert _stored() == before


@pytest.mark.parametrize("priority", [101, -101, True, "1"])
def test_bad_priority_is_refused(team, grpo_yaml, priority):
    before = _stored()
    with pytest.raises(ValidationFailed, match="priority"):
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml, priority=priority)
    assert _stored() == before


def test_duplicate_project_slug_is_refused(team):
    from forgeboard.accounts.services import project_create

    with pytest.raises(AlreadyExists, match="already exists") as caught:
        project_create(actor=team.outsider, slug="alpha", name="Again")
    assert caught.value.problems[0].field == "slug"
    with pytest.raises(ValidationFailed) as caught:
        project_create(actor=team.outsider, slug="Not A Slug", name="x")
    assert caught.value.problems[0].field == "slug"


# --- hostile bodies through the API: too big, NUL, too deep; each a 4xx naming the field, nothing stored ----------

FIFTY_MB_YAML = "recipe: grpo\n# " + "x" * (50 * 1024 * 1024) + "\n"
NINE_MIB = 9 * 1024 * 1024


@pytest.fixture
def bearer(team) -> dict[str, str]:
    _, token = api_token_create(actor=team.member, project=team.project, name="hostile", scope="write")
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def _post(client, path: str, body: dict | str | bytes, headers: dict, **extra):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(f"/api/v1{path}", data=data, content_type="application/json", **headers, **extra)


def _assert_refused(response, status: int, code: str, field: str) -> dict:
    assert response.status_code == status, response.content[:500]
    body = response.json()
    assert set(body) >= {"code", "message", "errors"} and body["code"] == code, body
    assert field in [e["field"] for e in body["errors"]], body
    return body


def _everything_stored() -> tuple[int, ...]:
    return (*_stored(), Command.objects.count(), Suite.objects.count())


@pytest.mark.parametrize("endpoint", ["validate", "launch"])
def test_a_50_mb_config_is_refused_with_413_before_it_is_read(client, team, bearer, endpoint):
    before = _everything_stored()
    if endpoint == "validate":
        response = _post(client, "/configs/validate", {"recipe": "grpo", "yaml": FIFTY_MB_YAML}, bearer)
    else:
        response = _post(client, f"/experiments/{team.experiment.pk}/runs", {"config_yaml": FIFTY_MB_YAML}, bearer)
    body = _assert_refused(response, 413, "payload_too_large", "body")
    assert str(MAX_REQUEST_BYTES) in body["message"]
    assert _everything_stored() == before


def test_a_9_mib_body_is_refused_with_and_without_content_length(client, team, bearer):
    before = _everything_stored()
    path = f"/experiments/{team.experiment.pk}/runs"
    payload = json.dumps({"config_yaml": "x" * NINE_MIB})
    _assert_refused(_post(client, path, payload, bearer), 413, "payload_too_large", "body")
    # Chunked: no Content-Length; the body is read only up to the limit.
    chunked = _post(client, path, payload, bearer, CONTENT_LENGTH="", HTTP_TRANSFER_ENCODING="chunked")
    _assert_refused(chunked, 413, "payload_too_large", "body")
    assert _everything_stored() == before


def test_a_chunked_body_under_the_limit_is_read_whole(client, team, bearer):
    payload = json.dumps({"recipe": "grpo", "yaml": "recipe: grpo\n# " + "x" * (7 * 1024 * 1024) + "\n"})
    response = _post(client, "/configs/validate", payload, bearer, CONTENT_LENGTH="", HTTP_TRANSFER_ENCODING="chunked")
    _assert_refused(response, 400, "validation_failed", "yaml")  # read whole: over the config's own limit


def test_a_page_body_over_the_limit_gets_a_plain_413(client, team):
    client.force_login(team.member)
    response = client.post("/login/", data="x" * NINE_MIB, content_type="text/plain")
    assert response.status_code == 413 and response["Content-Type"].startswith("text/plain")


def test_the_openapi_document_states_the_limit(client):
    document = client.get("/api/v1/openapi.json").json()
    assert str(MAX_REQUEST_BYTES) in document["info"]["description"]
    with_body = [(path, method, operation) for path, item in document["paths"].items()
                 for method, operation in item.items() if "requestBody" in operation]
    assert len(with_body) >= 5
    for path, method, operation in with_body:
        too_large = operation["responses"].get("413")
        assert too_large, f"{method.upper()} {path} does not state the 413"
        assert too_large["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")


@pytest.mark.slow
def test_uvicorn_refuses_a_chunked_body_over_the_limit_as_it_arrives(tmp_path, transactional_db):
    port = free_port()
    with web_server(tmp_path / "web.log", port=port), socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /api/v1/configs/validate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * (256 * 1024)
        sent, answered = 0, b""
        while sent < 64 * 1024 * 1024 and not answered:  # far past the limit if nobody stops us
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 0)[0]:
                answered = sock.recv(65536)
        while b"}" not in answered:  # the head and the JSON body may come in separate reads
            part = sock.recv(65536)
            if not part:
                break
            answered += part
        # A declared length over the limit is refused at once, before a byte of the body is sent.
        with socket.create_connection(("127.0.0.1", port), timeout=30) as declared:
            declared.sendall(b"POST /api/v1/configs/validate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % NINE_MIB)
            at_once = declared.recv(65536)
    head, _, rest = answered.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answered[:300]
    assert json.loads(rest)["code"] == "payload_too_large"
    assert MAX_REQUEST_BYTES <= sent < MAX_REQUEST_BYTES + 8 * 1024 * 1024, sent  # refused soon after the limit
    assert at_once.startswith(b"HTTP/1.1 413"), at_once[:300]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
def test_uvicorn_closes_a_stream_that_sends_a_frame_over_the_limit_and_others_go_on(tmp_path, team):
    _, token = api_token_create(actor=team.member, project=team.project, name="ws", scope="read")
    port = free_port()
    url, origin = f"ws://127.0.0.1:{port}/ws/projects/alpha/?token={token}", f"http://127.0.0.1:{port}"
    pad = "\N{GRINNING FACE}" * (CLIENT_FRAME_MAX_CHARS - len('{"type": "ping", "pad": ""}'))
    largest = json.dumps({"type": "ping", "pad": pad}, ensure_ascii=False)  # the longest frame a stream reads
    assert len(largest) == CLIENT_FRAME_MAX_CHARS and len(largest.encode()) <= CLIENT_FRAME_MAX_BYTES
    with web_server(tmp_path / "web.log", port=port), connect(url, origin=origin, open_timeout=10) as kept, \
            connect(url, origin=origin, open_timeout=10) as flooding:
        kept.send(largest)
        assert json.loads(kept.recv(timeout=10)) == {"type": "pong"}
        flooding.send("x" * (CLIENT_FRAME_MAX_BYTES + 1))
        with pytest.raises(ConnectionClosed) as closed:
            flooding.recv(timeout=10)
        kept.send(json.dumps({"type": "ping"}))
        assert json.loads(kept.recv(timeout=10)) == {"type": "pong"}
    assert closed.value.rcvd.code == 1009  # message too big


def _handshake(port: int, *, path: str, headers: str = "") -> bytes:
    """The first line a websocket handshake is answered with, or b"" when none came in 10 s."""
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://127.0.0.1:{port}\r\n{headers}"
               "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               "Sec-WebSocket-Version: 13\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        try:
            return sock.recv(4096).split(b"\r\n")[0]
        except TimeoutError:
            return b""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
def test_a_stream_handshake_too_long_to_read_is_answered_and_others_go_on(tmp_path, team):
    """websockets reads a handshake line up to 8 KiB: a longer URL or header is refused at once (414, 431), not
    left hanging with no answer, and the next stream opens."""
    _, token = api_token_create(actor=team.member, project=team.project, name="ws", scope="read")
    port = free_port()
    with web_server(tmp_path / "web.log", port=port):
        assert _handshake(port, path=f"/ws/projects/alpha/?token={token}&pad={'a' * 9000}") == (
            b"HTTP/1.1 414 Request-URI Too Long")
        assert _handshake(port, path=f"/ws/projects/alpha/?token={'a' * 70000}") == b"HTTP/1.1 414 Request-URI Too Long"
        assert _handshake(port, path="/ws/projects/alpha/", headers=f"Cookie: c={'b' * 9000}\r\n") == (
            b"HTTP/1.1 431 Request Header Fields Too Large")
        assert _handshake(port, path=f"/ws/projects/alpha/?token={token}") == b"HTTP/1.1 101 Switching Protocols"


NUL = "bad\x00text"


@pytest.mark.parametrize(("body", "field"), [
    ({"name": NUL, "recipe": "grpo"}, "name"),
    ({"name": "fine", "recipe": "grpo", "description": NUL}, "description"),
    ({"name": "fine", "recipe": "grpo", "tags": ["ok", NUL]}, "tags.1"),
    ({"name": "lone \ud800 surrogate", "recipe": "grpo"}, "name"),
])
def test_unstorable_text_in_an_experiment_is_a_field_error(client, team, bearer, body, field):
    before = _everything_stored()
    _assert_refused(_post(client, "/projects/alpha/experiments", body, bearer), 400, "validation_failed", field)
    assert _everything_stored() == before


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"name": NUL}, "name"), ({"description": NUL}, "description"), ({"tags": ["ok", NUL]}, "tags"),
])
def test_the_service_refuses_unstorable_experiment_text_too(team, kwargs, field):
    before = _everything_stored()
    with pytest.raises(ValidationFailed) as caught:
        experiment_create(actor=team.member, project=team.project, **({"name": "n", "recipe": "grpo"} | kwargs))
    assert caught.value.problems[0].field == field and "NUL" in caught.value.message
    assert _everything_stored() == before


def test_an_override_with_a_nul_is_refused_by_the_api_and_the_service(client, team, bearer, grpo_yaml):
    before = _everything_stored()
    body = {"config_yaml": grpo_yaml, "overrides": ["model.path=/models/x\x00y"]}
    _assert_refused(_post(client, f"/experiments/{team.experiment.pk}/runs", body, bearer), 400,
                    "validation_failed", "overrides.0")
    with pytest.raises(ValidationFailed) as caught:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                   overrides=["model.path=/models/x\x00y"])
    assert caught.value.problems[0].field == "overrides.0"
    assert _everything_stored() == before


# A NUL or a lone surrogate written as a YAML escape: the text is plain ASCII, the parsed value is not storable.
CHECK = {"name": "c", "metric": "reward", "direction": "higher_is_better"}
ESCAPES = {"surrogate": (r"\uD800", "lone surrogates"), "nul": (r"\0", "NUL")}


@pytest.mark.parametrize("escape", list(ESCAPES))
@pytest.mark.parametrize("in_override", [False, True])
def test_an_escaped_unstorable_config_value_is_refused_at_its_field(client, team, bearer, grpo_yaml, escape,
                                                                     in_override):
    code, reason = ESCAPES[escape]
    if in_override:
        yaml_text, overrides = grpo_yaml, [f'checkpoint.folder="s{code}t"']
    else:
        yaml_text, overrides = grpo_yaml + f'checkpoint:\n  folder: "s{code}t"\n', []
    before = _everything_stored()
    body = _assert_refused(_post(client, f"/experiments/{team.experiment.pk}/runs",
                                 {"config_yaml": yaml_text, "overrides": overrides}, bearer),
                           400, "validation_failed", "config.checkpoint.folder")
    assert reason in body["message"]
    stage = {"name": "s", "experiment_id": team.experiment.pk, "config_yaml": yaml_text, "overrides": overrides,
             "checks": [CHECK]}
    _assert_refused(_post(client, "/projects/alpha/suites", {"name": "smoke", "spec": {"stages": [stage]}}, bearer),
                    400, "validation_failed", "spec.stages.0.config.checkpoint.folder")
    plan = {"project": "alpha", "recipe": "grpo", "yaml": yaml_text, "overrides": overrides}
    _assert_refused(_post(client, "/plans", plan, bearer), 400, "validation_failed", "config.checkpoint.folder")
    check = _post(client, "/configs/validate", {"recipe": "grpo", "yaml": yaml_text, "overrides": overrides}, bearer)
    assert check.status_code == 200 and check.json()["ok"] is False
    problem = next(e for e in check.json()["errors"] if e["field"] == "checkpoint.folder")
    assert reason in problem["message"] and problem["override"] == (1 if overrides else None)
    assert _everything_stored() == before


def test_an_escaped_unstorable_config_key_is_refused_at_its_section(client, team, bearer, grpo_yaml):
    before = _everything_stored()
    body = {"config_yaml": grpo_yaml + 'checkpoint:\n  "fol\\0der": x\n'}
    response = _assert_refused(_post(client, f"/experiments/{team.experiment.pk}/runs", body, bearer), 400,
                               "validation_failed", "config.checkpoint")
    assert "key" in response["message"] and "NUL" in response["message"]
    assert _everything_stored() == before


def test_a_suite_stored_before_the_check_is_refused_at_launch(client, team, bearer, grpo_yaml):
    # Stored as the JSON text it is (a NUL escape), as suites created before the check were.
    stage = {"name": "s", "experiment_id": team.experiment.pk, "checks": [CHECK],
             "config_yaml": grpo_yaml + 'checkpoint:\n  folder: "s\\0t"\n'}
    Suite.objects.create(project=team.project, name="smoke", spec={"stages": [stage]})
    before = _everything_stored()
    _assert_refused(_post(client, "/projects/alpha/suites/smoke/runs", {}, bearer), 400, "validation_failed",
                    "config.checkpoint.folder")
    assert _everything_stored() == before


def test_a_command_payload_with_a_nul_is_refused(client, running_run, bearer):
    run, _ = running_run
    before = _everything_stored()
    for payload in ({"note": NUL}, {NUL: 1}, {"deep": [{"x": NUL}]}):
        response = _post(client, f"/runs/{run.pk}/commands", {"kind": "pause", "payload": payload}, bearer)
        _assert_refused(response, 400, "validation_failed", "payload")
    assert _everything_stored() == before


@pytest.mark.parametrize(("number", "reason"), [
    ("NaN", "NaN is not a JSON number"), ("-Infinity", "-Infinity is not a JSON number"),
    ("1e999", "1e999 is past a float's range"),
])
def test_a_number_json_does_not_have_is_refused_at_the_body(client, running_run, bearer, number, reason):
    """Python's parser takes NaN and Infinity, and no database's JSON column does: they were 500s."""
    run, _ = running_run
    before = _everything_stored()
    for path, body in ((f"/runs/{run.pk}/commands", '{"kind": "pause", "payload": {"x": %s}}'),
                       ("/projects/alpha/experiments", '{"name": "x", "recipe": "sft", "tags": [%s]}')):
        answer = _assert_refused(_post(client, path, body % number, bearer), 400, "validation_failed", "body")
        assert reason in answer["message"], answer
    assert _everything_stored() == before


def test_a_command_payload_integer_no_float_holds_is_refused_at_its_field(client, running_run, bearer):
    run, _ = running_run
    before = _everything_stored()
    response = _post(client, f"/runs/{run.pk}/commands", '{"kind": "pause", "payload": {"x": [%s]}}' % ("9" * 400),
                     bearer)
    answer = _assert_refused(response, 400, "validation_failed", "payload.x.0")
    assert "within a float's range" in answer["message"]
    assert _everything_stored() == before


def test_a_suite_spec_with_a_nul_is_refused(client, team, bearer, grpo_yaml):
    before = _everything_stored()
    stage = {"name": "s", "experiment_id": team.experiment.pk, "config_yaml": grpo_yaml,
             "checks": [{"name": "c", "metric": NUL, "direction": "higher_is_better"}]}
    response = _post(client, "/projects/alpha/suites", {"name": "smoke", "spec": {"stages": [stage]}}, bearer)
    _assert_refused(response, 400, "validation_failed", "spec.stages.0.checks.0.metric")
    response = _post(client, "/projects/alpha/suites", {"name": "smoke", "description": NUL,
                                                         "spec": {"stages": [stage | {"checks": []}]}}, bearer)
    assert response.status_code == 400
    assert _everything_stored() == before


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", ["/projects/alpha/experiments", "/configs/validate", "/projects/alpha/suites"])
def test_a_5000_level_body_is_refused_before_it_is_parsed(client, team, bearer, path):
    before = _everything_stored()
    body = '{"name": ' + _deep(5000) + ', "recipe": "grpo"}'
    response = _post(client, path, body, bearer)
    answer = _assert_refused(response, 400, "validation_failed", "body")
    assert f"deeper than {MAX_JSON_DEPTH}" in answer["message"]
    assert _everything_stored() == before


def test_a_deep_body_to_the_agent_api_is_a_field_error(client, team):
    from forgeboard.cluster.services import agent_token_create

    token = agent_token_create(actor=team.operator, name="rack")[1]
    response = client.post("/api/agent/v1/hosts/register", data='{"hostname": ' + _deep(5000) + "}",
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
    _assert_refused(response, 400, "validation_failed", "body")
    response = client.post("/api/agent/v1/hosts/register", content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {token}",
                           data=json.dumps({"hostname": "h1", "cpu_count": 1, "memory_bytes": 1, "labels": {"a": NUL}}))
    _assert_refused(response, 400, "validation_failed", "labels.a")


def test_invalid_json_is_a_field_error(client, team, bearer):
    _assert_refused(_post(client, "/projects/alpha/experiments", b"{not json", bearer), 400, "validation_failed",
                    "body")


# --- every error from /api/ has the same shape ------------------------------------------------------------------

def _shaped(response, status: int, code: str) -> None:
    assert response.status_code == status
    assert response["Content-Type"].startswith("application/json"), response.content[:300]
    body = response.json()
    assert body["code"] == code and isinstance(body["message"], str) and isinstance(body["errors"], list), body


def test_unknown_api_urls_and_methods_answer_json(client, bearer):
    _shaped(client.get("/api/v1/no-such-thing", **bearer), 404, "not_found")
    _shaped(client.get("/api/nothing-here"), 404, "not_found")
    response = client.delete("/api/v1/projects", **bearer)
    _shaped(response, 405, "method_not_allowed")
    assert "GET" in response["Allow"]
    assert client.get("/no-such-page/").status_code == 404  # pages keep Django's page


def test_a_csrf_failure_answers_json(team):
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(team.member)
    response = browser.post("/api/v1/projects/alpha/experiments", data=json.dumps({"name": "x", "recipe": "grpo"}),
                            content_type="application/json")
    _assert_refused(response, 403, "csrf_failed", "X-CSRFToken")
    assert not Experiment.objects.filter(name="x").exists()


def test_an_unexpected_exception_answers_json_without_a_traceback(client, bearer, monkeypatch):
    from forgeboard.api import public

    def broken():
        raise RuntimeError("secret internals")

    monkeypatch.setattr(public, "hosts_with_devices", broken)  # a fault injected where the view calls out
    response = client.get("/api/v1/hosts", **bearer)
    _shaped(response, 500, "internal_error")
    assert b"secret internals" not in response.content and b"Traceback" not in response.content


@pytest.mark.parametrize(("field", "url", "secret"), [
    ("url", "https://example.com/hook\x00", None),
    ("secret", "https://example.com/hook", "sixteen-chars-ok\x00"),
])
def test_a_webhook_with_a_nul_is_refused_at_its_field(team, field, url, secret):
    from forgeboard.alerts.models import Webhook
    from forgeboard.alerts.services import webhook_create

    with pytest.raises(ValidationFailed) as caught:
        webhook_create(actor=team.owner, project=team.project, url=url, events=["run_failed"], secret=secret)
    assert caught.value.problems[0].field == field and "NUL" in caught.value.message
    assert not Webhook.objects.exists()


# --- a NUL in a URL or a form field names nothing: a 404 for a path, a 400 naming a query parameter, a form's own
# refusal for a field; nothing stored (Postgres refuses a NUL in a query's text parameter: each of these was a 500)

@pytest.mark.parametrize(("method", "url", "status", "field"), [
    ("get", "/api/v1/projects/a%00b", 404, "path"),
    ("get", "/api/v1/runs/1/metrics/a%00b", 404, "path"),
    ("post", "/api/v1/projects/alpha/suites/a%00b/runs", 404, "path"),
    ("delete", "/api/v1/projects/%00/artifacts/x", 404, "path"),
    ("get", "/api/v1/projects/alpha/artifacts?kind=%00", 400, "kind"),
])
def test_a_nul_in_an_api_url_is_refused_naming_where(client, team, bearer, method, url, status, field):
    before = _everything_stored()
    body = {"data": "{}", "content_type": "application/json"} if method == "post" else {}
    response = getattr(client, method)(url, **body, **bearer)
    refused = _assert_refused(response, status, {404: "not_found", 400: "bad_request"}[status], field)
    assert "NUL" in refused["message"]
    assert _everything_stored() == before


def test_a_nul_in_a_page_url_or_a_form_field_is_refused_and_changes_nothing(client, team):
    from forgeboard.accounts.models import ApiToken, Membership
    from forgeboard.cluster.models import Host

    client.force_login(team.owner)
    for url in ("/p/alpha/?q=%00", "/p/alpha/?tag=%00", "/p/alpha/?%00=1"):
        response = client.get(url)
        assert response.status_code == 400 and b"must not contain NUL" in response.content, url
    assert client.get("/p/alpha/suites/%00/").status_code == 404
    stored = (ApiToken.objects.count(), Membership.objects.count(), Host.objects.count())
    token = client.post("/settings/tokens/", {"project": "\x00", "name": "t", "scope": "read"})
    member = client.post("/p/alpha/members/", {"username": "a\x00b", "role": "viewer"}, follow=True)
    assert token.status_code == 404
    assert member.status_code == 200 and any("no active user named" in str(m) for m in member.context["messages"])
    assert client.get("/p/alpha/?q=math").status_code == 200, "a search without one still works"
    client.force_login(team.operator)
    assert client.post("/cluster/", {"hostname": "h\x00", "state": "draining"}).status_code == 404
    assert (ApiToken.objects.count(), Membership.objects.count(), Host.objects.count()) == stored


@pytest.mark.parametrize("name", ["a\x00b", "lone \ud800 surrogate"])
def test_a_name_no_database_can_store_finds_nothing(team, name):
    """Postgres refuses to compare with such a name (a DataError, a 500); the lookups find nothing instead."""
    from forgeboard.accounts.selectors import project_get
    from forgeboard.cluster.models import Host
    from forgeboard.cluster.selectors import host_get
    from forgeboard.errors import NotFound, is_db_text

    Host.objects.create(hostname="gpu-1")
    assert not is_db_text(name) and is_db_text("gpu-1")
    with pytest.raises(NotFound):
        project_get(actor=team.owner, slug=name)
    with pytest.raises(NotFound):
        host_get(hostname=name)
    assert project_get(actor=team.owner, slug="alpha") == team.project and host_get(hostname="gpu-1").hostname == "gpu-1"


def test_a_browser_session_may_label_an_api_body_multipart_without_a_500(team):
    """Its CSRF check reads the body as a form; the JSON parser still finds it (it read an empty stream: a 500)."""
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(team.member)
    browser.get("/settings/tokens/")
    csrf = {"HTTP_X_CSRFTOKEN": browser.cookies["csrftoken"].value}
    body = '{"name": "from-a-form", "scope": "read"}'
    labelled = browser.post("/api/v1/projects/alpha/tokens", data=body, content_type="multipart/form-data; boundary=zz",
                            **csrf)
    assert labelled.status_code == 201 and labelled.json()["name"] == "from-a-form", labelled.content[:300]
    unreadable = browser.post("/api/v1/projects/alpha/tokens", data=body, content_type="multipart/form-data", **csrf)
    _assert_refused(unreadable, 400, "bad_request", "body")


def test_a_page_form_body_that_is_not_multipart_is_a_400(client, team):
    client.force_login(team.owner)
    response = client.post("/settings/tokens/", data="name=t", content_type="multipart/form-data")
    assert response.status_code == 400 and b"not a readable multipart body" in response.content
