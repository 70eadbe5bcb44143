"""POST /api/v1/hosts/{hostname}/intent: operators drain, cordon and restore hosts from their own tooling."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from forgeboard.accounts.models import Role
from forgeboard.accounts.services import api_token_create, membership_set, project_create
from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Host, HostIntent, HostLiveness
from forgeboard.cluster.services import DeviceReport, host_register
from workers.engine.wire_limits import MAX_REQUEST_BYTES

H200 = 141 * 2**30


@pytest.fixture
def host(team) -> Host:
    return host_register(actor=team.operator, hostname="gpu-7.example.com", pool="h200", cpu_count=96,
                         memory_bytes=2**40, devices=[DeviceReport(kind="gpu", index=i, model="NVIDIA H200",
                                                                   memory_bytes=H200) for i in range(2)])


def set_intent(client: Client, hostname: str, body: object, token: str | None = None, **headers: str):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(f"/api/v1/hosts/{hostname}/intent", data=json.dumps(body), content_type="application/json",
                       **auth, **headers)


def intent_entries(host: Host) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action="host.set_intent", target_id=str(host.pk)).order_by("pk"))


def test_an_operator_drains_a_host_and_gets_it_back_as_it_now_is(client, team, host):
    client.force_login(team.operator)
    answer = set_intent(client, host.hostname, {"intent": "draining", "reason": "kernel upgrade"})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["hostname"], body["intent"], body["state"], body["liveness"]) == (
        "gpu-7.example.com", "draining", "draining", "up")
    assert [(d["kind"], d["index"], d["model"]) for d in body["devices"]] == [
        ("gpu", 0, "NVIDIA H200"), ("gpu", 1, "NVIDIA H200")]
    assert body == client.get("/api/v1/hosts").json()[0], "the answer is what GET /hosts now says of it"
    assert Host.objects.get(pk=host.pk).intent == HostIntent.DRAINING
    [entry] = intent_entries(host)
    assert (entry.actor, entry.actor_label, entry.payload) == (
        team.operator, "user:opal", {"from": "schedulable", "to": "draining", "reason": "kernel upgrade"})

    restored = set_intent(client, host.hostname, {"intent": "schedulable"})
    assert restored.status_code == 200 and (restored.json()["intent"], restored.json()["state"]) == ("schedulable", "up")
    assert intent_entries(host)[-1].payload == {"from": "draining", "to": "schedulable", "reason": ""}


def test_the_same_call_twice_answers_the_same_host_and_changes_nothing(client, team, host):
    """A set-state call: a retry (a dropped connection, a script run twice) lands on the same state, so it needs no
    Idempotency-Key; a key sent anyway is not a replay. Each call is in the audit log with its reason."""
    client.force_login(team.operator)
    body = {"intent": "cordoned", "reason": "fan failure"}
    first = set_intent(client, host.hostname, body, HTTP_IDEMPOTENCY_KEY="retry-1")
    second = set_intent(client, host.hostname, body, HTTP_IDEMPOTENCY_KEY="retry-1")
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.json() == second.json() and second.json()["intent"] == "cordoned"
    assert "Idempotent-Replayed" not in second.headers
    assert Host.objects.get(pk=host.pk).intent == HostIntent.CORDONED
    assert [entry.payload for entry in intent_entries(host)] == [
        {"from": "schedulable", "to": "cordoned", "reason": "fan failure"},
        {"from": "cordoned", "to": "cordoned", "reason": "fan failure"}]


def test_a_host_that_is_down_keeps_the_cordon_for_when_it_comes_back(client, team, host):
    Host.objects.filter(pk=host.pk).update(liveness=HostLiveness.DOWN)
    client.force_login(team.operator)
    answer = set_intent(client, host.hostname, {"intent": "cordoned"})
    assert answer.status_code == 200
    assert (answer.json()["state"], answer.json()["liveness"], answer.json()["intent"]) == ("down", "down", "cordoned")
    assert host_register(actor=team.operator, hostname=host.hostname, pool="h200").state == "cordoned"


@pytest.fixture
def tokens(team):
    """A write and a read token of the project's member, the operator's own write token there, and another project's
    write token."""
    membership_set(actor=team.owner, project=team.project, user=team.operator, role=Role.MEMBER)
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    made = {
        "member write": api_token_create(actor=team.member, project=team.project, name="ci-w", scope="write"),
        "member read": api_token_create(actor=team.member, project=team.project, name="ci-r", scope="read"),
        "operator's write": api_token_create(actor=team.operator, project=team.project, name="ops", scope="write"),
        "another project's": api_token_create(actor=team.outsider, project=other, name="beta-ci", scope="write"),
    }
    return {label: raw for label, (_, raw) in made.items()}


@pytest.mark.parametrize("label", ["member write", "member read", "operator's write", "another project's"])
def test_an_api_token_cannot_change_a_host(client, team, host, tokens, label):
    """A token acts in its one project; a host belongs to none: even an operator's own token is refused, and a token
    learns nothing about which host names exist."""
    for hostname in (host.hostname, "no-such-host"):
        answer = set_intent(client, hostname, {"intent": "cordoned", "reason": "r"}, tokens[label])
        assert answer.status_code == 403, answer.content
        assert answer.json() == {"code": "permission_denied", "errors": [], "message": (
            "changing a host's state needs a platform operator's session: an API token acts only in its project")}
    assert Host.objects.get(pk=host.pk).intent == HostIntent.SCHEDULABLE and intent_entries(host) == []


@pytest.mark.parametrize("role", ["owner", "member", "viewer", "outsider"])
def test_people_who_are_not_operators_are_refused(client, team, host, role):
    client.force_login(team.by_role(role))
    for hostname in (host.hostname, "no-such-host"):
        answer = set_intent(client, hostname, {"intent": "draining"})
        assert answer.status_code == 403
        assert answer.json()["message"] == "changing a host's state needs the platform operator role"
    assert Host.objects.get(pk=host.pk).intent == HostIntent.SCHEDULABLE and intent_entries(host) == []


def test_no_credentials_get_401(client, host):
    answer = set_intent(client, host.hostname, {"intent": "draining"})
    assert answer.status_code == 401 and answer.json()["code"] == "unauthenticated"


def test_a_deactivated_operator_is_refused(client, team, host):
    client.force_login(team.operator)
    team.operator.is_active = False
    team.operator.save(update_fields=["is_active"])
    assert set_intent(client, host.hostname, {"intent": "draining"}).status_code == 401  # its session ends with it
    assert Host.objects.get(pk=host.pk).intent == HostIntent.SCHEDULABLE


@pytest.mark.parametrize("hostname", ["gpu-8", "GPU-7.EXAMPLE.COM", "x" * 5000, "%C3%BC%E5%90%8D", "%ED%A0%80",
                                      "gpu-7.example.com%20"])
def test_a_host_that_does_not_exist_is_a_404(client, team, host, hostname):
    """Among them names no database can store (a lone surrogate) and longer than any host's: they find nothing."""
    client.force_login(team.operator)
    answer = set_intent(client, hostname, {"intent": "cordoned"})
    assert answer.status_code == 404, answer.content
    assert answer.json()["code"] == "not_found" and answer.json()["message"].startswith("no host ")
    assert len(answer.json()["message"]) < 300
    assert intent_entries(host) == []


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"intent": "down"}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"intent": "up"}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"intent": "Cordoned"}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"intent": 2}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"intent": None}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"intent": ["cordoned"]}, "intent", "Input should be 'schedulable', 'draining' or 'cordoned'"),
        ({"reason": "r"}, "intent", "Field required"),
        ({"intent": "cordoned", "reason": "fan\x00failure"}, "reason", "Value error, must not contain NUL characters"),
        ({"intent": "cordoned", "reason": "x" * 501}, "reason", "String should have at most 500 characters"),
        ({"intent": "cordoned", "reason": 5}, "reason", "Input should be a valid string"),
        ({"intent": "cordoned", "reason": None}, "reason", "Input should be a valid string"),
        ({"intent": "cordoned", "reason": {"why": "fan"}}, "reason", "Input should be a valid string"),
        ([], "intent", "Field required"),
        ("cordoned", "intent", "Field required"),
    ],
)
def test_a_bad_intent_or_reason_is_a_400_at_its_field(client, team, host, body, field, message):
    client.force_login(team.operator)
    answer = set_intent(client, host.hostname, body)
    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] == "validation_failed"
    assert [e["field"] for e in answer.json()["errors"]] == [field]
    assert answer.json()["errors"][0]["message"] == message
    assert Host.objects.get(pk=host.pk).intent == HostIntent.SCHEDULABLE and intent_entries(host) == []


@pytest.mark.parametrize("raw", [b"", b"{", b'{"intent": "cordoned", "reason": "\\ud800"}', b"\xff\xfe",
                                 b'{"intent": "cordoned"}]]'])
def test_a_body_that_is_not_an_intent_is_a_400(client, team, host, raw):
    client.force_login(team.operator)
    answer = client.post(f"/api/v1/hosts/{host.hostname}/intent", data=raw, content_type="application/json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] == "validation_failed" and answer.json()["errors"][0]["field"] in ("body", "reason")
    assert intent_entries(host) == []


def test_a_body_over_the_limit_is_a_413(client, team, host):
    client.force_login(team.operator)
    answer = set_intent(client, host.hostname, {"intent": "cordoned", "reason": "x" * (MAX_REQUEST_BYTES + 1)})
    assert answer.status_code == 413 and answer.json()["code"] == "payload_too_large"
    assert intent_entries(host) == []


def test_a_reason_is_kept_without_its_surrounding_spaces(client, team, host):
    client.force_login(team.operator)
    assert set_intent(client, host.hostname, {"intent": "cordoned", "reason": "  psu swap \n"}).status_code == 200
    assert intent_entries(host)[0].payload["reason"] == "psu swap"


def test_a_script_with_a_session_sends_the_csrf_token_as_a_browser_does(team, host):
    """Session writes are CSRF-checked: a script that logged in sends the csrftoken cookie back as X-CSRFToken."""
    script = Client(enforce_csrf_checks=True)
    script.force_login(team.operator)
    refused = set_intent(script, host.hostname, {"intent": "cordoned"})
    assert refused.status_code == 403 and "CSRF" in refused.json()["message"]
    assert Host.objects.get(pk=host.pk).intent == HostIntent.SCHEDULABLE
    script.get("/cluster/")
    answer = set_intent(script, host.hostname, {"intent": "cordoned"}, HTTP_X_CSRFTOKEN=script.cookies["csrftoken"].value)
    assert answer.status_code == 200 and answer.json()["intent"] == "cordoned"


def test_the_openapi_document_describes_the_operation(client):
    document = client.get("/api/v1/openapi.json").json()
    operation = document["paths"]["/api/v1/hosts/{hostname}/intent"]["post"]
    assert {"200", "400", "401", "403", "404", "413"} <= set(map(str, operation["responses"]))
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/HostOut")
    assert "operators only" in operation["description"] and "Idempotency-Key" in operation["description"]
    shape = document["components"]["schemas"]["HostIntentIn"]
    assert shape["required"] == ["intent"] and shape["properties"]["intent"]["enum"] == HostIntent.values
    assert shape["properties"]["reason"]["maxLength"] == 500
