"""Step timelines (#17 item 5): what the controller sends as `step_timeline` events is stored one row per step (not
as run events), a step run again replaces its row, a malformed timeline is refused by field with nothing stored,
the API gives the last N steps to the run's project only, and the websocket's backlog and live updates carry them."""

from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async as sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from forgeboard.accounts.services import api_token_create, project_create
from forgeboard.asgi import application
from forgeboard.telemetry.models import RunEvent, StepTimeline
from forgeboard.telemetry.ingest import telemetry_ingest
from workers.engine.telemetry_wire import TelemetryBatch

START = 1.7e9


def timeline(step: int, *, forward: float = 0.4) -> dict:
    return {"step": step, "start": START + step, "seconds": 1.0, "lanes": ["controller", "trainer 0", "generator 0"],
            "spans": [[0, "train", 0.5, 1.0], [1, "forward_backward", 0.5, 0.5 + forward], [2, "generate", -0.2, 0.5]],
            "shares": {"generate": 0.5, "forward_backward": forward}, "idle": {"trainer 0": 1 - forward}}


def batch(seq: int, *timelines: dict, message: bool = False) -> dict:
    events = [{"kind": "step_timeline", "payload": t, "time": START} for t in timelines]
    return {"seq": seq, "events": events + ([{"kind": "message", "payload": {"n": seq}, "time": START}]
                                             if message else [])}


def post(client, run, token, *batches: dict):
    return client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", data=json.dumps({"batches": list(batches)}),
                       content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def test_timelines_are_stored_per_step_and_a_rerun_step_replaces_its_row(client, running_run):
    run, token = running_run
    events_before = RunEvent.objects.filter(run=run).count()
    assert post(client, run, token, batch(1, timeline(0), timeline(1), message=True)).status_code == 200
    assert post(client, run, token, batch(2, timeline(1, forward=0.2), timeline(2))).status_code == 200
    rows = list(StepTimeline.objects.filter(run=run).order_by("step"))
    assert [r.step for r in rows] == [0, 1, 2]
    assert rows[1].payload["spans"][1] == [1, "forward_backward", 0.5, 0.7]  # the step's second run
    assert rows[2].payload["start"] == START + 2
    assert RunEvent.objects.filter(run=run).count() == events_before + 1  # only the message is a run event
    assert post(client, run, token, batch(2, timeline(2, forward=0.1))).status_code == 200  # a resent batch
    assert StepTimeline.objects.get(run=run, step=2).payload["shares"]["forward_backward"] == 0.4


def test_a_long_run_keeps_its_recent_timelines_and_one_step_in_a_hundred_before(client, running_run):
    run, token = running_run
    for seq, first in enumerate(range(0, 1_300, 100), start=1):
        answer = post(client, run, token, batch(seq, *(timeline(step) for step in range(first, first + 100))))
        assert answer.status_code == 200, answer.content
    steps = list(StepTimeline.objects.filter(run=run).order_by("step").values_list("step", flat=True))
    assert steps == [0, 100, 200, *range(299, 1_300)], steps[:10]


@pytest.mark.parametrize("change, field", [
    ({"spans": [[7, "generate", 0.0, 1.0]]}, "payload"),  # no lane 7
    ({"spans": [[0, "generate", 1.0, 0.5]]}, "payload"),  # ends before it starts
    ({"spans": [[0, "generate", 0.0, 1e12]]}, "payload.spans.0.3"),
    ({"shares": {"generate": 1.5}}, "payload.shares.generate"),
    ({"lanes": ["trainer\x000"]}, "payload"),
    ({"lanes": ["x" * 65]}, "payload.lanes.0"),
    ({"lanes": ["a", "a"]}, "payload"),
    ({"seconds": "1.0"}, "payload.seconds"),
    ({"spans": [[0, "generate", 0.0]]}, "payload.spans.0"),
    ({"spans": [[0, "g", 0.0, 1.0]] * 2001}, "payload.spans"),
    ({"step": -1}, "payload.step"),
])
def test_a_malformed_timeline_is_refused_by_field_and_nothing_is_stored(client, running_run, change, field):
    run, token = running_run
    answer = post(client, run, token, batch(1, timeline(0)), batch(2, {**timeline(1), **change}))
    assert answer.status_code == 422, answer.content
    refused = answer.json()["refused"]
    assert [(r["seq"], r["section"], r["index"]) for r in refused] == [(2, "events", 0)]
    assert refused[0]["field"].startswith(f"batches.1.events.0.{field}"), refused[0]
    assert not StepTimeline.objects.filter(run=run).exists()
    assert post(client, run, token, batch(1, timeline(0)), batch(2)).status_code == 200  # the rest, sent again
    assert list(StepTimeline.objects.filter(run=run).values_list("step", flat=True)) == [0]


def test_the_api_gives_the_last_steps_to_the_runs_project_only(client, team, running_run):
    run, _ = running_run
    telemetry_ingest(run=run, batches=[TelemetryBatch.model_validate(batch(1, *(timeline(s) for s in range(8))))])
    _, read = api_token_create(actor=team.member, project=team.project, name="ci-read", scope="read")
    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    _, foreign = api_token_create(actor=team.outsider, project=other, name="beta-ci", scope="read")

    def get(query: str, token: str):
        return client.get(f"/api/v1/runs/{run.pk}/timeline{query}", HTTP_AUTHORIZATION=f"Bearer {token}")

    answer = get("?last=3", read)
    assert answer.status_code == 200
    assert answer.json()["run"] == run.pk
    assert [t["step"] for t in answer.json()["timelines"]] == [5, 6, 7]
    assert answer.json()["timelines"][0] == timeline(5) | {"truncated": 0}
    assert [t["step"] for t in get("", read).json()["timelines"]] == list(range(8))
    assert get("?last=3", foreign).status_code == 404
    for bad in ("?last=0", "?last=501", "?last=x", "?last=1%00"):
        refused = get(bad, read)
        assert refused.status_code == 400 and refused.json()["errors"][0]["field"].endswith("last"), (bad, refused.json())


@pytest.mark.django_db(transaction=True, databases=list(settings.DATABASES))
@pytest.mark.asyncio
async def test_the_backlog_and_live_updates_carry_timelines(running_run, team):
    run, _ = running_run
    _, token = await sync_to_async(api_token_create)(actor=team.member, project=team.project, name="ws", scope="read")
    await sync_to_async(telemetry_ingest)(run=run, batches=[TelemetryBatch.model_validate(
        batch(1, *(timeline(s) for s in range(60))))])
    socket = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={token}",
                                   headers=[(b"origin", b"http://127.0.0.1")])
    connected, _ = await socket.connect(timeout=10)
    assert connected
    backlog = json.loads(await socket.receive_from(timeout=10))
    assert [t["step"] for t in backlog["timelines"]] == list(range(10, 60))  # the last 50
    assert not any(e["kind"] == "step_timeline" for e in backlog["events"])
    await sync_to_async(telemetry_ingest)(run=run, batches=[TelemetryBatch.model_validate(batch(2, timeline(60)))])
    live = json.loads(await socket.receive_from(timeout=10))
    assert live["type"] == "run.update" and [t["step"] for t in live["timelines"]] == [60]
    assert live["events"] == []
    await socket.disconnect()
