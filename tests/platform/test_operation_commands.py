"""Drills, placement changes and redirects are checked against the engine's typed operations before they are stored."""

from __future__ import annotations

import json

import pytest

from forgeboard.errors import Conflict, ValidationFailed
from forgeboard.runs.models import Command
from forgeboard.runs.services import command_create


def test_a_valid_drill_is_stored_for_a_monarch_run(team, monarch_running_run):
    run, _ = monarch_running_run
    payload = {"kind": "hang", "role": "generator", "replica": 1, "duration_s": 2.5, "schedule": {"at_step": 3}}
    command = command_create(actor=team.member, run=run, kind="fault_drill", payload=payload)
    assert Command.objects.get(pk=command.pk).payload == payload


@pytest.mark.parametrize(("kind", "payload", "field"), [
    ("fault_drill", {"kind": "kill", "role": "scheduler"}, "payload.role"),
    ("fault_drill", {"kind": "latency", "role": "generator"}, "payload.latency_ms"),
    ("fault_drill", {"kind": "kill", "role": "generator", "replica": -1}, "payload.replica"),
    ("fault_drill", {"kind": "kill", "role": "generator", "surprise": 1}, "payload.surprise"),
    ("placement_change", {"action": "move", "role": "generator", "replica": 0}, "payload.host"),
    ("load_redirect", {"action": "drain", "host": "no spaces allowed"}, "payload.host"),
])
def test_bad_operations_name_the_field_and_store_nothing(team, monarch_running_run, kind, payload, field):
    run, _ = monarch_running_run
    with pytest.raises(ValidationFailed) as caught:
        command_create(actor=team.member, run=run, kind=kind, payload=payload)
    assert field in [p.field for p in caught.value.problems]
    assert not Command.objects.filter(run=run).exists()


def test_a_single_process_run_refuses_operations_with_the_reason(team, running_run):
    run, _ = running_run
    with pytest.raises(Conflict, match="needs placement.backend monarch"):
        command_create(actor=team.member, run=run, kind="fault_drill", payload={"kind": "kill", "role": "generator"})
    assert not Command.objects.filter(run=run).exists()


def test_the_api_answers_a_bad_drill_with_field_errors(client, team, monarch_running_run):
    run, _ = monarch_running_run
    client.force_login(team.member)
    response = client.post(f"/api/v1/runs/{run.pk}/commands", content_type="application/json",
                           data=json.dumps({"kind": "fault_drill", "payload": {"kind": "melt", "role": "generator"}}))
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["payload.kind"]
