"""Webhook alerts: owners register them, run failures and slow recoveries queue deliveries, a real HTTP
server receives them signed, and a failing endpoint is retried until the delivery records the error."""

from __future__ import annotations

import hashlib
import hmac
import json
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
def receiver() -> Iterator[Receiver]:
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


def test_an_unreachable_endpoint_records_the_connection_error(team, failed_run):
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
