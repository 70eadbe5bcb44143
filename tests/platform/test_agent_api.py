"""The node agent API: agent tokens, register and heartbeat, strict bodies, and the agent talking to it."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from django.test import Client
from django.urls import include, path

from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import AgentToken, Device, Health, Host, HostLiveness
from forgeboard.cluster.services import (
    DeviceReport,
    agent_token_authenticate,
    agent_token_create,
    agent_token_revoke,
    host_register,
)
from forgeboard.errors import AlreadyExists, Conflict, FieldProblem, PermissionDenied
from tests.support.races import racing_an_open_transaction
from tests.workers.fake_nvml import FakeNvml
from workers import agent

# The project URLconf includes these the same way: path("api/agent/", include("forgeboard.cluster.urls")).
urlpatterns = [path("api/agent/", include("forgeboard.cluster.urls"))]
pytestmark = pytest.mark.urls(__name__)

REGISTER = "/api/agent/v1/hosts/register"
HEARTBEAT = "/api/agent/v1/hosts/heartbeat"
H200_BYTES = 150_754_820_096


@pytest.fixture
def raw_token(team) -> str:
    return agent_token_create(actor=team.operator, name="rack-a1")[1]


def _post(client: Client, url: str, body, token: str | None, **extra) -> tuple[int, dict]:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = client.post(url, data=data, content_type="application/json", **headers, **extra)
    return response.status_code, response.json()


def _register_body(**overrides) -> dict:
    gpus = [{"kind": "gpu", "index": i, "model": "NVIDIA H200", "memory_bytes": H200_BYTES, "uuid": f"GPU-{i}"}
            for i in range(8)]
    return {"hostname": "gpu-001", "pool": "h200", "labels": {"rack": "a1"}, "cpu_count": 192,
            "memory_bytes": 2 * 2**40, "agent_version": "0.1.0", "devices": gpus} | overrides


# --- tokens -----------------------------------------------------------------------------------

def test_only_operators_create_agent_tokens(team):
    for user in (team.owner, team.member, team.outsider):
        with pytest.raises(PermissionDenied, match="operator"):
            agent_token_create(actor=user, name="x")
    token, raw = agent_token_create(actor=team.operator, name="  rack-a1 ")
    assert raw.startswith(f"fba_{token.prefix}_") and token.name == "rack-a1"
    assert raw not in (token.token_hash, token.prefix) and len(token.token_hash) == 64
    entry = AuditEvent.objects.get(action="agent_token.create")
    assert entry.actor_label == "user:opal" and entry.payload == {"name": "rack-a1", "prefix": token.prefix}
    with pytest.raises(AlreadyExists) as caught:
        agent_token_create(actor=team.operator, name="rack-a1")
    assert caught.value.problems[0].field == "name"


def test_token_authentication_and_revocation(team, raw_token):
    token = agent_token_authenticate(raw=raw_token)
    assert token is not None and token.last_used_at is not None
    assert agent_token_authenticate(raw=raw_token[:-1] + ("A" if raw_token[-1] != "A" else "B")) is None
    assert agent_token_authenticate(raw=raw_token.replace("fba_", "fb_", 1)) is None
    with pytest.raises(PermissionDenied):
        agent_token_revoke(actor=team.member, token=token)
    agent_token_revoke(actor=team.operator, token=token)
    assert agent_token_authenticate(raw=raw_token) is None
    assert AuditEvent.objects.filter(action="agent_token.revoke", actor_label="user:opal").count() == 1


# --- register and heartbeat ---------------------------------------------------------------------

def test_register_creates_the_host_with_its_gpus(client, raw_token):
    status, answer = _post(client, REGISTER, _register_body(cpu_utilization=12.5), raw_token)
    assert status == 200, answer
    assert answer == {"hostname": "gpu-001", "state": "up", "liveness": "up", "intent": "schedulable",
                      "health": "healthy", "devices": 8}
    host = Host.objects.get(hostname="gpu-001")
    assert (host.pool, host.cpu_count, host.agent_version, host.cpu_utilization) == ("h200", 192, "0.1.0", 12.5)
    assert host.devices.filter(kind="gpu", model="NVIDIA H200", memory_bytes=H200_BYTES).count() == 8
    entry = AuditEvent.objects.get(action="host.register")
    token = AgentToken.objects.get()
    assert entry.actor_label == "system" and entry.payload["agent_token"] == token.prefix


def test_heartbeat_updates_utilization_health_and_devices(client, raw_token):
    _post(client, REGISTER, _register_body(), raw_token)
    before = Host.objects.get().last_heartbeat_at
    audited = AuditEvent.objects.count()
    beat = {"hostname": "gpu-001", "cpu_utilization": 63.0, "memory_utilization": 41.0,
            "devices": [{"kind": "gpu", "index": 3, "utilization": 99.0, "memory_used_bytes": 90 * 2**30,
                         "health": "degraded"}]}
    status, answer = _post(client, HEARTBEAT, beat, raw_token)
    assert status == 200, answer
    assert answer == {"hostname": "gpu-001", "state": "up", "liveness": "up", "intent": "schedulable",
                      "health": "degraded"}
    host = Host.objects.get()
    assert (host.cpu_utilization, host.memory_utilization) == (63.0, 41.0) and host.last_heartbeat_at > before
    gpu3 = Device.objects.get(host=host, index=3)
    assert (gpu3.utilization, gpu3.memory_used_bytes, gpu3.health) == (99.0, 90 * 2**30, "degraded")
    assert AuditEvent.objects.count() == audited  # heartbeats are not audited; state changes are


def test_heartbeat_brings_a_down_host_back_up(client, raw_token):
    _post(client, REGISTER, _register_body(devices=[]), raw_token)
    Host.objects.update(liveness=HostLiveness.DOWN, health=Health.UNHEALTHY)
    status, answer = _post(client, HEARTBEAT, {"hostname": "gpu-001", "cpu_utilization": 1.0,
                                               "memory_utilization": 2.0}, raw_token)
    assert status == 200 and answer["state"] == answer["liveness"] == "up" and answer["health"] == "healthy"
    assert AuditEvent.objects.get(action="host.up").payload["reason"] == "heartbeat resumed"


def test_heartbeat_for_unknown_host_or_device_asks_to_register(client, raw_token):
    beat = {"hostname": "gpu-404", "cpu_utilization": 1.0, "memory_utilization": 1.0}
    status, answer = _post(client, HEARTBEAT, beat, raw_token)
    assert status == 404 and answer["code"] == "not_found" and "register" in answer["message"]
    _post(client, REGISTER, _register_body(), raw_token)
    beat = beat | {"hostname": "gpu-001", "devices": [{"kind": "gpu", "index": 8}]}
    status, answer = _post(client, HEARTBEAT, beat, raw_token)
    assert status == 409 and answer["code"] == "conflict" and "gpu8" in answer["message"]


def test_an_agent_token_reports_only_for_the_hosts_it_registered(client, team, raw_token):
    """A second token (leaked, or a misconfigured agent) cannot empty, move or speak for a host another live token
    registered; once an operator revokes the first token, the next one to register the host takes it over."""
    _post(client, REGISTER, _register_body(), raw_token)
    other_token, other = agent_token_create(actor=team.operator, name="rack-b2")
    status, answer = _post(client, REGISTER, _register_body(devices=[], pool="evil"), other)
    assert status == 409 and answer["errors"] == [{"field": "hostname", "message": "reported by agent token 'rack-a1'"}]
    assert "an operator revokes that token" in answer["message"]
    beat = {"hostname": "gpu-001", "cpu_utilization": 99.0, "memory_utilization": 99.0}
    assert _post(client, HEARTBEAT, beat, other)[0] == 409
    host = Host.objects.get()
    assert (host.pool, host.devices.count(), host.cpu_utilization) == ("h200", 8, None)
    assert _post(client, HEARTBEAT, beat, raw_token)[0] == 200  # its own token goes on
    # A host of its own is fine for the second token, and an operator's own edits are not refused.
    assert _post(client, REGISTER, _register_body(hostname="gpu-002"), other)[0] == 200

    agent_token_revoke(actor=team.operator, token=AgentToken.objects.get(name="rack-a1"))
    status, answer = _post(client, HEARTBEAT, beat, other)
    assert status == 409 and "register it with this token to take it over" in answer["message"]
    assert _post(client, REGISTER, _register_body(pool="h200-b"), other)[0] == 200
    assert Host.objects.get(hostname="gpu-001").agent_token == other_token
    assert _post(client, HEARTBEAT, beat, other)[0] == 200


@pytest.mark.django_db(transaction=True)
def test_two_tokens_registering_one_new_host_at_once_leave_it_to_the_first(team):
    """Both saw no host and checked no owner: the second waited for the first's insert, then wrote over its pool,
    devices and token (a takeover the 409 above refuses). Now it is refused as if it had come a moment later."""
    first = agent_token_create(actor=team.operator, name="rack-a1")[0]
    second = agent_token_create(actor=team.operator, name="rack-b2")[0]
    gpu = [DeviceReport(kind="gpu", index=0, model="NVIDIA H200", memory_bytes=H200_BYTES)]
    outcome = racing_an_open_transaction(
        lambda: host_register(actor=first, hostname="gpu-001", pool="h200", devices=gpu),
        lambda: host_register(actor=second, hostname="gpu-001", pool="evil"))
    assert isinstance(outcome, Conflict), outcome
    assert outcome.problems == [FieldProblem("hostname", "reported by agent token 'rack-a1'")]
    host = Host.objects.get()
    assert (host.agent_token, host.pool, host.devices.count()) == (first, "h200", 1)


def test_an_agent_whose_host_another_token_reports_stops_with_the_reason(client, team, raw_token, caplog):
    def node(token: str) -> agent.Agent:
        http = httpx.Client(base_url="http://testserver", transport=_django_transport(client),
                            headers={"Authorization": f"Bearer {token}"})
        collector = agent.Collector(nvml=FakeNvml(), hostname="gpu-node-07")
        return agent.Agent(plane=agent.ControlPlane(http), collect=collector.collect, sleep=lambda s: None)

    assert node(raw_token).run(max_reports=1) == agent.EXIT_OK
    _, other = agent_token_create(actor=team.operator, name="rack-b2")
    assert node(other).run(max_reports=1) == agent.EXIT_REFUSED
    assert "HTTP 409" in caplog.text and "is reported by agent token 'rack-a1'" in caplog.text


# --- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, "Bearer", "Basic abc", "Bearer fba_000000000000_nope", "Bearer fb_x_y",
                                    "Bearer fba_00000000000\x00_nope", "Bearer fba_ABCDEF000000_nope"])
def test_missing_or_wrong_tokens_get_401(client, team, header):
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    response = client.post(REGISTER, data=json.dumps(_register_body()), content_type="application/json", **extra)
    assert response.status_code == 401 and response.json()["code"] == "unauthenticated"
    assert not Host.objects.exists()


def test_revoked_token_gets_401(client, team, raw_token):
    agent_token_revoke(actor=team.operator, token=AgentToken.objects.get())
    status, answer = _post(client, REGISTER, _register_body(), raw_token)
    assert status == 401 and "revoked" in answer["message"]


def test_project_api_tokens_are_not_agent_tokens(client, team):
    from forgeboard.accounts.services import api_token_create

    _, raw = api_token_create(actor=team.owner, project=team.project, name="ci", scope="write")
    status, _ = _post(client, REGISTER, _register_body(), raw)
    assert status == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cpu_count": True}, "cpu_count"),
        ({"cpu_count": -1}, "cpu_count"),
        ({"memory_bytes": 2**63}, "memory_bytes"),
        ({"memory_bytes": "lots"}, "memory_bytes"),
        ({"hostname": "has space"}, "hostname"),
        ({"hostname": ""}, "hostname"),
        ({"pool": "H200 pool"}, "pool"),
        ({"labels": {"rack": 3}}, "labels.rack"),
        ({"cpu_utilization": 101}, "cpu_utilization"),
        ({"surprise": 1}, "surprise"),
        ({"devices": [{"kind": "tpu", "index": 0, "model": "v5"}]}, "devices[0].kind"),
        ({"devices": [{"kind": "gpu", "index": -1, "model": "H200"}]}, "devices[0].index"),
        ({"devices": [{"kind": "gpu", "index": 0, "model": "H200", "health": "great"}]}, "devices[0].health"),
        ({"devices": [{"kind": "gpu", "index": 0, "model": "a"}, {"kind": "gpu", "index": 0, "model": "b"}]},
         "devices[1].index"),
    ],
)
def test_bad_register_bodies_get_400_with_the_field(client, raw_token, body, field):
    status, answer = _post(client, REGISTER, _register_body(**body), raw_token)
    assert status == 400, answer
    assert answer["code"] == "validation_failed" and field in [e["field"] for e in answer["errors"]]
    assert answer["message"] and not Host.objects.exists()


@pytest.mark.parametrize(
    ("raw", "field"),
    [("{not json", "body"), ("[1, 2]", "body"), ('{"hostname": "gpu-001"}', "cpu_count"),
     ('{"hostname": "a", "cpu_count": 1, "memory_bytes": 1, "cpu_utilization": NaN}', "cpu_utilization")],
)
def test_malformed_bodies_get_400(client, raw_token, raw, field):
    status, answer = _post(client, REGISTER, raw, raw_token)
    assert status == 400 and answer["code"] == "validation_failed"
    assert field in [e["field"] for e in answer["errors"]]


def test_heartbeat_body_is_strict_too(client, raw_token):
    _post(client, REGISTER, _register_body(), raw_token)
    status, answer = _post(client, HEARTBEAT, {"hostname": "gpu-001", "cpu_utilization": "high",
                                               "memory_utilization": None}, raw_token)
    assert status == 400
    assert answer["errors"] == [{"field": "cpu_utilization", "message": "Input should be a valid number"}]


def test_bodies_over_256_kib_get_413(client, raw_token):
    body = json.dumps(_register_body(labels={"pad": "x" * 200})) + " " * (256 * 1024)
    status, answer = _post(client, REGISTER, body, raw_token)
    assert status == 413 and answer["code"] == "payload_too_large"
    assert not Host.objects.exists()


def test_only_post_json(client, raw_token):
    response = client.get(REGISTER, HTTP_AUTHORIZATION=f"Bearer {raw_token}")
    assert response.status_code == 405 and response["Allow"] == "POST"
    response = client.post(REGISTER, data="hostname=x", content_type="application/x-www-form-urlencoded",
                           HTTP_AUTHORIZATION=f"Bearer {raw_token}")
    assert response.status_code == 415


# --- the real agent against these views -----------------------------------------------------------

def _django_transport(client: Client) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        response = client.post(request.url.path, data=request.content, content_type="application/json",
                               HTTP_AUTHORIZATION=request.headers["Authorization"])
        return httpx.Response(response.status_code, content=response.content,
                              headers={"Content-Type": response["Content-Type"]})

    return httpx.MockTransport(handle)


def test_agent_registers_and_heartbeats_against_the_control_plane(client, raw_token):
    nvml = FakeNvml()
    http = httpx.Client(base_url="http://testserver", transport=_django_transport(client),
                        headers={"Authorization": f"Bearer {raw_token}"})
    collector = agent.Collector(nvml=nvml, hostname="gpu-node-07")
    node = agent.Agent(plane=agent.ControlPlane(http), collect=collector.collect, pool="h200",
                       labels={"rack": "b2"}, backoff=agent.Backoff(rng=random.Random(0)), sleep=lambda s: None)
    assert node.run(max_reports=1) == agent.EXIT_OK
    host = Host.objects.get(hostname="gpu-node-07")
    assert host.labels == {"rack": "b2"} and host.agent_version == agent.AGENT_VERSION
    assert host.devices.count() == 8 and host.health == "healthy"

    nvml.gpus[4] |= {"ecc_uncorrected_volatile": 1, "utilization_gpu": 12}
    assert node.run(max_reports=1) == agent.EXIT_OK
    host.refresh_from_db()
    assert host.health == "unhealthy"
    gpu4 = host.devices.get(index=4)
    assert (gpu4.health, gpu4.utilization) == ("unhealthy", 12.0)

    Host.objects.filter(pk=host.pk).delete()  # the control plane forgets the host: the agent registers again
    assert node.run(max_reports=1) == agent.EXIT_OK
    assert Host.objects.get(hostname="gpu-node-07").devices.count() == 8


def test_agent_token_command_creates_a_usable_token_and_revokes_it(team, tmp_path):
    from io import StringIO

    from django.core.management import CommandError, call_command

    out = tmp_path / "agent.token"
    call_command("agent_token", "create", "rack-c3", "--operator", "opal", "--out", str(out), stdout=StringIO())
    assert out.stat().st_mode & 0o777 == 0o600
    token = agent_token_authenticate(raw=out.read_text().strip())
    assert token is not None and token.name == "rack-c3"
    with pytest.raises(CommandError, match="operator role"):
        call_command("agent_token", "create", "rack-c4", "--operator", "mateo", stdout=StringIO())
    call_command("agent_token", "revoke", "rack-c3", "--operator", "opal", stdout=StringIO())
    assert agent_token_authenticate(raw=out.read_text().strip()) is None


def test_a_second_revoke_of_an_agent_token_loaded_before_the_first_changes_nothing(team):
    token, _ = agent_token_create(actor=team.operator, name="rack-a1")
    first, second = AgentToken.objects.get(pk=token.pk), AgentToken.objects.get(pk=token.pk)
    agent_token_revoke(actor=team.operator, token=first)
    revoked_at = AgentToken.objects.get(pk=token.pk).revoked_at
    assert agent_token_revoke(actor=team.operator, token=second).revoked_at == revoked_at
    assert AgentToken.objects.get(pk=token.pk).revoked_at == revoked_at
    assert AuditEvent.objects.filter(action="agent_token.revoke", target_id=str(token.pk)).count() == 1
