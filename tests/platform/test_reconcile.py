"""The reconciler: silent runs become lost, then restart from their checkpoint or fail with the reason."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import runs_reconcile
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent


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
