"""What a cluster scheduler's view of a run's job does to the run (SLURM and Kubernetes alike).

The engine reports its own progress and end through the API; the scheduler's view matters where
the engine cannot speak: a job still waiting in the queue, or one that ended without the engine
reporting (a failed node, a time limit, preemption, an image that does not pull).

A lost run is the reconciler's, which stops its job before it restarts it. A job found completed as the reconciler
takes its run for lost (silent: a long final checkpoint save), by a poll that then loses its move to it or by the stop
that looks at the job first, finished the run all the same: the run ends succeeded rather than restart and train again
(`lost_job_finished`). Any other end of a lost run's job is the reconciler's to act on: a job its stop cancels or
deletes reads as failed, as one that failed by itself does.

A running run whose job is back in the queue (SLURM requeued it) goes back to launching until its engine reports in
again (`_requeued`): SLURM restarts it, not the reconciler.

A launching run whose job the scheduler has running has `ENGINE_START_TIMEOUT_S` for its engine to report anything
(`_awaiting_engine`): one that never does (it hangs importing on a broken node, cannot reach the control plane, its
batch script waits on something) would hold its GPUs for ever. Its time in the queue does not count: the clock starts
when the scheduler started the job (squeue's start_time), or when the run last went launching if later; where the
scheduler does not say, at the poll that first saw its job running since then (its job_status events). Past it the run
is taken for lost, so the reconciler stops its job before it restarts or fails it. Any report makes the run running
(runs/services.py `run_reported_in`), so a run still launching has had none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import datetime, timezone as dt_timezone

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.telemetry.models import EventKind, RunEvent
from forgeboard.telemetry.services import event_append
from forgeboard.runs.demand import run_demand
from forgeboard.runs.reconcile import lost_attempt_finished
from forgeboard.runs.services import IllegalTransition, run_transition
from forgeboard.runs.states import RunState
from workers.launch.slurm import SchedulerStatus

# Runs whose job the scheduler may still hold: the pollers look at these.
FOLLOWED_STATES = (RunState.LAUNCHING, RunState.RUNNING, RunState.PAUSED, RunState.CANCELLING)


def node_shape(*, run: Run, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for a run on nodes of `gpus_per_node`: enough nodes for its GPUs and for every role whose
    procs_per_host spreads it over hosts (trainer ranks one to a host, say), at least one."""
    demand = run_demand(run.config.run_config)
    spread = max((math.ceil(role.procs / role.group) for role in demand.roles if role.distinct_hosts), default=1)
    nodes = max(1, math.ceil(demand.gpus / gpus_per_node), spread)
    return nodes, min(gpus_per_node, math.ceil(demand.gpus / nodes))


def named_hosts(*, run: Run) -> tuple[str, ...]:
    """The host names the run's roles are pinned to (placement.<role>.hosts): on a cluster, node names it needs."""
    return tuple(sorted({host for role in run_demand(run.config.run_config).roles for host in role.hosts}))


def fail_launch(*, run: Run, reason: str) -> None:
    """The run's launch submitted nothing (`reason` says why): it fails, or, cancelled while it was being submitted,
    ends cancelled now (no job is left for anyone to remove). A run that moved on otherwise is left as it is."""
    launch_failed(run_id=run.pk, reason=reason)


def launch_failed(*, run_id: int, reason: str) -> None:
    """The run's launch failed (`reason` says why; it may have raised anywhere): a launching run fails; one cancelled
    meanwhile ends cancelled now, with the reason, unless it records a job or an engine, which the job poller or its
    supervisor stops before it confirms the cancel. A run that moved on otherwise is left as it is. A launching run
    that fails with a job or an engine recorded has it stopped by the reconciler's passes (`leftover_stop_since`):
    nothing else follows a failed run's job."""
    recorded = Run.objects.filter(pk=run_id).exclude(job_id="", pid__isnull=True).exists()
    try:
        run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED, reason=reason,
                       **({"leftover_stop_since": timezone.now()} if recorded else {}))
        return
    except IllegalTransition:
        pass
    with transaction.atomic():
        if not Run.objects.select_for_update().filter(pk=run_id, state=RunState.CANCELLING, job_id="",
                                                      pid__isnull=True).exists():
            return
        run_transition(run_id=run_id, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                       reason=f"cancelled while it was being submitted, which failed: {reason}")


JOB_STATUS = "job_status"  # the run event (a message) that shows the scheduler's view of the run's job


def last_job_status(*, run: Run) -> dict | None:
    """The payload of the run's latest job_status event (None: none yet)."""
    return (RunEvent.objects.filter(run=run, kind=EventKind.MESSAGE, payload__name=JOB_STATUS)
            .order_by("-seq").values_list("payload", flat=True).first())


def record_job_status(*, run: Run, status: SchedulerStatus | None, backend: str, nodes_down: Mapping[str, str],
                      last: Mapping | None) -> bool:
    """A job_status event on the run when the scheduler's view of its job changed since `last` (its latest job_status,
    `last_job_status`): its state, its reason, the job's nodes that the scheduler has down; whether one was added."""
    if status is None:
        return False
    payload = {"name": JOB_STATUS, "backend": backend, "job_id": status.job_id, "state": status.state,
               "reason": status.reason, "nodes": status.nodes, "nodes_down": dict(nodes_down)}
    if last == payload:
        return False
    event_append(run=run, kind=EventKind.MESSAGE, payload=payload)
    return True


def follow_job(*, run: Run, status: SchedulerStatus | None, job: str, cancel: Callable[[], None]) -> str:
    """What one poll does to one run, given its job's status (None: the scheduler knows no such job).

    `job` names it for reasons ("SLURM job 18004"); `cancel` removes it from the scheduler.
    """
    state = RunState(run.state)
    try:
        if status is None:
            to_state = RunState.CANCELLED if state == RunState.CANCELLING else RunState.LOST
            run_transition(run_id=run.pk, from_state=state, to_state=to_state, reason=f"the scheduler no longer knows {job}")
            return str(to_state)
        if state == RunState.CANCELLING and status.state in ("queued", "launching"):
            cancel()  # no engine runs yet that could take the cancel command
            run_transition(run_id=run.pk, from_state=state, to_state=RunState.CANCELLED,
                           reason=f"cancelled while {job} was {status.reason}")
            return "cancelled in the queue"
        if state == RunState.CANCELLING and not status.terminal:
            waited = (timezone.now() - run.state_changed_at).total_seconds()
            if waited < settings.JOB_CANCEL_GRACE_S:
                return "waiting for the engine to stop"
            if status.completing:  # ended already (the engine's exit, an scancel): a second one would change nothing
                run_transition(run_id=run.pk, from_state=state, to_state=RunState.CANCELLED,
                               reason=f"cancelled; {job} has ended, but SLURM is {status.ending}")
                return "cancelled, its job still stopping"
            cancel()  # the engine has not stopped its job: the scheduler ends it
            run_transition(run_id=run.pk, from_state=state, to_state=RunState.CANCELLED,
                           reason=f"{job} removed by the scheduler: the engine had not stopped {round(waited)} s "
                                  "after the cancel")
            return "cancelled by the scheduler"
        if state in (RunState.RUNNING, RunState.PAUSED) and status.state in ("queued", "launching"):
            return _requeued(run=run, state=state, status=status, job=job)
        if state == RunState.LAUNCHING and status.state == "running":
            return _awaiting_engine(run=run, status=status, job=job)
        if not status.terminal:
            return status.state
        if state == RunState.CANCELLING:
            run_transition(run_id=run.pk, from_state=state, to_state=RunState.CANCELLED, reason=f"{job}: {status.reason}")
            return "cancelled"
        to_state = {"succeeded": RunState.SUCCEEDED, "failed": RunState.FAILED, "lost": RunState.LOST}[status.state]
        reason = f"{job}: {status.reason}"
        if to_state == RunState.SUCCEEDED and state == RunState.LAUNCHING:
            to_state = RunState.FAILED  # the engine never reported in: its job ending is not a finished run
            reason = f"{job} ended ({status.reason}) before the engine reported in"
        run_transition(run_id=run.pk, from_state=state, to_state=to_state, reason=reason)
        return str(to_state)
    except IllegalTransition:
        # Taken for lost meanwhile, its job completed all the same: it succeeded, unless its restart came first.
        if lost_job_finished(run=run, status=status, job=job):
            return "succeeded after it was taken for lost"
        return "moved meanwhile"


def _requeued(*, run: Run, state: RunState, status: SchedulerStatus, job: str) -> str:
    """The running run's job is back in the scheduler's queue: SLURM requeued it (a node failure with --requeue,
    `scontrol requeue`), and starts its engine again when it runs it. The run goes back to launching, said once on its
    timeline with the scheduler's reason and restart count, and is followed there as a queued job is: not lost for
    its silence meanwhile, nor restarted beside it (its engine's next report makes it running again). Its own restarts
    (`max_restarts`) are not spent: the scheduler restarts it, under its own limits."""
    run_transition(run_id=run.pk, from_state=state, to_state=RunState.LAUNCHING, last_heartbeat_at=None,
                   reason=f"{job} is back in the scheduler's queue: {status.reason}")
    return "requeued"


def _awaiting_engine(*, run: Run, status: SchedulerStatus, job: str) -> str:
    """The launching run's job is running and its engine has not reported in: the run is lost once its job has run for
    `ENGINE_START_TIMEOUT_S`, said with how long and on which nodes. The clock starts when the scheduler started the
    job (`status.started_at`), or when the run last went launching if that is later (an earlier run of the job, a job
    id used again); where the scheduler does not say, at the poll that first saw the job running since the run went
    launching. Where no job_status since then says its job runs (Kubernetes records none of its own), the poll records
    one: that clock starts now."""
    since = job_running_since(run=run, job_id=status.job_id, started_at=status.started_at)
    if since is None:  # the clock starts now
        record_job_status(run=run, status=status, backend=run.backend, nodes_down={}, last=None)
        return status.state
    ran = (timezone.now() - since).total_seconds()
    if ran < settings.ENGINE_START_TIMEOUT_S:
        return status.state
    on = f" on {status.nodes}" if status.nodes else ""
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.LOST,
                   reason=f"{job} ran for {round(ran)} s{on} and its engine never reported in "
                          f"(start-up timeout {settings.ENGINE_START_TIMEOUT_S} s)")
    return str(RunState.LOST)


def job_running_since(*, run: Run, job_id: str, started_at: float | None = None) -> datetime | None:
    """Since when the run's job `job_id` has been running, since the run last went launching. With `started_at` (when
    the scheduler says it started the job, epoch seconds), the later of that and the run's move to launching. Without,
    as its polls saw it: when the first job_status event after that move said it was running, with none saying
    otherwise since (None: none says so)."""
    entered = (RunEvent.objects.filter(run=run, kind=EventKind.STATE_CHANGED, payload__to=RunState.LAUNCHING)
               .order_by("-seq").values_list("seq", "created_at").first())
    if started_at is not None:
        started = datetime.fromtimestamp(started_at, tz=dt_timezone.utc)
        return max(started, entered[1]) if entered else started
    statuses = (RunEvent.objects.filter(run=run, kind=EventKind.MESSAGE, payload__name=JOB_STATUS,
                                        seq__gt=entered[0] if entered else 0)
                .order_by("seq").values_list("payload", "created_at"))
    since = None
    for payload, at in statuses:
        running = payload.get("state") == "running" and payload.get("job_id") == job_id
        since = (since or at) if running else None
    return since


def lost_job_finished(*, run: Run, status: SchedulerStatus | None, job: str) -> bool:
    """Whether the lost run's job completed (its engine finished the run after it was taken for lost), and the run,
    still recording that job, ended succeeded for it; any other status leaves it as it is."""
    if status is None or status.state != "succeeded":
        return False
    return lost_attempt_finished(run_id=run.pk, job_id=run.job_id, pid=run.pid, to_state=RunState.SUCCEEDED,
                                 how=f"{job}: {status.reason}")
