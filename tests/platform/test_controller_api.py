"""The controller's HTTP channel: telemetry batches exactly once and in order; commands at least once."""

from __future__ import annotations

import json

import pytest

from forgeboard.accounts.services import api_token_create
from forgeboard.runs.models import Command, Run
from forgeboard.runs.services import command_create, run_launch
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_issue
from forgeboard.telemetry.models import LogLine, MetricPoint, RunEvent
from workers.engine.telemetry_wire import MAX_REQUEST_BYTES


def batch(seq: int, *, points: int = 3, events: int = 1) -> dict:
    return {
        "seq": seq,
        "metrics": [{"key": "loss", "step": seq * 100 + i, "value": 1.0 / (i + 1), "time": 1.7e9 + i}
                    for i in range(points)],
        "events": [{"kind": "message", "payload": {"batch": seq, "i": i}, "time": 1.7e9} for i in range(events)],
        "logs": [{"line": f"log {seq}", "time": 1.7e9}],
    }


def post(client, run, token, body, **extra):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", data=data, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {token}", **extra)


def stored(run) -> tuple[int, int, int]:
    return (MetricPoint.objects.filter(series__run=run).count(),
            RunEvent.objects.filter(run=run, kind="message").count(), LogLine.objects.filter(run=run).count())


def test_batches_apply_in_order_exactly_once(client, running_run):
    run, token = running_run
    response = post(client, run, token, {"batches": [batch(1), batch(2)]})
    assert response.status_code == 200, response.content
    assert response.json() == {"applied_seq": 2, "duplicates": 0, "pending_commands": []}
    assert stored(run) == (6, 2, 2)
    again = post(client, run, token, {"batches": [batch(3), batch(2), batch(1)]})
    assert again.json()["applied_seq"] == 3 and again.json()["duplicates"] == 2
    assert stored(run) == (9, 3, 3)
    run.refresh_from_db()
    assert run.telemetry_seq == 3 and run.last_heartbeat_at is not None
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1)), "event sequence numbers stay dense across services and ingest"


@pytest.mark.parametrize(("backend", "after"), [("slurm", RunState.RUNNING), ("kubernetes", RunState.RUNNING),
                                                ("local", RunState.LAUNCHING)])
def test_a_cluster_runs_first_report_marks_it_running(client, running_run, backend, after):
    """Nothing else tells the platform a scheduler started the job; a local run's supervisor says so itself."""
    run, token = running_run
    Run.objects.filter(pk=run.pk).update(state=RunState.LAUNCHING, backend=backend)
    assert post(client, run, token, {"batches": []}).status_code == 200
    run.refresh_from_db()
    assert run.state == after
    assert (run.started_at is not None) == (after == RunState.RUNNING)


def test_a_gap_is_refused_with_the_sequence_to_resend_from(client, running_run):
    run, token = running_run
    post(client, run, token, {"batches": [batch(1)]})
    response = post(client, run, token, {"batches": [batch(3)]})
    assert response.status_code == 409
    body = response.json()
    assert body["code"] == "sequence_gap" and body["expected_seq"] == 2
    assert stored(run) == (3, 1, 1)


def test_empty_request_is_a_heartbeat_that_lists_pending_commands(client, running_run, team):
    run, token = running_run
    command = command_create(actor=team.member, run=run, kind="checkpoint")
    response = post(client, run, token, {"batches": []})
    assert response.json()["pending_commands"] == [command.pk]
    assert Run.objects.get(pk=run.pk).last_heartbeat_at is not None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("{not json", "body"),
        ({"batches": [batch(1) | {"seq": 0}]}, "batches.0.seq"),
        ({"batches": [batch(1) | {"metrics": [{"key": "x", "step": -1, "value": 1.0, "time": 1.0}]}]},
         "batches.0.metrics.0.step"),
        ({"batches": [batch(1) | {"events": [{"kind": "explode", "time": 1.0}]}]}, "batches.0.events.0.kind"),
        ({"batches": [batch(1) | {"extra": 1}]}, "batches.0.extra"),
        ({"batches": [batch(1) | {"logs": [{"line": "x" * 9000, "time": 1.0}]}]}, "batches.0.logs.0.line"),
        ({"batches": "nope"}, "batches"),
        ({"batches": [batch(1) | {"metrics": [{"key": "k" * 201, "step": 1, "value": 1.0, "time": 1.0}]}]},
         "batches.0.metrics.0.key"),
        ({"batches": [batch(1) | {"metrics": [{"key": "", "step": 1, "value": 1.0, "time": 1.0}]}]},
         "batches.0.metrics.0.key"),
        ({"batches": [batch(1) | {"metrics": [{"key": "k", "step": 2**63, "value": 1.0, "time": 1.0}]}]},
         "batches.0.metrics.0.step"),
        ('{"batches": [{"seq": 1, "metrics": [{"key": "k", "step": 1, "value": 1.0, "time": NaN}]}]}',
         "batches.0.metrics.0.time"),
        ({"batches": [batch(1) | {"metrics": [{"key": "k", "step": True, "value": 1.0, "time": 1.0}]}]},
         "batches.0.metrics.0.step"),
        ({"batches": [batch(1) | {"metrics": [{"key": "k", "step": 1, "value": "2", "time": 1.0}]}]},
         "batches.0.metrics.0.value"),
        ({"batches": [batch(1) | {"metrics": [{"key": "k", "step": 1, "value": False, "time": 1.0}]}]},
         "batches.0.metrics.0.value"),
        ({"batches": [batch(1) | {"seq": "1"}]}, "batches.0.seq"),
    ],
)
def test_malformed_batches_are_refused_and_nothing_is_stored(client, running_run, body, field):
    run, token = running_run
    response = post(client, run, token, body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "validation_failed"
    assert field in [e["field"] for e in response.json()["errors"]]
    assert stored(run) == (0, 0, 0)
    assert Run.objects.get(pk=run.pk).telemetry_seq == 0


def test_oversized_payload_is_refused(client, running_run):
    run, token = running_run
    response = post(client, run, token, {"batches": []}, CONTENT_LENGTH=str(MAX_REQUEST_BYTES + 1))
    assert response.status_code == 413 and response.json()["code"] == "payload_too_large"


def test_wrong_tokens_are_refused(client, running_run, team, grpo_yaml):
    run, token = running_run
    other = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    other_token = run_token_issue(run=other)
    assert post(client, run, other_token, {"batches": [batch(1)]}).status_code == 403
    assert post(client, run, "fbr_000000000000_nope", {"batches": [batch(1)]}).status_code == 401
    _, api_token = api_token_create(actor=team.member, project=team.project, name="ci", scope="write")
    assert post(client, run, api_token, {"batches": [batch(1)]}).status_code == 401
    assert client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", data="{}", content_type="application/json").status_code == 401
    fresh = run_token_issue(run=run)  # a restarted controller gets a new token; the old one stops working
    assert post(client, run, token, {"batches": [batch(1)]}).status_code == 401
    assert post(client, run, fresh, {"batches": [batch(1)]}).status_code == 200
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)
    assert post(client, run, fresh, {"batches": [batch(2)]}).status_code == 401
    assert stored(run) == (3, 1, 1)


def test_commands_are_pulled_acknowledged_and_finished_once(client, monarch_running_run, team):
    run, token = monarch_running_run
    command = command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "generator"})
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    pulled = client.get(f"/api/v1/controller/runs/{run.pk}/commands", **auth).json()
    assert [(c["id"], c["kind"], c["payload"]) for c in pulled] == [(command.pk, "fault_drill", {"kind": "kill", "role": "generator"})]
    for _ in range(2):
        assert client.post(f"/api/v1/controller/runs/{run.pk}/commands/{command.pk}/ack", **auth).json()["state"] == "delivered"
    assert client.get(f"/api/v1/controller/runs/{run.pk}/commands", **auth).json()[0]["state"] == "delivered"
    result = {"ok": True, "result": {"recovered_s": 2.5}}
    for _ in range(2):
        done = client.post(f"/api/v1/controller/runs/{run.pk}/commands/{command.pk}/result", data=json.dumps(result),
                           content_type="application/json", **auth)
        assert done.status_code == 200 and done.json()["state"] == "succeeded"
    assert client.get(f"/api/v1/controller/runs/{run.pk}/commands", **auth).json() == []
    command.refresh_from_db()
    assert command.delivery_count == 2 and command.result == {"recovered_s": 2.5}
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    assert kinds.count("command_acknowledged") == 1 and kinds.count("command_finished") == 1
    missing = client.post(f"/api/v1/controller/runs/{run.pk}/commands/999999/ack", **auth)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    assert Command.objects.count() == 1


def test_non_finite_values_are_stored_as_reported(client, running_run):
    run, token = running_run
    metrics = [{"key": "loss", "step": 1, "value": float("nan"), "time": 1.7e9},
               {"key": "loss", "step": 2, "value": float("-inf"), "time": 1.7e9},
               {"key": "loss", "step": 3, "value": 1e-310, "time": 1.7e9}]
    assert post(client, run, token, {"batches": [{"seq": 1, "metrics": metrics}]}).status_code == 200
    values = list(MetricPoint.objects.filter(series__run=run).order_by("step").values_list("value", flat=True))
    assert values[0] is None, "NaN is kept as null (SQLite cannot store NaN; JSON has no NaN)"
    assert values[1] == float("-inf") and values[2] == 1e-310


def test_nul_characters_from_a_random_model_are_stored_not_refused(client, running_run):
    """A tiny random model's completion held a NUL; Postgres refused it and every retry got a 500."""
    run, token = running_run
    body = batch(1)
    body["events"] = [{"kind": "rollout", "time": 1.7e9,
                       "payload": {"step": 3, "prompt": "11+6=", "completion": "\ufffd\f\x00x", "k\x00": ["\x00"]}}]
    body["logs"] = [{"line": "bad \x00 byte", "time": 1.7e9}]
    assert post(client, run, token, {"batches": [body]}).status_code == 200
    payload = RunEvent.objects.get(run=run, kind="rollout").payload
    assert payload["completion"] == "\ufffd\f\ufffdx" and payload["k\ufffd"] == ["\ufffd"]
    assert LogLine.objects.get(run=run).line == "bad \ufffd byte"


def test_a_command_result_with_a_nul_is_stored(client, monarch_running_run, team):
    run, token = monarch_running_run
    command = command_create(actor=team.member, run=run, kind="checkpoint", payload={})
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    result = {"ok": False, "result": {"error": "engine said \x00"}}
    response = client.post(f"/api/v1/controller/runs/{run.pk}/commands/{command.pk}/result", data=json.dumps(result),
                           content_type="application/json", **auth)
    assert response.status_code == 200
    command.refresh_from_db()
    assert command.state == "failed" and command.result == {"error": "engine said \ufffd"}
