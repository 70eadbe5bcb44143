"""Webhook alerts: owners register them, run failures and slow recoveries queue deliveries, a real HTTP
server receives them signed, and a failing endpoint is retried until the delivery records the error."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction

from forgeboard.alerts.models import Webhook, WebhookDelivery
from forgeboard.alerts.services import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    alerts_for_recovery,
    alerts_for_run_state,
    webhook_create,
    webhook_set_active,
)
from forgeboard.audit.models import AuditEvent
from forgeboard.errors import PermissionDenied, ValidationFailed
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch, run_transition
from forgeboard.runs.states import RunState
from tests.support.processes import free_port
from workers.tasks import deliver_alert

SECRET = "s3cret-for-webhook-tests"


@dataclass
class Receiver:
    """A local HTTP endpoint that answers with the scripted status codes (the last one repeats)."""

    url: str
    statuses: list[int]
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver(settings) -> Iterator[Receiver]:
    """The receiver listens on 127.0.0.1, which webhooks reach only with private addresses allowed."""
    settings.WEBHOOK_ALLOW_PRIVATE = True
    server: ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
            status = received.statuses[min(len(received.requests), len(received.statuses)) - 1]
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"nope" if status >= 300 else b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    received = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}/hooks/forgeboard", statuses=[200])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield received
    server.shutdown()
    server.server_close()


@pytest.fixture
def failed_run(team, grpo_yaml) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.FAILED, exit_reason="engine exited with code 1")
    run.refresh_from_db()
    return run


def test_only_owners_add_webhooks_and_the_secret_is_not_audited(team):
    for role in ("member", "viewer", "outsider"):
        with pytest.raises(PermissionDenied):
            webhook_create(actor=team.by_role(role), project=team.project, url="https://example.com/h",
                           events=["run_failed"])
    webhook = webhook_create(actor=team.owner, project=team.project, url=" https://example.com/h ",
                             events=["run_lost", "run_failed", "run_lost"])
    assert webhook.url == "https://example.com/h" and webhook.events == ["run_failed", "run_lost"]
    assert len(webhook.secret) >= 32 and webhook.active
    entry = AuditEvent.objects.get(action="webhook.create")
    assert entry.actor == team.owner and entry.payload == {"url": webhook.url, "events": webhook.events}
    assert webhook.secret not in json.dumps(entry.payload)


@pytest.mark.parametrize(("field_name", "url", "events", "secret"), [
    ("url", "ftp://example.com/hook", ["run_failed"], None),
    ("url", "javascript:alert(1)", ["run_failed"], None),
    ("url", "http://", ["run_failed"], None),
    ("url", "https://exa mple.com/", ["run_failed"], None),
    ("url", "https://user:pw@example.com/", ["run_failed"], None),
    ("url", "", ["run_failed"], None),
    ("url", 42, ["run_failed"], None),
    ("url", "https://example.com/" + "a" * 2000, ["run_failed"], None),
    ("events", "https://example.com/", [], None),
    ("events", "https://example.com/", "run_failed", None),
    ("events", "https://example.com/", ["run_failed", "run_exploded"], None),
    ("secret", "https://example.com/", ["run_failed"], "short"),
])
def test_bad_webhooks_are_refused_naming_the_field(team, field_name, url, events, secret):
    with pytest.raises(ValidationFailed) as raised:
        webhook_create(actor=team.owner, project=team.project, url=url, events=events, secret=secret)
    assert raised.value.problems[0].field == field_name
    assert not Webhook.objects.exists()


def test_a_failed_run_is_posted_signed_to_subscribed_webhooks(team, failed_run, receiver,
                                                              django_capture_on_commit_callbacks):
    subscribed = webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_failed"],
                                secret=SECRET)
    webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_lost"])
    paused = webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_failed"])
    webhook_set_active(actor=team.owner, webhook=paused, active=False)
    assert alerts_for_run_state(run=failed_run, state=RunState.RUNNING) == []
    with django_capture_on_commit_callbacks() as queued:
        deliveries = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    assert [d.webhook_id for d in deliveries] == [subscribed.pk] and len(queued) == 1

    result = deliver_alert.apply(args=[deliveries[0].pk])
    assert result.get() == "done"
    assert len(receiver.requests) == 1
    headers, body = receiver.requests[0]
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers[SIGNATURE_HEADER.lower()], expected)
    assert headers[EVENT_HEADER.lower()] == "run_failed" and headers["content-type"] == "application/json"
    document = json.loads(body)
    assert document["event"] == "run_failed" and document["delivery"] == int(headers[DELIVERY_HEADER.lower()])
    assert document["run"]["id"] == failed_run.pk and document["run"]["project"] == "alpha"
    assert document["run"]["exit_reason"] == "engine exited with code 1"
    delivery = WebhookDelivery.objects.get(pk=deliveries[0].pk)
    assert (delivery.status_code, delivery.attempts, delivery.last_error) == (200, 1, "")
    assert delivery.delivered_at is not None
    deliver_alert.apply(args=[delivery.pk])  # a repeated task (acks_late) does not post twice
    assert len(receiver.requests) == 1


def test_a_failing_endpoint_is_retried_then_the_error_is_recorded(team, failed_run, receiver):
    receiver.statuses = [503]
    webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_failed"], secret=SECRET)
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    assert deliver_alert.apply(args=[delivery.pk]).get() == "given up"
    delivery.refresh_from_db()
    assert delivery.attempts == len(receiver.requests) == 6  # the first try and five retries
    assert delivery.status_code == 503 and delivery.last_error.startswith("HTTP 503")
    assert delivery.delivered_at is None


def test_a_flaky_endpoint_gets_the_delivery_on_a_retry(team, failed_run, receiver):
    receiver.statuses = [500, 502, 204]
    webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_failed"], secret=SECRET)
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    deliver_alert.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.status_code, delivery.last_error) == (3, 204, "")
    assert delivery.delivered_at is not None
    bodies = {body for _, body in receiver.requests}
    assert len(bodies) == 1  # every attempt sends the same signed body


def test_an_unreachable_endpoint_records_the_connection_error(team, failed_run, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    url = f"http://127.0.0.1:{free_port()}/nobody-listens"
    webhook_create(actor=team.owner, project=team.project, url=url, events=["run_lost"])
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.LOST)
    deliver_alert.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.event == "run_lost" and delivery.attempts == 6 and delivery.status_code is None
    assert "ConnectError" in delivery.last_error


def test_slow_drill_recovery_alerts_only_past_the_threshold(team, failed_run, receiver):
    webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["drill_recovery_slow"],
                   secret=SECRET)
    assert alerts_for_run_state(run=failed_run, state=RunState.FAILED) == []
    assert alerts_for_recovery(run=failed_run, recovery_s=29.5, threshold_s=30) == []
    [delivery] = alerts_for_recovery(run=failed_run, recovery_s=42.0, threshold_s=30)
    assert delivery.payload["recovery_s"] == 42.0 and delivery.payload["threshold_s"] == 30
    deliver_alert.apply(args=[delivery.pk])
    assert json.loads(receiver.requests[0][1])["event"] == "drill_recovery_slow"
    for name, kwargs in (("recovery_s", {"recovery_s": float("nan"), "threshold_s": 1}),
                         ("threshold_s", {"recovery_s": 1, "threshold_s": -1}),
                         ("recovery_s", {"recovery_s": "12", "threshold_s": 1})):
        with pytest.raises(ValidationFailed) as raised:
            alerts_for_recovery(run=failed_run, **kwargs)
        assert raised.value.problems[0].field == name
    assert WebhookDelivery.objects.count() == 1


def test_run_transitions_to_failed_or_lost_queue_alerts_with_the_state_change(team, grpo_yaml, receiver,
                                                                              django_capture_on_commit_callbacks):
    webhook_create(actor=team.owner, project=team.project, url=receiver.url, events=["run_failed", "run_lost"])
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    with pytest.raises(RuntimeError), transaction.atomic():
        run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.FAILED, reason="boom")
        raise RuntimeError("the caller's transaction rolls back")
    assert not WebhookDelivery.objects.exists()
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="no heartbeat")
    with django_capture_on_commit_callbacks() as queued:
        run_transition(run_id=run.pk, from_state=RunState.LOST, to_state=RunState.FAILED, reason="gave up")
    deliveries = WebhookDelivery.objects.order_by("pk")
    assert [(d.event, d.payload["run"]["state"], d.payload["run"]["exit_reason"]) for d in deliveries] == [
        ("run_lost", "lost", "no heartbeat"), ("run_failed", "failed", "gave up")]
    assert len(queued) == 2  # the run.update publish and the delivery's task, both after commit


def test_a_slow_recovery_reported_by_a_run_queues_an_alert(team, running_run, settings):
    from forgeboard.telemetry.ingest import telemetry_ingest
    from workers.engine.telemetry_wire import TelemetryBatch

    settings.RECOVERY_ALERT_S = 10
    run, _ = running_run
    webhook_create(actor=team.owner, project=team.project, url="https://hooks.example.com/x",
                   events=["drill_recovery_slow"])
    events = [{"kind": "recovered", "time": 1.7e9, "payload": {"role": "generator", "time_to_recover_s": s}}
              for s in (2.5, 12.0, "soon")]
    telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate({"seq": 1, "events": events})])
    [delivery] = WebhookDelivery.objects.filter(event="drill_recovery_slow")
    assert delivery.payload["recovery_s"] == 12.0 and delivery.payload["threshold_s"] == 10.0


# --- only public destinations (SSRF guard) ---------------------------------------------------------------

def _resolving(monkeypatch, table: dict[str, list[str]]) -> None:
    """Make the webhook code resolve names from `table` (unknown names do not resolve)."""
    def fake(host, port, type=0):  # noqa: A002 - getaddrinfo's own parameter name
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in table[host]]
    monkeypatch.setattr("forgeboard.alerts.services._getaddrinfo", fake)


@pytest.mark.parametrize(("url", "kind"), [
    ("http://localhost/hook", "loopback"),
    ("http://127.0.0.1:8000/hook", "loopback"),
    ("http://0.0.0.0/hook", "unspecified"),
    ("http://[::1]/hook", "loopback"),
    ("http://[::]/hook", "unspecified"),
    ("http://[::ffff:127.0.0.1]/hook", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[fe80::1]/hook", "link-local"),
    ("https://10.1.2.3/hook", "private"),
    ("https://192.168.0.10/hook", "private"),
    ("https://172.16.5.4/hook", "private"),
    ("https://[fd00::1]/hook", "private"),
    ("http://224.0.0.1/hook", "multicast"),
    ("http://[ff02::1]/hook", "multicast"),
    ("http://240.0.0.1/hook", "reserved"),
    ("http://100.64.0.1/hook", "non-public"),
])
def test_webhooks_to_non_public_addresses_are_refused_on_the_url(team, settings, url, kind):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(ValidationFailed) as raised:
        webhook_create(actor=team.owner, project=team.project, url=url, events=["run_failed"])
    assert raised.value.problems[0].field == "url"
    assert f"is a {kind} address: webhooks reach public hosts only" in raised.value.problems[0].message
    assert not Webhook.objects.exists()


def test_a_name_resolving_to_a_private_address_is_refused_naming_it(team, settings, monkeypatch):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    _resolving(monkeypatch, {"intranet.example.com": ["93.184.215.14", "10.0.0.7"]})
    with pytest.raises(ValidationFailed) as raised:
        webhook_create(actor=team.owner, project=team.project, url="https://intranet.example.com/h",
                       events=["run_failed"])
    assert raised.value.problems[0].field == "url"
    assert raised.value.problems[0].message == (
        "intranet.example.com resolves to 10.0.0.7, which is a private address: webhooks reach public hosts only")


@pytest.mark.parametrize("host", ["2130706433", "0x7f000001", "0x7f.1", "127.1", "017700000001"])
def test_numeric_forms_of_loopback_are_seen_through(host):
    """Forms a URL validator may reject or miss; the resolver reads them as 127.0.0.1."""
    from forgeboard.alerts.services import UnsafeDestination, public_addresses

    with pytest.raises(UnsafeDestination, match="resolves to 127.0.0.1, which is a loopback address"):
        public_addresses(host, 80)


def test_public_addresses_pass_and_unresolvable_names_wait_for_delivery(team, settings, monkeypatch):
    from forgeboard.alerts.services import public_addresses

    settings.WEBHOOK_ALLOW_PRIVATE = False
    _resolving(monkeypatch, {"hooks.example.com": ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"]})
    assert public_addresses("hooks.example.com", 443) == ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"]
    ok = webhook_create(actor=team.owner, project=team.project, url="https://hooks.example.com/h", events=["run_lost"])
    later = webhook_create(actor=team.owner, project=team.project, url="https://not-yet.example.org/h",
                           events=["run_lost"])
    assert [ok.url, later.url] == ["https://hooks.example.com/h", "https://not-yet.example.org/h"]


def test_private_addresses_are_allowed_when_the_setting_says_so(team, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    webhook = webhook_create(actor=team.owner, project=team.project, url="http://10.0.0.7:9000/h",
                             events=["run_failed"])
    assert webhook.url == "http://10.0.0.7:9000/h"


def test_a_name_that_now_resolves_privately_fails_the_delivery_with_the_reason(team, failed_run, receiver,
                                                                              settings, monkeypatch):
    """DNS rebinding: public when registered, loopback when delivered; nothing reaches the loopback receiver."""
    settings.WEBHOOK_ALLOW_PRIVATE = False
    port = receiver.url.split(":")[2].split("/")[0]
    _resolving(monkeypatch, {"hooks.example.com": ["93.184.215.14"]})
    webhook_create(actor=team.owner, project=team.project, url=f"http://hooks.example.com:{port}/hooks/forgeboard",
                   events=["run_failed"])
    _resolving(monkeypatch, {"hooks.example.com": ["127.0.0.1"]})
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    deliver_alert.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert receiver.requests == []
    assert delivery.delivered_at is None and delivery.status_code is None and delivery.attempts == 6
    assert delivery.last_error == ("refused: hooks.example.com resolves to 127.0.0.1, which is a loopback address: "
                                   "webhooks reach public hosts only")


def test_a_delivery_connects_to_the_address_it_checked_keeping_the_host_name(team, failed_run, receiver,
                                                                           settings, monkeypatch):
    """The checked address is the one connected to (no second lookup); the Host header keeps the name."""
    from forgeboard.alerts import services

    settings.WEBHOOK_ALLOW_PRIVATE = False
    port = receiver.url.split(":")[2].split("/")[0]
    # The receiver is on 127.0.0.1: this test treats loopback as public to reach it through the pinned path.
    monkeypatch.setattr(services, "_non_public", lambda ip: None)
    _resolving(monkeypatch, {"hooks.example.com": ["127.0.0.1"]})
    webhook_create(actor=team.owner, project=team.project, url=f"http://hooks.example.com:{port}/hooks/forgeboard",
                   events=["run_failed"], secret=SECRET)
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    deliver_alert.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.delivered_at is not None and delivery.status_code == 200
    [(headers, _body)] = receiver.requests
    assert headers["host"] == f"hooks.example.com:{port}"


@pytest.mark.parametrize("url", ["http://2130706433/hook", "http://0x7f000001/hook", "http://0x7f.1/hook",
                                 "http://127.1/hook", "http://[::ffff:7f00:1]/hook"])
def test_numeric_forms_of_loopback_urls_are_refused_on_the_url(team, settings, url):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(ValidationFailed) as raised:
        webhook_create(actor=team.owner, project=team.project, url=url, events=["run_failed"])
    assert raised.value.problems[0].field == "url"
    assert not Webhook.objects.exists()


def test_a_webhook_stored_before_the_guard_is_refused_at_delivery(team, failed_run, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    Webhook.objects.create(project=team.project, url="http://2130706433:9/x", events=["run_failed"], secret=SECRET)
    [delivery] = alerts_for_run_state(run=failed_run, state=RunState.FAILED)
    deliver_alert.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.delivered_at is None and delivery.status_code is None
    assert delivery.last_error == ("refused: 2130706433 resolves to 127.0.0.1, which is a loopback address: "
                                   "webhooks reach public hosts only")
