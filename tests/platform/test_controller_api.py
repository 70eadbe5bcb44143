"""The controller's HTTP channel: telemetry batches exactly once and in order; commands at least once."""

from __future__ import annotations

import asyncio
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
    assert response.json() == {"applied_seq": 2, "duplicates": 0, "duplicates_dropped": [],
                               "duplicates_dropped_total": 0, "pending_commands": []}
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


def nested(depth: int) -> dict:
    payload: dict = {}
    for _ in range(depth - 1):
        payload = {"x": payload}
    return payload


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("{not json", "body"),
        ('{"batches": [' * 3000 + "]" * 3000 + "}", "body"),
        ("[1, 2]", "body"),
        ('{"batches": [{"seq": 1, "metrics": [{"key": "k", "step": 1' + "0" * 5000 + ', "value": 1, "time": 1}]}]}',
         "body"),
        ({"batches": [batch(1) | {"seq": 0}]}, "batches.0.seq"),
        ({"batches": [batch(1) | {"extra": 1}]}, "batches.0.extra"),
        ({"batches": "nope"}, "batches"),
        ({"batches": [batch(1) | {"metrics": "nope"}]}, "batches.0.metrics"),
        ({"batches": [batch(1) | {"seq": "1"}]}, "batches.0.seq"),
        ({"batches": [batch(1) | {"events": [{"kind": "message", "time": 1.0}] * 1001}]}, "batches.0.events"),
    ],
)
def test_a_request_that_is_not_numbered_batches_is_refused_whole(client, running_run, body, field):
    run, token = running_run
    response = post(client, run, token, body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "validation_failed"
    assert field in [e["field"] for e in response.json()["errors"]]
    assert stored(run) == (0, 0, 0)
    assert Run.objects.get(pk=run.pk).telemetry_seq == 0


def metric(key: object = "loss", step: object = 1, value: object = 1.0, time: object = 1.0) -> dict:
    return {"key": key, "step": step, "value": value, "time": time}


POISON = [
    ("metrics", metric(key="bad\x00key"), "key"),
    ("metrics", metric(key="bad\nkey"), "key"),
    ("metrics", metric(key="k" * 201), "key"),
    ("metrics", metric(key=""), "key"),
    ("metrics", metric(step=-1), "step"),
    ("metrics", metric(step=2**63), "step"),
    ("metrics", metric(step=True), "step"),
    ("metrics", metric(value=True), "value"),
    ("metrics", metric(value="2"), "value"),
    ("metrics", metric(time=float("nan")), "time"),
    ("metrics", {"key": "loss", "step": 1, "value": 1.0}, "time"),
    ("events", {"kind": "explode", "time": 1.0}, "kind"),
    ("events", {"kind": "message", "payload": nested(34), "time": 1.0}, "payload"),
    ("events", {"kind": "message", "payload": {"k\x00": 1}, "time": 1.0}, "payload"),
    ("events", {"kind": "message", "payload": {"reward": float("nan")}, "time": 1.0}, "payload"),
    ("events", {"kind": "message", "payload": {"s": "\ud800"}, "time": 1.0}, "payload"),
    # An integer past a float's range: it took the telemetry request (a recovery's time) or the rollouts table down.
    ("events", {"kind": "recovered", "payload": {"time_to_recover_s": 10**400}, "time": 1.0}, "payload"),
    ("events", {"kind": "rollout", "payload": {"step": 1, "reward": [-10**400]}, "time": 1.0}, "payload"),
    ("logs", {"line": "x" * 9000, "time": 1.0}, "line"),
    ("logs", {"line": "\udc00", "time": 1.0}, "line"),
    ("logs", "a bare string", None),
]


@pytest.mark.parametrize(("section", "item", "attribute"), POISON)
def test_a_poison_item_is_refused_by_position_and_the_rest_applies_when_sent_again(
        client, running_run, section, item, attribute):
    run, token = running_run
    assert post(client, run, token, {"batches": [batch(1)]}).status_code == 200
    poisoned = batch(3)
    poisoned[section] = [*poisoned[section], item, *poisoned[section]]
    bad_index = len(batch(3)[section])
    response = post(client, run, token, {"batches": [batch(2), poisoned]})
    assert response.status_code == 422, response.content
    body = response.json()
    assert body["code"] == "items_refused" and body["applied_seq"] == 1
    assert [(r["seq"], r["section"], r["index"]) for r in body["refused"]] == [(3, section, bad_index)]
    where = f"batches.1.{section}.{bad_index}" + (f".{attribute}" if attribute else "")
    assert [e["field"] for e in body["errors"]] == [where] and body["refused"][0]["field"] == where
    assert body["refused"][0]["reason"]
    assert stored(run) == (3, 1, 1), "batch 1 is kept; nothing of the refused request is stored"
    assert Run.objects.get(pk=run.pk).telemetry_seq == 1

    del poisoned[section][bad_index]
    again = post(client, run, token, {"batches": [batch(2), poisoned]})
    assert again.status_code == 200, again.content
    assert again.json()["applied_seq"] == 3
    expected = [9, 3, 3]
    if section == "metrics":  # the item's neighbours are the same points twice: reported, the later kept
        assert again.json()["duplicates_dropped_total"] == 3
    else:
        expected[["metrics", "events", "logs"].index(section)] += 1
    assert stored(run) == tuple(expected)


def test_refusals_list_every_bad_item_of_every_pending_batch(client, running_run):
    run, token = running_run
    first, second = batch(1), batch(2)
    first["metrics"][0]["key"] = "a\x01"
    first["logs"].append({"line": "y" * 9000, "time": 1.0})
    second["events"][0]["kind"] = "nope"
    response = post(client, run, token, {"batches": [first, second]})
    assert response.status_code == 422
    refused = [(r["seq"], r["section"], r["index"]) for r in response.json()["refused"]]
    assert refused == [(1, "metrics", 0), (1, "logs", 1), (2, "events", 0)]
    assert stored(run) == (0, 0, 0)


def test_a_refused_item_of_a_batch_already_applied_does_not_refuse_the_request(client, running_run):
    """A batch is applied once: sent again (a lost answer) it is skipped, whatever it holds now."""
    run, token = running_run
    assert post(client, run, token, {"batches": [batch(1)]}).status_code == 200
    stale = batch(1)
    stale["metrics"][0]["key"] = "a\x01"
    response = post(client, run, token, {"batches": [stale, batch(2)]})
    assert response.status_code == 200, response.content
    assert response.json()["applied_seq"] == 2 and response.json()["duplicates"] == 1


def test_duplicate_points_in_a_batch_are_reported_with_the_value_kept(client, running_run):
    run, token = running_run
    metrics = [metric(step=1, value=1.0), metric(step=2, value=2.0), metric(step=1, value=3.0),
               metric(key="reward", step=1, value=4.0), metric(step=1, value=5.0)]
    response = post(client, run, token, {"batches": [{"seq": 1, "metrics": metrics}]})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["duplicates_dropped_total"] == 2
    assert body["duplicates_dropped"] == [{"seq": 1, "key": "loss", "step": 1, "index": 0},
                                          {"seq": 1, "key": "loss", "step": 1, "index": 2}]
    values = dict(MetricPoint.objects.filter(series__run=run, series__key="loss").values_list("step", "value"))
    assert values == {1: 5.0, 2: 2.0}, "the last value for a key and step is the one kept"
    assert MetricPoint.objects.filter(series__run=run).count() == 3


def test_oversized_payload_is_refused(client, running_run):
    run, token = running_run
    response = post(client, run, token, {"batches": []}, CONTENT_LENGTH=str(MAX_REQUEST_BYTES + 1))
    assert response.status_code == 413 and response.json()["code"] == "payload_too_large"
    too_big = post(client, run, token, {"batches": [batch(1) | {"logs": [{"line": "x" * 8000, "time": 1.0}] * 1100}]})
    assert too_big.status_code == 413 and too_big.json()["code"] == "payload_too_large"
    assert stored(run) == (0, 0, 0)


def test_a_body_under_the_limit_but_over_djangos_default_is_applied(client, running_run):
    """7.2 MB: under the advertised limit, over Django's default upload size (which gave a 500)."""
    run, token = running_run
    logs = [{"line": "x" * 7000, "time": 1.7e9}] * 1000
    body = json.dumps({"batches": [{"seq": 1, "logs": logs}, {"seq": 2, "logs": logs[:20]}]})
    assert 7_000_000 < len(body) < MAX_REQUEST_BYTES
    response = post(client, run, token, body)
    assert response.status_code == 200, response.content[:500]
    assert LogLine.objects.filter(run=run).count() == 1020


def _asgi_post(path: str, token: str, chunks: list[bytes]) -> tuple[int, dict]:
    """POST through Django's ASGI handler (as uvicorn calls it) with a chunked body: no Content-Length."""
    from asgiref.sync import async_to_sync
    from django.core.handlers.asgi import ASGIHandler

    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(60)  # the client waits for the answer (Django stops listening once it is sent)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         (b"transfer-encoding", b"chunked"), (b"authorization", f"Bearer {token}".encode())],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    async_to_sync(ASGIHandler())(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_a_chunked_body_over_the_limit_without_content_length_is_refused(running_run, wsgi_in_process):
    run, token = running_run
    path = f"/api/v1/controller/runs/{run.pk}/telemetry"
    head = b'{"batches": [{"seq": 1, "logs": ['
    line = json.dumps({"line": "x" * 8000, "time": 1.7e9}).encode()
    chunks = [head] + [line + b", "] * 1200 + [line + b"]}]}"]
    assert sum(map(len, chunks)) > MAX_REQUEST_BYTES
    status, body = _asgi_post(path, token, chunks)
    assert status == 413 and body["code"] == "payload_too_large"
    assert stored(run) == (0, 0, 0)
    small = [b'{"batches": [{"seq": 1, ', b'"metrics": [{"key": "loss", "step": 1, "value": 0.5, "time": 1.0}]}]}']
    assert _asgi_post(path, token, small)[0] == 200
    assert stored(run) == (1, 0, 0)


def test_the_openapi_document_states_the_telemetry_body_and_its_refusals(client):
    operation = client.get("/api/v1/openapi.json").json()["paths"]["/api/v1/controller/runs/{run_id}/telemetry"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    batch_schema = schema["properties"]["batches"]["items"]
    assert schema["properties"]["batches"]["maxItems"] == 64
    assert batch_schema["properties"]["metrics"]["items"]["properties"]["key"]["maxLength"] == 200
    assert "$ref" not in json.dumps(schema)
    assert {"400", "413", "422"} <= set(operation["responses"])
    refusal = json.dumps(operation["responses"]["422"])
    assert "items_refused" in refusal or "TelemetryRefusal" in refusal


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
                       "payload": {"step": 3, "prompt": "11+6=", "completion": "\ufffd\f\x00x", "k": ["\x00"]}}]
    body["logs"] = [{"line": "bad \x00 byte", "time": 1.7e9}]
    assert post(client, run, token, {"batches": [body]}).status_code == 200
    payload = RunEvent.objects.get(run=run, kind="rollout").payload
    assert payload["completion"] == "\ufffd\f\ufffdx" and payload["k"] == ["\ufffd"]
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


@pytest.mark.parametrize(("result", "field"), [
    ('{"recovered_s": NaN}', "body"),  # not JSON: the API's parser refuses it before the schema
    ('{"recovered_s": -Infinity}', "body"),
    ('{"error": "\\ud800"}', "result.error"),
    ('{"\\udc00": 1}', "result"),
    ('{"steps": [1, %s]}' % ("9" * 400), "result.steps.1"),
])
def test_a_command_result_no_database_or_page_can_hold_is_a_field_error(client, monarch_running_run, team, result,
                                                                          field):
    """A run's engine reports a command's result with NaN, a lone surrogate or a number past a float: it gets a 400
    naming the field (not a 500), the command stays open, and the result sent again without it is recorded."""
    run, token = monarch_running_run
    command = command_create(actor=team.member, run=run, kind="pause")
    url = f"/api/v1/controller/runs/{run.pk}/commands/{command.pk}/result"
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    refused = client.post(url, data='{"ok": false, "result": %s}' % result, content_type="application/json", **auth)
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "validation_failed"
    assert [e["field"] for e in refused.json()["errors"]] == [field]
    command.refresh_from_db()
    assert command.state == "pending" and command.result in ({}, None)
    done = client.post(url, data='{"ok": false, "result": {"error": "gone"}}', content_type="application/json", **auth)
    assert done.status_code == 200 and done.json()["state"] == "failed"
    client.force_login(team.member)
    assert client.get(f"/runs/{run.pk}/").status_code == 200


def test_a_run_cannot_grow_its_metric_keys_without_bound(client, running_run, team, monkeypatch):
    """A run's engine that makes up a new metric key for every point would put an endless list of charts on its
    page and in its stream: past the run's limit, points of new keys are refused by position (nothing of that
    request is stored), the rest lands when sent again, and the keys the run has keep taking points."""
    monkeypatch.setattr("forgeboard.telemetry.ingest.MAX_METRIC_KEYS_PER_RUN", 3)
    run, token = running_run
    first = {"seq": 1, "metrics": [metric(key="a"), metric(key="b")]}
    assert post(client, run, token, {"batches": [first]}).status_code == 200
    second = {"seq": 2, "metrics": [metric(key="a", step=2), metric(key="c"), metric(key="d"), metric(key="c", step=2)]}
    third = {"seq": 3, "metrics": [metric(key="e"), metric(key="b", step=3)]}
    response = post(client, run, token, {"batches": [second, third]})
    assert response.status_code == 422, response.content
    body = response.json()
    assert body["code"] == "items_refused" and body["applied_seq"] == 1
    assert [(r["seq"], r["index"], r["field"]) for r in body["refused"]] == [
        (2, 2, "batches.0.metrics.2.key"), (3, 0, "batches.1.metrics.0.key")]
    assert "at most 3 metric keys" in body["refused"][0]["reason"]
    assert stored(run)[0] == 2
    del second["metrics"][2], third["metrics"][0]
    again = post(client, run, token, {"batches": [second, third]})
    assert again.status_code == 200 and again.json()["applied_seq"] == 3
    assert post(client, run, token, {"batches": [{"seq": 4, "metrics": [metric(key="c", step=9)]}]}).status_code == 200
    client.force_login(team.member)
    keys = [series["key"] for series in client.get(f"/api/v1/runs/{run.pk}/metrics").json()]
    assert keys == ["a", "b", "c"]
    assert stored(run)[0] == 7


@pytest.mark.django_db(transaction=True)
def test_two_requests_at_once_never_take_a_run_past_its_metric_key_limit(running_run):
    """A run 4 keys short of its limit: one request stores 3 new keys while another brings 3 more. The second counted
    the keys before taking the run's lock, so it saw 4 keys free and stored all 3 once the first committed: 2 past
    the limit. Now it counts under the lock: 1 key is free, and its points of the other 2 get the 422 that names them
    (nothing of the request is stored); sent again without them, the rest lands and the run has exactly its limit."""
    import httpx

    from forgeboard.telemetry.ingest import telemetry_ingest
    from forgeboard.telemetry.models import MetricSeries
    from forgeboard.wsgi import application
    from tests.support.races import racing_an_open_transaction
    from workers.engine.telemetry_wire import MAX_METRIC_KEYS_PER_RUN, TelemetryBatch

    run, token = running_run
    MetricSeries.objects.bulk_create(MetricSeries(run=run, key=f"old/{i}") for i in range(MAX_METRIC_KEYS_PER_RUN - 4))
    second = {"seq": 2, "metrics": [metric(key=f"second/{i}") for i in range(3)]}

    def send_second() -> httpx.Response:
        with httpx.Client(transport=httpx.WSGITransport(app=application), base_url="http://testserver") as http:
            return http.post(f"/api/v1/controller/runs/{run.pk}/telemetry", json={"batches": [second]},
                             headers={"Authorization": f"Bearer {token}"})

    answer = racing_an_open_transaction(
        lambda: telemetry_ingest(run=Run.objects.get(pk=run.pk), batches=[TelemetryBatch.model_validate(
            {"seq": 1, "metrics": [metric(key=f"first/{i}") for i in range(3)]})]),
        send_second)
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 422, answer.content
    body = answer.json()
    assert body["code"] == "items_refused" and body["applied_seq"] == 1
    assert [(r["seq"], r["field"]) for r in body["refused"]] == [(2, "batches.0.metrics.1.key"),
                                                                   (2, "batches.0.metrics.2.key")]
    assert f"at most {MAX_METRIC_KEYS_PER_RUN} metric keys" in body["refused"][0]["reason"]
    assert MetricSeries.objects.filter(run=run).count() == MAX_METRIC_KEYS_PER_RUN - 1

    del second["metrics"][1:]
    assert send_second().json()["applied_seq"] == 2
    assert MetricSeries.objects.filter(run=run).count() == MAX_METRIC_KEYS_PER_RUN
