"""The reconciler: runs whose heartbeats stopped become lost; lost runs restart or fail.

Called periodically by the `runs.reconcile` Celery task. Every change goes through
`run_transition`, so a reconciler racing a late heartbeat or another reconciler is harmless.

A run being cancelled is never lost: its owner asked it to stop, so a restart would spend its GPUs again on a run
nobody wants. Whoever stops a run's processes confirms its cancel (a local run's supervisor, `runs.poll_jobs` for a
SLURM or Kubernetes job); when none has, the reconciler ends the run cancelled, with the reason (`_cancels_end`).

A lost run is silent, not necessarily dead (a hung engine, a partitioned controller): before it restarts, its
token is revoked (its old controller can no longer report into the new attempt) and what its previous attempt left is
stopped (`_ask_stop`): its SLURM job scancelled or its Kubernetes Job deleted by a worker of that scheduler, its local
engine's process group killed by a worker on the engine's host. The run restarts once that is confirmed
(`lost_attempt_stopped`); until then each pass asks again, and a stop that fails is said on its timeline
(`lost_attempt_not_stopped`). One still not confirmed after the stop timeout fails the run rather than run twice.
A local engine on a host the inventory has down cannot be reached: the run restarts without stopping it (never on
that host), and its timeline says what may be left there.

Silent is not unfinished either: a run taken for lost (a long final checkpoint save) may finish all the same. The
party that watches its attempt (the local engine's supervisor, the job poller, the stop that finds the job completed)
then ends it as the attempt ended (`lost_attempt_finished`) instead of it restarting and training again, as long as
it still records that attempt; that and the stop's confirmation each claim the run under its row lock, so exactly one
wins: a run that finished is not restarted, and a restarted run is not ended by its previous attempt. A local
engine's stop is confirmed only once its supervisor has exited too (workers/launch/local_supervisor.py).

A run that fails instead (out of restarts, or its stop not confirmed in time) is not reopened, but what its last
attempt left is followed all the same: the run records since when (`Run.leftover_stop_since`), each pass asks again
(`_follow_leftover`) until a worker confirms it gone, said on the timeline; one not confirmed within the stop timeout
is given up on, and the timeline names what may be left running (`PREVIOUS_ATTEMPT_NOT_CONFIRMED`). A run failed only
for being lost whose attempt is then found to have finished (its engine exited 0, its job completed) succeeded after
all (`lost_attempt_finished`: failed -> succeeded, the one move out of an end state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from forgeboard.cluster.models import Host, HostLiveness
from forgeboard.dispatch import RUNS_STOP_ATTEMPT, enqueue, pool_launch_queue, probe_queue
from forgeboard.runs.models import EXTERNAL_BACKENDS, LaunchBackend, Run
from forgeboard.runs.services import IllegalTransition, run_enqueue_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_tokens_revoke
from forgeboard.telemetry.models import EventKind, RunEvent
from forgeboard.telemetry.services import event_append

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 300
STOP_TIMEOUT_S = 900  # a lost run whose previous attempt is not confirmed stopped within this fails
STOP_ASK_EXPIRES_S = 60  # an ask to stop that no worker took by then is dropped: the next pass asks again
WATCHED_STATES = (RunState.RUNNING, RunState.PAUSED)
PREVIOUS_ATTEMPT_STOPPED = "previous_attempt_stopped"  # run events (messages) on the timeline
PREVIOUS_ATTEMPT_NOT_STOPPED = "previous_attempt_not_stopped"
PREVIOUS_ATTEMPT_NOT_CONFIRMED = "previous_attempt_not_confirmed"  # a failed run's, given up on


@dataclass
class ReconcileReport:
    lost: list[int] = field(default_factory=list)
    restarted: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    stopping: list[int] = field(default_factory=list)  # lost runs waiting for their previous attempt to be stopped
    leftover_stopping: list[int] = field(default_factory=list)  # failed runs whose last attempt is asked to stop again
    leftover_unconfirmed: list[int] = field(default_factory=list)  # ... and those given up on (said on the timeline)

    def summary(self) -> str:
        """Every field that holds runs, by name, with their ids ("" when none does): a field added is said too."""
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name))


def runs_reconcile(
    *, now: datetime, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, launch_timeout_s: int = LAUNCH_TIMEOUT_S,
    stop_timeout_s: int = STOP_TIMEOUT_S,
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
    # Before the lost runs: one that fails below is asked to stop there, not a second time in this pass.
    for run in Run.objects.filter(state=RunState.FAILED, leftover_stop_since__isnull=False):
        if _follow_leftover(run=run, now=now, stop_timeout_s=stop_timeout_s):
            report.leftover_stopping.append(run.pk)
        else:
            report.leftover_unconfirmed.append(run.pk)
    outcomes = {"restarted": report.restarted, "failed": report.failed, "stopping": report.stopping}
    for run in Run.objects.filter(state=RunState.LOST):
        outcome = _restart_or_fail(run=run, now=now, stop_timeout_s=stop_timeout_s)
        if outcome in outcomes:
            outcomes[outcome].append(run.pk)
    if summary := report.summary():
        logger.info("reconcile: %s", summary)
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


def previous_attempt(run: Run) -> str:
    """What the run's previous attempt may have left running, in words ("" when nothing): its job, or its engine."""
    return _attempt(backend=run.backend, job_id=run.job_id, pid=run.pid, host=run.host)


def _attempt(*, backend: str, job_id: str, pid: int | None, host: str) -> str:
    if backend == LaunchBackend.SLURM:
        return f"SLURM job {job_id}" if job_id else ""
    if backend == LaunchBackend.KUBERNETES:
        return f"Kubernetes Job {job_id}" if job_id else ""
    return f"its engine (pid {pid} on {host})" if pid is not None else ""


def left_running(run: Run) -> str:
    """What a previous attempt not confirmed stopped may have left running, as an operator would find it."""
    if run.backend in EXTERNAL_BACKENDS:
        return previous_attempt(run)
    return f"its engine's process group {run.pid} on {run.host}"


def _engine_host_down(run: Run) -> bool:
    """Whether the run's local engine is on a host the inventory has down: no worker there takes the ask to stop it,
    and the scheduler places nothing on that host, the restarted run included."""
    return (run.backend not in EXTERNAL_BACKENDS
            and Host.objects.filter(hostname=run.host, liveness=HostLiveness.DOWN).exists())


def _ask_stop(run: Run) -> None:
    """Ask a worker that can reach it to stop the run's previous attempt (workers/launch/backends.py `stop_attempt`):
    one of its scheduler's workers, or for a local engine one on the engine's host (its probe queue)."""
    queue = pool_launch_queue(run.backend) if run.backend in EXTERNAL_BACKENDS else probe_queue(run.host)
    enqueue(RUNS_STOP_ATTEMPT, kwargs={"run_id": run.pk, "job_id": run.job_id, "pid": run.pid, "host": run.host},
            queue=queue, expires=STOP_ASK_EXPIRES_S)


def _restart_or_fail(*, run: Run, now: datetime, stop_timeout_s: int, stopped: str = "") -> str:
    """Requeue a lost run (it resumes from its newest checkpoint) while restarts remain, once its previous attempt is
    stopped (`stopped`: the one a worker has just confirmed, in words); else fail it. "restarted", "stopping" (asked to
    stop its previous attempt), "failed" or "moved".

    Its timeline says why once, on the state change to queued (the restart's count and the reason it was lost); the
    restarted event says what is new: the attempt now queued, and what of the previous one was stopped or not."""
    left = previous_attempt(run)
    not_stopped = ""
    # A run that fails with something left asks it to stop now, and every pass after (`_follow_leftover`).
    leftover = {"leftover_stop_since": now} if left else {}
    try:
        if run.restart_count >= run.max_restarts:
            run_transition(
                run_id=run.pk, from_state=RunState.LOST, to_state=RunState.FAILED,
                reason=f"lost ({run.exit_reason or 'no reason given'}) after {run.restart_count} of "
                       f"{run.max_restarts} restarts", **leftover,
            )
            if left:
                _ask_stop(run)
            return "failed"
        run_tokens_revoke(run=run)  # the lost controller may still be alive: it must not report into the restart
        if left and _engine_host_down(run):
            lost_attempt_not_stopped(
                run_id=run.pk, job_id=run.job_id, pid=run.pid,
                problem=f"{run.host} is down: its engine cannot be reached to stop it, so the run restarts without "
                        f"that, on another host; if {run.host} comes back with it running, stop its process group "
                        f"{run.pid} there")
            left, not_stopped = "", left
        if left:
            waited = (now - run.state_changed_at).total_seconds()
            if waited >= stop_timeout_s:
                run_transition(
                    run_id=run.pk, from_state=RunState.LOST, to_state=RunState.FAILED,
                    reason=f"lost ({run.exit_reason or 'no reason given'}); not restarted: {left} could not be "
                           f"confirmed stopped within {stop_timeout_s} s, and two attempts must not run at once",
                    **leftover,
                )
                _ask_stop(run)
                return "failed"
            _ask_stop(run)
            return "stopping"
        with transaction.atomic():
            run_transition(run_id=run.pk, from_state=RunState.LOST, to_state=RunState.QUEUED,
                           reason=f"restart {run.restart_count + 1} of {run.max_restarts}: {run.exit_reason}",
                           # The lost controller's last heartbeat is not the new one's: kept, it would have the
                           # restarted run lost again as soon as it is running, before its engine could report.
                           restart_count=F("restart_count") + 1, pid=None, job_id="", last_heartbeat_at=None)
            previous = {"stopped": stopped} if stopped else {"not_stopped": not_stopped} if not_stopped else {}
            event_append(run=run, kind=EventKind.RESTARTED,
                         payload={"restart": run.restart_count + 1, "of": run.max_restarts,
                                  "attempt": run.restart_count + 2} | previous)
            transaction.on_commit(lambda: run_enqueue_launch(run.pk))
        return "restarted"
    except IllegalTransition:
        return "moved"


def _follow_leftover(*, run: Run, now: datetime, stop_timeout_s: int) -> bool:
    """Ask again to stop what a failed run's last attempt left, until the stop timeout; then give up on it, saying on
    the run's timeline what may be left running. Whether it was asked."""
    if (now - run.leftover_stop_since).total_seconds() < stop_timeout_s:
        _ask_stop(run)
        return True
    # Unless a worker confirmed it meanwhile (lost_attempt_stopped clears it too): said once.
    if Run.objects.filter(pk=run.pk, leftover_stop_since=run.leftover_stop_since).update(leftover_stop_since=None):
        left = left_running(run)
        problem = (f"not confirmed stopped in the {_duration(stop_timeout_s)} after the run failed: {left} may still "
                   "be running; stopping it is left to an operator")
        event_append(run=run, kind=EventKind.MESSAGE, payload={
            "name": PREVIOUS_ATTEMPT_NOT_CONFIRMED, "attempt": previous_attempt(run), "left": left, "problem": problem})
        logger.warning("run %s: %s", run.pk, problem, extra={"run_id": run.pk})
    return False


def _duration(seconds: int) -> str:
    if seconds % 60:
        return f"{seconds} s"
    return "1 minute" if seconds == 60 else f"{seconds // 60} minutes"


def _still_recorded(*, run_id: int, job_id: str, pid: int | None) -> Q:
    """The run, while it still records this attempt as its own (a restart clears it)."""
    return Q(pk=run_id, job_id=job_id) & (Q(pid=pid) if pid is not None else Q(pid__isnull=True))


def lost_attempt_recorded(*, run_id: int, job_id: str, pid: int | None) -> bool:
    """Whether the run still records this attempt as one to stop (lost, or failed with it left): a late ask to stop
    one already stopped and restarted, or confirmed gone or given up on, must touch nothing, least of all the new
    attempt."""
    to_stop = Q(state=RunState.LOST) | Q(state=RunState.FAILED, leftover_stop_since__isnull=False)
    return Run.objects.filter(_still_recorded(run_id=run_id, job_id=job_id, pid=pid), to_stop).exists()


def lost_attempt_stopped(*, run_id: int, job_id: str, pid: int | None, done: str) -> bool:
    """The lost run's previous attempt is confirmed gone (`done` says how): said on its timeline, and the run restarts
    now if it waited for that; a failed run's is no longer followed (it keeps its job id and pid). A run that no
    longer records the attempt (ended meanwhile as its attempt did: `lost_attempt_finished`) is left as it is.
    Whether it restarted."""
    with transaction.atomic():
        recorded = _still_recorded(run_id=run_id, job_id=job_id, pid=pid)
        cleared = Run.objects.filter(recorded, state=RunState.LOST).update(job_id="", pid=None)
        followed = Run.objects.filter(recorded, state=RunState.FAILED, leftover_stop_since__isnull=False).update(
            leftover_stop_since=None)
        if not cleared and not followed:
            logger.info("run %s: %s; the run no longer records that attempt", run_id, done, extra={"run_id": run_id})
            return False
        run = Run.objects.get(pk=run_id)
        event_append(run=run, kind=EventKind.MESSAGE, payload={"name": PREVIOUS_ATTEMPT_STOPPED, "detail": done})
    logger.info("run %s: %s", run_id, done, extra={"run_id": run_id})
    if not cleared:
        return False
    stopped = _attempt(backend=run.backend, job_id=job_id, pid=pid, host=run.host)
    return _restart_or_fail(run=run, now=timezone.now(), stop_timeout_s=STOP_TIMEOUT_S, stopped=stopped) == "restarted"


def lost_attempt_finished(*, run_id: int, job_id: str, pid: int | None, to_state: RunState, how: str) -> bool:
    """The lost run's attempt ended by itself after all (`how`: its engine exited 0 at ..., its job completed): the
    run ends as it did, succeeded or failed, instead of restarting, while it is still lost and records that attempt.
    Said by whoever watches the attempt; claimed under the run's row lock, as the attempt's confirmed stop is
    (`lost_attempt_stopped`, which clears the attempt and restarts the run), so exactly one of them wins. The reason
    says both: why the run was taken for lost, and how its attempt ended.

    A run the reconciler failed only because it was lost (out of restarts, or its attempt not confirmed stopped in
    time) whose attempt, still followed (`leftover_stop_since`), turns out to have finished, succeeded after all: it
    moves failed -> succeeded (states.py `LATE_OUTCOMES`), with both on its timeline. Silence is not failure: a long
    final checkpoint save, or a partition while it was written, must not cost a finished run its result. An attempt
    that failed leaves a failed run as it is. Whether it ended the run."""
    if to_state not in (RunState.SUCCEEDED, RunState.FAILED):
        raise ValueError(f"a lost run's finished attempt ends it succeeded or failed, not {to_state}")
    followed = Q(state=RunState.LOST) | Q(state=RunState.FAILED, leftover_stop_since__isnull=False)
    with transaction.atomic():
        found = (Run.objects.select_for_update()
                 .filter(_still_recorded(run_id=run_id, job_id=job_id, pid=pid), followed)
                 .values_list("state", "exit_reason").first())
        if found is None:
            return False
        state, because = found
        if state == RunState.LOST:
            ended = "finished" if to_state == RunState.SUCCEEDED else "failed"
            reason = f"{ended} after it was taken for lost ({because or 'no reason given'}): {how}"
            run_transition(run_id=run_id, from_state=RunState.LOST, to_state=to_state, reason=reason)
        elif to_state == RunState.SUCCEEDED and failed_for_lost(run_id=run_id):
            reason = f"finished after all: it had failed ({because or 'no reason given'}), then {how}"
            run_transition(run_id=run_id, from_state=RunState.FAILED, to_state=RunState.SUCCEEDED, reason=reason,
                           late_outcome=True, leftover_stop_since=None)
        else:
            return False
    logger.info("run %s %s", run_id, reason, extra={"run_id": run_id})
    return True


def failed_for_lost(*, run_id: int) -> bool:
    """Whether the run failed because the reconciler gave up on it lost, not for a failure of its own."""
    return RunEvent.objects.filter(run_id=run_id, kind=EventKind.STATE_CHANGED, payload__from=RunState.LOST,
                                   payload__to=RunState.FAILED).exists()


def lost_attempt_not_stopped(*, run_id: int, job_id: str, pid: int | None, problem: str) -> None:
    """A worker could not stop (or not yet confirm stopped) the lost run's previous attempt: said on its timeline
    once per distinct problem; the reconciler asks again."""
    run = Run.objects.get(pk=run_id)
    payload = {"name": PREVIOUS_ATTEMPT_NOT_STOPPED, "attempt": previous_attempt(run), "problem": problem}
    last = (RunEvent.objects.filter(run=run, kind=EventKind.MESSAGE, payload__name=PREVIOUS_ATTEMPT_NOT_STOPPED)
            .order_by("-seq").values_list("payload", flat=True).first())
    if last != payload:
        event_append(run=run, kind=EventKind.MESSAGE, payload=payload)
    logger.warning("run %s: %s not stopped: %s", run_id, payload["attempt"], problem, extra={"run_id": run_id})
