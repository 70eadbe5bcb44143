"""Operator commands end with their run: open commands expire when the run ends or is lost (a restart does not hand
them to the new controller), each with a reason and an event; a controller's late report of an expired command is
recorded as what really happened, and moves no run."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.runs.models import Command, CommandState, Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.selectors import commands_pending
from forgeboard.runs.services import (
    IllegalTransition,
    command_acknowledge,
    command_create,
    command_finish,
    run_cancel,
    run_transition,
)
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.races import racing_an_open_transaction

DRILL = {"kind": "kill", "role": "generator"}


def _expiries(run: Run) -> list[dict]:
    return [e.payload for e in RunEvent.objects.filter(run=run, kind="command_finished").order_by("seq")]


@pytest.mark.parametrize(("to_state", "words"), [(RunState.SUCCEEDED, "the run succeeded"),
                                                 (RunState.FAILED, "the run failed")])
def test_open_commands_expire_with_the_reason_when_the_run_ends(team, monarch_running_run, to_state, words):
    run, _token = monarch_running_run
    done = command_create(actor=team.member, run=run, kind="checkpoint")
    command_finish(run=run, command_id=done.pk, ok=True, result={"step": 40})
    taken = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    command_acknowledge(run=run, command_id=taken.pk)
    waiting = command_create(actor=team.member, run=run, kind="placement_change",
                             payload={"action": "move", "role": "generator", "replica": 0, "host": "node1"})

    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=to_state, reason="engine exited")

    states = dict(Command.objects.filter(run=run).values_list("pk", "state"))
    assert states == {done.pk: CommandState.SUCCEEDED, taken.pk: CommandState.EXPIRED,
                      waiting.pk: CommandState.EXPIRED}
    assert Command.objects.get(pk=taken.pk).result == {
        "reason": f"{words} after its controller took this command but before it reported a result (it may have run)"}
    assert Command.objects.get(pk=waiting.pk).result == {"reason": f"{words} before its controller took this command"}
    assert Command.objects.get(pk=done.pk).result == {"step": 40}, "a finished command keeps its outcome"
    assert list(commands_pending(run=run)) == []
    assert [(p["command"], p["kind"], p["ok"], p.get("state")) for p in _expiries(run)[1:]] == [
        (taken.pk, "fault_drill", False, "expired"), (waiting.pk, "placement_change", False, "expired")]
    kinds = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("kind", flat=True))
    assert kinds[-3:] == ["state_changed", "command_finished", "command_finished"], "the state change comes first"


def test_a_cancelled_runs_cancel_expires_if_its_controller_never_took_it(team, running_run):
    run, _token = running_run
    run_cancel(actor=team.member, run=run)
    cancel = Command.objects.get(run=run)
    assert list(commands_pending(run=run)) == [cancel], "open while the run is cancelling"
    run_transition(run_id=run.pk, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                   reason="cancelled by operator")
    cancel.refresh_from_db()
    assert cancel.state == CommandState.EXPIRED
    assert cancel.result == {"reason": "the run was cancelled before its controller took this command"}


def test_a_lost_run_restarted_by_the_reconciler_does_not_hand_its_commands_to_the_new_controller(
        team, monarch_running_run, django_capture_on_commit_callbacks):
    """A drill, a checkpoint, a pause: asked of the controller that was lost, they expire as the run is lost, and the
    restarted controller pulls none of them; what the operator sends to the restarted run is delivered."""
    run, _token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    command_acknowledge(run=run, command_id=drill.pk)
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    pause = command_create(actor=team.member, run=run, kind="pause")
    Run.objects.filter(pk=run.pk).update(max_restarts=1, last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    before = Run.objects.get(pk=run.pk).last_event_seq

    with django_capture_on_commit_callbacks():
        report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)

    assert report.restarted == [run.pk] and Run.objects.get(pk=run.pk).state == RunState.QUEUED
    assert list(commands_pending(run=run)) == []
    lost = "the run was lost"
    again = "; a restarted run does not get it again"
    assert {c.pk: c.result["reason"] for c in Command.objects.filter(run=run, state=CommandState.EXPIRED)} == {
        drill.pk: f"{lost} after its controller took this command but before it reported a result (it may have run)"
                  + again,
        checkpoint.pk: f"{lost} before its controller took this command{again}",
        pause.pk: f"{lost} before its controller took this command{again}",
    }
    path = [(e.kind, e.payload.get("to") or e.payload.get("command"))
            for e in RunEvent.objects.filter(run=run, seq__gt=before).order_by("seq")]
    assert path[:4] == [("state_changed", "lost"), ("command_finished", drill.pk),
                        ("command_finished", checkpoint.pk), ("command_finished", pause.pk)]
    assert path[4] == ("state_changed", "queued"), "expired as it was lost, before the restart"

    for state in (RunState.LAUNCHING, RunState.RUNNING):
        run_transition(run_id=run.pk, from_state=Run.objects.get(pk=run.pk).state, to_state=state)
    again_drill = command_create(actor=team.member, run=Run.objects.get(pk=run.pk), kind="fault_drill", payload=DRILL)
    assert list(commands_pending(run=run)) == [again_drill]


def test_a_run_whose_controller_goes_silent_while_cancelling_ends_cancelled_and_its_commands_expire(
        team, monarch_running_run):
    """A run being cancelled is never lost, so no restarted controller waits for its cancel: the run ends cancelled
    and the cancel expires with it, as it does whenever the run ends before a controller takes it."""
    run, _token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    run_cancel(actor=team.member, run=run)
    cancel = Command.objects.get(run=run, kind="cancel")
    with pytest.raises(IllegalTransition, match="from cancelling to lost"):
        run_transition(run_id=run.pk, from_state=RunState.CANCELLING, to_state=RunState.LOST, reason="no heartbeat")
    assert list(commands_pending(run=run)) == [drill, cancel]

    long_ago = timezone.now() - timedelta(seconds=120)
    Run.objects.filter(pk=run.pk).update(max_restarts=1, last_heartbeat_at=long_ago, state_changed_at=long_ago)
    report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)

    assert report.cancelled == [run.pk] and report.restarted == []
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED
    assert list(commands_pending(run=run)) == []
    assert {c.pk: (c.state, c.result) for c in Command.objects.filter(run=run)} == {
        drill.pk: (CommandState.EXPIRED, {"reason": "the run was cancelled before its controller took this command"}),
        cancel.pk: (CommandState.EXPIRED, {"reason": "the run was cancelled before its controller took this command"}),
    }


def test_a_cancelling_run_that_fails_expires_its_cancel(team, running_run):
    run, _token = running_run
    run_cancel(actor=team.member, run=run)
    assert Command.objects.get(run=run).state == CommandState.PENDING
    run_transition(run_id=run.pk, from_state=RunState.CANCELLING, to_state=RunState.FAILED, reason="engine crashed")
    assert Command.objects.get(run=run).result == {"reason": "the run failed before its controller took this command"}


def test_a_late_report_of_an_expired_command_is_recorded_as_what_really_ran(team, monarch_running_run):
    """The controller ran the drill, then was lost before it reported: its report (its ledger's truth) is kept, the
    acknowledgement that comes with it does not reopen the command, and the event says it came late."""
    run, _token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    command_acknowledge(run=run, command_id=drill.pk)
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="no heartbeat")

    assert command_acknowledge(run=run, command_id=drill.pk).state == CommandState.EXPIRED
    finished = command_finish(run=run, command_id=drill.pk, ok=True, result={"killed": "generator 0"})
    assert finished.state == CommandState.SUCCEEDED and finished.result == {"killed": "generator 0"}
    late = _expiries(run)[-1]
    assert late["ok"] is True and late["result"] == {"killed": "generator 0"} and "state" not in late
    assert late["late"].startswith("the run was lost after its controller took this command")
    again = command_finish(run=run, command_id=drill.pk, ok=False, result={"error": "again"})
    assert again.state == CommandState.SUCCEEDED and len(_expiries(run)) == 2, "a repeated report changes nothing"


def test_a_late_pause_of_a_lost_run_moves_no_run(team, running_run):
    run, _token = running_run
    pause = command_create(actor=team.member, run=run, kind="pause")
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="no heartbeat")
    run_transition(run_id=run.pk, from_state=RunState.LOST, to_state=RunState.QUEUED, reason="restart 1 of 1")
    for state in (RunState.LAUNCHING, RunState.RUNNING):
        run_transition(run_id=run.pk, from_state=Run.objects.get(pk=run.pk).state, to_state=state)

    assert command_finish(run=run, command_id=pause.pk, ok=True, result={"paused_at_step": 7}).state == "succeeded"
    assert Run.objects.get(pk=run.pk).state == RunState.RUNNING, "the restarted controller was never paused"


@pytest.mark.django_db(transaction=True)
def test_a_report_racing_the_runs_loss_is_recorded_after_the_expiry(team, monarch_running_run):
    """The controller reports while the reconciler is marking its run lost: the report waits for the run's row and
    is recorded as a late report of the expired command, not lost and not a 500."""
    run, _token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    outcome = racing_an_open_transaction(
        lambda: run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="silent"),
        lambda: command_finish(run=Run.objects.get(pk=run.pk), command_id=drill.pk, ok=True, result={"at": 3}))
    assert isinstance(outcome, Command) and outcome.state == CommandState.SUCCEEDED, outcome
    assert [p.get("state", p["ok"]) for p in _expiries(run)] == ["expired", True]


@pytest.mark.django_db(transaction=True)
def test_a_run_lost_while_a_report_is_being_stored_leaves_the_finished_command_alone(team, monarch_running_run):
    run, _token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    outcome = racing_an_open_transaction(
        lambda: command_finish(run=Run.objects.get(pk=run.pk), command_id=drill.pk, ok=True, result={"at": 3}),
        lambda: run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="silent"))
    assert isinstance(outcome, Run) and outcome.state == RunState.LOST, outcome
    drill.refresh_from_db()
    assert drill.state == CommandState.SUCCEEDED and drill.result == {"at": 3}
    assert [p["ok"] for p in _expiries(run)] == [True]


def test_the_controller_api_takes_a_late_report_and_the_public_api_shows_both_states(client, team, monarch_running_run):
    """Through HTTP, as the engine's CommandChannel does it: the command is pulled and acknowledged, the run is lost,
    the list of open commands is empty, a repeated acknowledgement and the late result are 200s that never reopen it;
    once the run has ended its controller's token is refused and the command stays as it was."""
    run, token = monarch_running_run
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    base = f"/api/v1/controller/runs/{run.pk}/commands"
    assert [c["id"] for c in client.get(base, **auth).json()] == [drill.pk, checkpoint.pk]
    assert client.post(f"{base}/{drill.pk}/ack", **auth).json()["state"] == "delivered"

    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="no heartbeat")
    assert client.get(base, **auth).json() == []
    client.force_login(team.member)
    listed = {c["id"]: c for c in client.get(f"/api/v1/runs/{run.pk}/commands").json()["items"]}
    assert listed[checkpoint.pk]["state"] == "expired"
    assert listed[checkpoint.pk]["result"] == {
        "reason": "the run was lost before its controller took this command; a restarted run does not get it again"}
    assert listed[drill.pk]["state"] == "expired" and listed[drill.pk]["acknowledged_at"] is not None

    again = client.post(f"{base}/{drill.pk}/ack", **auth)
    assert again.status_code == 200 and again.json()["state"] == "expired"
    late = client.post(f"{base}/{drill.pk}/result", data=json.dumps({"ok": True, "result": {"recovered_s": 2.5}}),
                       content_type="application/json", **auth)
    assert late.status_code == 200 and late.json()["state"] == "succeeded"
    listed = {c["id"]: c for c in client.get(f"/api/v1/runs/{run.pk}/commands").json()["items"]}
    assert (listed[drill.pk]["state"], listed[drill.pk]["result"]) == ("succeeded", {"recovered_s": 2.5})

    run_transition(run_id=run.pk, from_state=RunState.LOST, to_state=RunState.FAILED, reason="out of restarts")
    ended = client.post(f"{base}/{checkpoint.pk}/result", data=json.dumps({"ok": True, "result": {}}),
                        content_type="application/json", **auth)
    assert ended.status_code == 401
    assert Command.objects.get(pk=checkpoint.pk).state == CommandState.EXPIRED


def test_the_acknowledgement_says_whether_the_controller_may_run_the_command(client, team, monarch_running_run,
                                                                            running_run):
    """200 `delivered` (empty reason): the command is this controller's to run. 200 with any other state and its
    reason: it is not to be run (expired, or finished already), and it stays as it was. 404 naming command_id: the
    run has no such command. The OpenAPI document says so."""
    run, token = monarch_running_run
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    base = f"/api/v1/controller/runs/{run.pk}/commands"
    drill = command_create(actor=team.member, run=run, kind="fault_drill", payload=DRILL)
    taken = client.post(f"{base}/{drill.pk}/ack", **auth)
    assert taken.status_code == 200 and (taken.json()["state"], taken.json()["reason"]) == ("delivered", "")

    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    command_finish(run=run, command_id=checkpoint.pk, ok=True, result={"step": 4})
    finished = client.post(f"{base}/{checkpoint.pk}/ack", **auth)
    assert finished.status_code == 200 and finished.json()["state"] == "succeeded"
    assert finished.json()["reason"] == "it has a result already (succeeded)"

    pause = command_create(actor=team.member, run=run, kind="pause")
    run_transition(run_id=run.pk, from_state=RunState.RUNNING, to_state=RunState.LOST, reason="no heartbeat")
    expired = client.post(f"{base}/{pause.pk}/ack", **auth)
    assert expired.status_code == 200 and expired.json()["state"] == "expired"
    assert expired.json()["reason"] == ("the run was lost before its controller took this command; "
                                        "a restarted run does not get it again")
    pause.refresh_from_db()
    assert pause.state == CommandState.EXPIRED and pause.acknowledged_at is None, "an expired command stays expired"

    others = command_create(actor=team.member, run=running_run[0], kind="checkpoint")
    for command_id in (others.pk, 999_999_999, 2**63):
        missing = client.post(f"{base}/{command_id}/ack", **auth)
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"
        assert [e["field"] for e in missing.json()["errors"]] == ["command_id"], missing.json()
        gone = client.post(f"{base}/{command_id}/result", data=json.dumps({"ok": True, "result": {}}),
                           content_type="application/json", **auth)
        assert gone.status_code == 404 and [e["field"] for e in gone.json()["errors"]] == ["command_id"]
    assert Command.objects.get(pk=others.pk).state == CommandState.PENDING

    operation = client.get("/api/v1/openapi.json").json()["paths"][
        "/api/v1/controller/runs/{run_id}/commands/{command_id}/ack"]["post"]
    for words in ("`delivered`", "`expired`", "`command_id`", "reason"):
        assert words in operation["description"], words
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert "reason" in json.dumps(client.get("/api/v1/openapi.json").json()["components"]["schemas"][
        answer["$ref"].rsplit("/", 1)[1]]["properties"])
