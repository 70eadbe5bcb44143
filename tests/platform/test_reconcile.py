"""The reconciler: silent runs become lost, then restart from their checkpoint or fail with the reason; a silent run
being cancelled ends cancelled."""

from __future__ import annotations

import logging
from dataclasses import fields
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.runs.models import Command, CommandState, Run
from forgeboard.runs.reconcile import (HEARTBEAT_TIMEOUT_S, PREVIOUS_ATTEMPT_STOPPED, ReconcileReport,
                                       lost_attempt_finished, lost_attempt_stopped, runs_reconcile)
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.selectors import commands_pending
from forgeboard.runs.services import command_acknowledge, command_create, run_cancel, run_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.races import racing_an_open_transaction


@pytest.fixture
def launch(team, grpo_yaml):
    def _launch(*, state: RunState, heartbeat_age_s: float | None, max_restarts: int = 0, restarts: int = 0) -> Run:
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
        now = timezone.now()
        Run.objects.filter(pk=run.pk).update(
            state=state, max_restarts=max_restarts, restart_count=restarts,
            last_heartbeat_at=None if heartbeat_age_s is None else now - timedelta(seconds=heartbeat_age_s),
            state_changed_at=now - timedelta(seconds=600),
        )
        return Run.objects.get(pk=run.pk)
    return _launch


def test_fresh_heartbeats_are_left_alone(launch, django_capture_on_commit_callbacks):
    run = launch(state=RunState.RUNNING, heartbeat_age_s=5)
    report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)
    assert report.lost == [] and Run.objects.get(pk=run.pk).state == RunState.RUNNING


def test_silent_run_with_restarts_left_is_requeued(launch, django_capture_on_commit_callbacks):
    run = launch(state=RunState.RUNNING, heartbeat_age_s=120, max_restarts=2)
    with django_capture_on_commit_callbacks() as callbacks:
        report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)
    assert report.lost == [run.pk] and report.restarted == [run.pk]
    run.refresh_from_db()
    assert run.state == RunState.QUEUED and run.restart_count == 1 and run.pid is None
    assert "restart 1 of 2" in run.exit_reason and "no heartbeat for 120 s" in run.exit_reason
    assert len(callbacks) >= 1, "the relaunch is enqueued once the restart commits"
    path = [e.payload.get("to") for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]
    assert path[-2:] == ["lost", "queued"]
    assert RunEvent.objects.get(run=run, kind="restarted").payload["restart"] == 1


def test_a_restarted_run_has_the_heartbeat_timeout_to_report_again(launch, django_capture_on_commit_callbacks):
    run = launch(state=RunState.RUNNING, heartbeat_age_s=120, max_restarts=2)
    lost_at = timezone.now()
    with django_capture_on_commit_callbacks():
        runs_reconcile(now=lost_at, heartbeat_timeout_s=60)
    run.refresh_from_db()
    assert run.state == RunState.QUEUED and run.last_heartbeat_at is None, "the lost controller's heartbeat is gone"
    # Launched again: running as soon as its engine is started, which then takes a while to load and report.
    run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    running_at = Run.objects.get(pk=run.pk).state_changed_at
    report = runs_reconcile(now=running_at + timedelta(seconds=30), heartbeat_timeout_s=60)
    assert report.lost == [] and Run.objects.get(pk=run.pk).state == RunState.RUNNING
    with django_capture_on_commit_callbacks():
        report = runs_reconcile(now=running_at + timedelta(seconds=61), heartbeat_timeout_s=60)
    assert report.lost == [run.pk], "its new engine never reported: lost after the timeout, not before"
    assert Run.objects.get(pk=run.pk).restart_count == 2


def test_silent_run_out_of_restarts_fails_with_the_reason(launch):
    run = launch(state=RunState.PAUSED, heartbeat_age_s=300, max_restarts=1, restarts=1)
    report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)
    assert report.failed == [run.pk]
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.finished_at is not None
    assert "after 1 of 1 restarts" in run.exit_reason and "no heartbeat" in run.exit_reason


def test_run_that_never_reported_and_stuck_launch_are_lost(launch):
    never = launch(state=RunState.RUNNING, heartbeat_age_s=None)
    stuck = launch(state=RunState.LAUNCHING, heartbeat_age_s=None)
    report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60, launch_timeout_s=300)
    assert sorted(report.lost) == sorted([never.pk, stuck.pk])
    assert "still launching after 300 s" in Run.objects.get(pk=stuck.pk).exit_reason


def test_queued_and_finished_runs_are_not_touched(launch):
    queued = launch(state=RunState.QUEUED, heartbeat_age_s=None)
    done = launch(state=RunState.SUCCEEDED, heartbeat_age_s=999)
    runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)
    assert Run.objects.get(pk=queued.pk).state == RunState.QUEUED
    assert Run.objects.get(pk=done.pk).state == RunState.SUCCEEDED


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """The names of the Celery tasks sent to the broker (the machine's edge)."""
    from workers.celery import app

    names: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda name, **kw: names.append(name))
    return names


def _cancelled_ago(run: Run, seconds: float) -> None:
    Run.objects.filter(pk=run.pk).update(state_changed_at=timezone.now() - timedelta(seconds=seconds))


def test_a_silent_cancelling_run_ends_cancelled_with_the_reason_and_is_not_restarted(
        team, launch, sent, django_capture_on_commit_callbacks):
    """Its owner asked it to stop and its controller went silent before confirming: it is not lost, so not
    restarted (restarts remain), and its open commands expire as a cancelled run's."""
    run = launch(state=RunState.RUNNING, heartbeat_age_s=120, max_restarts=2)
    checkpoint = command_create(actor=team.member, run=run, kind="checkpoint")
    command_acknowledge(run=run, command_id=checkpoint.pk)
    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
    _cancelled_ago(run, 90)
    before = Run.objects.get(pk=run.pk).last_event_seq

    with django_capture_on_commit_callbacks(execute=True):
        report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60)

    assert report.cancelled == [run.pk]
    assert report.lost == report.restarted == report.failed == []
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.restart_count == 0 and run.finished_at is not None
    assert run.exit_reason == "cancelled; its controller stopped reporting before it confirmed (no heartbeat for 120 s)"
    events = list(RunEvent.objects.filter(run=run, seq__gt=before).order_by("seq"))
    assert (events[0].kind, events[0].payload["from"], events[0].payload["to"]) == (
        "state_changed", "cancelling", "cancelled")
    assert not [e for e in events if e.kind == "restarted" or e.payload.get("to") in ("lost", "queued")]
    assert sent == [], "no relaunch (nor a lost run's alert) is sent"
    assert list(commands_pending(run=run)) == []
    assert {c.kind: (c.state, c.result["reason"]) for c in Command.objects.filter(run=run)} == {
        "checkpoint": (CommandState.EXPIRED, ("the run was cancelled after its controller took this command but "
                                              "before it reported a result (it may have run)")),
        "cancel": (CommandState.EXPIRED, "the run was cancelled before its controller took this command"),
    }
    assert runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60) == ReconcileReport()


def _reconcile_summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The reconcile pass's summary lines; once a test in this process has run Monarch in it, Monarch's log filter
    prefixes every message with its actor ('[actor=<root>] '), so the summary is found where it starts."""
    messages = [r.getMessage() for r in caplog.records if r.name == "forgeboard.runs.reconcile"]
    return [m[m.index("reconcile: "):] for m in messages if "reconcile: " in m]


def test_the_reconcile_task_logs_and_returns_every_field_of_the_report_that_holds_runs(
        team, launch, sent, caplog, django_capture_on_commit_callbacks):
    """A pass that only ends a cancel (a field the task's summary once left out) says so; a pass with nothing to do
    says nothing."""
    from workers.tasks import reconcile_runs

    run = launch(state=RunState.RUNNING, heartbeat_age_s=120, max_restarts=2)
    run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))
    _cancelled_ago(run, 90)
    caplog.set_level(logging.INFO)
    with django_capture_on_commit_callbacks(execute=True):
        result = reconcile_runs()
    assert result["cancelled"] == [run.pk] and result["lost"] == result["leftover_unconfirmed"] == []
    said = _reconcile_summaries(caplog)
    assert said == [f"reconcile: cancelled [{run.pk}]"], said

    caplog.clear()
    reconcile_runs()
    assert not _reconcile_summaries(caplog)


def test_a_reports_summary_names_each_of_its_fields_that_holds_runs():
    names = [f.name for f in fields(ReconcileReport)]
    full = ReconcileReport(**{name: [index, index + 100] for index, name in enumerate(names, start=1)})
    assert full.summary() == ", ".join(f"{name} [{index}, {index + 100}]" for index, name in enumerate(names, start=1))
    assert ReconcileReport(leftover_stopping=[7]).summary() == "leftover_stopping [7]"
    assert ReconcileReport().summary() == ""


@pytest.mark.parametrize(("heartbeat_age_s", "cancelled_ago_s"), [(120, 30), (5, 600)],
                         ids=["cancelled-just-now", "still-reporting"])
def test_a_cancelling_run_is_left_to_confirm_its_cancel(team, launch, heartbeat_age_s, cancelled_ago_s):
    """Cancelled less than the timeout ago, a local run's supervisor is still stopping its engine; a controller
    still reporting is still stopping (a final checkpoint)."""
    run = launch(state=RunState.RUNNING, heartbeat_age_s=heartbeat_age_s, max_restarts=2)
    run_cancel(actor=team.member, run=run)
    _cancelled_ago(run, cancelled_ago_s)
    assert runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60) == ReconcileReport()
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLING


def test_a_local_supervisor_confirms_a_cancel_before_the_reconciler_would_end_the_run():
    """What lets the reconciler take a local run still cancelling after the heartbeat timeout for one without a
    supervisor: a live supervisor has stopped its engine and ended the run by then."""
    from workers.launch import local_supervisor

    worst = local_supervisor.POLL_SECONDS + local_supervisor.CANCEL_GRACE_SECONDS + local_supervisor.STOP_GRACE_SECONDS
    assert worst < HEARTBEAT_TIMEOUT_S


def test_a_run_cancelled_while_launching_whose_engine_never_started_ends_cancelled_and_frees_its_capacity(
        team, grpo_yaml, settings):
    settings.LOCAL_RUN_SLOTS = 1
    first = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    second = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    assert runs_schedule(now=timezone.now()) == [first.pk], "one slot: the first run holds it"
    run_cancel(actor=team.member, run=Run.objects.get(pk=first.pk))  # its supervisor never started
    _cancelled_ago(first, 90)
    assert runs_schedule(now=timezone.now()) == [], "a cancelling run still holds its slot"

    report = runs_reconcile(now=timezone.now(), heartbeat_timeout_s=60, launch_timeout_s=300)

    assert report.cancelled == [first.pk] and report.lost == []
    first.refresh_from_db()
    assert first.state == RunState.CANCELLED and first.restart_count == 0
    assert first.exit_reason == "cancelled; its controller never reported in (90 s after the cancel)"
    assert runs_schedule(now=timezone.now()) == [second.pk], "the cancelled run's slot is free"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["its stop confirmed", "its attempt found finished"])
def test_a_lost_runs_finished_attempt_and_its_confirmed_stop_have_exactly_one_winner(
        team, grpo_yaml, monkeypatch, first):
    """The supervisor (or job poller) that finds the lost run's attempt finished, and the worker that confirms that
    attempt stopped (and restarts the run), each claim the run under its row lock: the second, waiting for the first,
    finds the run moved on. A restarted run is not ended by its previous attempt; a finished run is not restarted."""
    from workers.celery import app

    monkeypatch.setattr(app, "send_task", lambda name, **kw: None)  # the restart's relaunch, at the broker (the edge)
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.LOST, max_restarts=2, pid=4242, host="gpu-node-7",
                                         exit_reason="no heartbeat for 75 s (timeout 60 s)")

    def stopped() -> bool:
        return lost_attempt_stopped(run_id=run.pk, job_id="", pid=4242,
                                    done="its engine (pid 4242 on gpu-node-7) had exited")

    def finished() -> bool:
        return lost_attempt_finished(run_id=run.pk, job_id="", pid=4242, to_state=RunState.SUCCEEDED,
                                     how="its engine exited 0 at 2026-12-06 17:33:26 UTC")

    if first == "its stop confirmed":
        assert racing_an_open_transaction(stopped, finished) is False
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
    else:
        assert racing_an_open_transaction(finished, stopped) is False
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.SUCCEEDED, 0, 4242)
        assert run.exit_reason == ("finished after it was taken for lost (no heartbeat for 75 s (timeout 60 s)): its "
                                   "engine exited 0 at 2026-12-06 17:33:26 UTC")
        assert not RunEvent.objects.filter(run=run, kind="message", payload__name=PREVIOUS_ATTEMPT_STOPPED).exists()
    moves = [e.payload["to"] for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]
    assert moves == ["queued", "queued" if first == "its stop confirmed" else "succeeded"]


def test_a_lost_runs_finished_attempt_ends_it_succeeded_or_failed_and_only_while_it_records_that_attempt(
        team, grpo_yaml):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(state=RunState.LOST, pid=4242)
    with pytest.raises(ValueError, match="succeeded or failed, not queued"):
        lost_attempt_finished(run_id=run.pk, job_id="", pid=4242, to_state=RunState.QUEUED, how="")
    assert not lost_attempt_finished(run_id=run.pk, job_id="", pid=4243, to_state=RunState.FAILED,
                                     how="another attempt's engine exited with code 1")
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
