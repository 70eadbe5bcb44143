"""The reconciler: runs whose heartbeats stopped become lost; lost runs restart or fail.

Called periodically by the `runs.reconcile` Celery task. Every change goes through
`run_transition`, so a reconciler racing a late heartbeat or another reconciler is harmless.

A run being cancelled is never lost: its owner asked it to stop, so a restart would spend its GPUs again on a run
nobody wants. Whoever stops a run's processes confirms its cancel (a local run's supervisor, `runs.poll_jobs` for a
SLURM or Kubernetes job); when none has, the reconciler ends the run cancelled, with the reason (`_cancels_end`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q

from forgeboard.runs.models import EXTERNAL_BACKENDS, Run
from forgeboard.runs.services import IllegalTransition, run_enqueue_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import EventKind
from forgeboard.telemetry.services import event_append

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 300
WATCHED_STATES = (RunState.RUNNING, RunState.PAUSED)


@dataclass
class ReconcileReport:
    lost: list[int] = field(default_factory=list)
    restarted: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)


def runs_reconcile(
    *, now: datetime, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, launch_timeout_s: int = LAUNCH_TIMEOUT_S
) -> ReconcileReport:
    report = ReconcileReport()
    silent_since = now - timedelta(seconds=heartbeat_timeout_s)
    silent = Q(last_heartbeat_at__lt=silent_since) | Q(last_heartbeat_at__isnull=True, state_changed_at__lt=silent_since)
    stale = Run.objects.filter(silent, state__in=WATCHED_STATES)
    # A cluster scheduler may hold a run's job in its queue for hours: runs/poll_jobs follows those.
    stuck = Run.objects.filter(state=RunState.LAUNCHING,
                               state_changed_at__lt=now - timedelta(seconds=launch_timeout_s)
                               ).exclude(backend__in=EXTERNAL_BACKENDS)
    for run in [*stale, *stuck]:
        seen = run.last_heartbeat_at or run.state_changed_at
        reason = f"no heartbeat for {int((now - seen).total_seconds())} s (timeout {heartbeat_timeout_s} s)"
        if run.state == RunState.LAUNCHING:
            reason = f"still launching after {launch_timeout_s} s"
        try:
            run_transition(run_id=run.pk, from_state=RunState(run.state), to_state=RunState.LOST, reason=reason)
            report.lost.append(run.pk)
        except IllegalTransition:
            continue  # it moved on by itself meanwhile
    report.cancelled = _cancels_end(now=now, silent=silent, heartbeat_timeout_s=heartbeat_timeout_s,
                                    launch_timeout_s=launch_timeout_s)
    for run in Run.objects.filter(state=RunState.LOST):
        if _restart_or_fail(run=run):
            report.restarted.append(run.pk)
        else:
            report.failed.append(run.pk)
    return report


def _cancels_end(*, now: datetime, silent: Q, heartbeat_timeout_s: int, launch_timeout_s: int) -> list[int]:
    """End as cancelled the silent runs whose cancel nobody confirmed within the timeout; their ids.

    A local run's supervisor stops its engine and confirms within `local_supervisor.CANCEL_GRACE_SECONDS` and
    `STOP_GRACE_SECONDS` of the cancel, well within the heartbeat timeout: a local run still cancelling then has no
    supervisor left. A SLURM or Kubernetes run with a job is left to runs/poll_jobs, which removes the job if the
    engine has not stopped it (`JOB_CANCEL_GRACE_S`): ended here, its job would run on, followed by nobody. One
    without a job never got one (its launch failed, or its worker died, while it was cancelled) or is being
    submitted: it waits the launch timeout, longer than a submission takes.
    """
    cancelled_before = now - timedelta(seconds=heartbeat_timeout_s)
    unconfirmed = Run.objects.filter(silent, state=RunState.CANCELLING, state_changed_at__lt=cancelled_before).filter(
        ~Q(backend__in=EXTERNAL_BACKENDS)
        | Q(job_id="", state_changed_at__lt=now - timedelta(seconds=launch_timeout_s)))
    ended = []
    for run in unconfirmed:
        if run.last_heartbeat_at is None:
            reason = (f"cancelled; its controller never reported in "
                      f"({int((now - run.state_changed_at).total_seconds())} s after the cancel)")
        else:
            reason = (f"cancelled; its controller stopped reporting before it confirmed "
                      f"(no heartbeat for {int((now - run.last_heartbeat_at).total_seconds())} s)")
        try:
            run_transition(run_id=run.pk, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED, reason=reason)
        except IllegalTransition:
            continue  # confirmed meanwhile
        logger.info("run %s %s", run.pk, reason, extra={"run_id": run.pk})
        ended.append(run.pk)
    return ended


def _restart_or_fail(*, run: Run) -> bool:
    """Requeue a lost run (it resumes from its newest checkpoint) while restarts remain; else fail it."""
    try:
        if run.restart_count >= run.max_restarts:
            run_transition(
                run_id=run.pk, from_state=RunState.LOST, to_state=RunState.FAILED,
                reason=f"lost ({run.exit_reason or 'no reason given'}) after {run.restart_count} of "
                       f"{run.max_restarts} restarts",
            )
            return False
        with transaction.atomic():
            run_transition(run_id=run.pk, from_state=RunState.LOST, to_state=RunState.QUEUED,
                           reason=f"restart {run.restart_count + 1} of {run.max_restarts}: {run.exit_reason}",
                           # The lost controller's last heartbeat is not the new one's: kept, it would have the
                           # restarted run lost again as soon as it is running, before its engine could report.
                           restart_count=F("restart_count") + 1, pid=None, last_heartbeat_at=None)
            event_append(run=run, kind=EventKind.RESTARTED,
                         payload={"restart": run.restart_count + 1, "of": run.max_restarts,
                                  "after": run.exit_reason})
            transaction.on_commit(lambda: run_enqueue_launch(run.pk))
        return True
    except IllegalTransition:
        return False
