"""The run queue: which queued runs start now, and which GPUs and slots they hold while active.

What a run needs and where it fits is runs/demand.py's. What a run holds is stored in `Run.allocation`
when it is claimed; capacity left free is the inventory minus the allocations of active runs.

Queued runs are taken by priority (higher first), then age. A run that does not fit blocks the
runs behind it that need the same kind of resource (no starvation of big runs); a run over its
project's quota waits without blocking others; a run that can never fit fails with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connection, transaction

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, require_operator
from forgeboard.audit.services import audit_record
from forgeboard.errors import ValidationFailed
from forgeboard.runs.demand import Allocation, Demand, HostRoom, inventory, never_fits, place, run_demand
from forgeboard.runs.models import EXTERNAL_BACKENDS, Run
from forgeboard.runs.services import IllegalTransition, run_transition
from forgeboard.runs.states import ACTIVE_STATES, RunState

logger = logging.getLogger(__name__)

MAX_QUOTA = 100_000
# Any constant shared by every scheduler: pg_advisory_xact_lock serializes them on PostgreSQL.
# (SQLite transactions here begin IMMEDIATE, which already takes the database's write lock.)
_SCHEDULER_LOCK_KEY = 0x46420001


@dataclass
class _Usage:
    runs: int = 0
    gpus: int = 0


@dataclass
class _Pass:
    room: dict[str, HostRoom]
    whole: dict[str, HostRoom]
    usage: dict[int, _Usage] = field(default_factory=dict)
    blocked: set[str] = field(default_factory=set)

    def hold(self, *, project_id: int, allocation: Allocation) -> None:
        used = self.usage.setdefault(project_id, _Usage())
        used.runs += 1
        for hostname, held in allocation.items():
            used.gpus += held.get("gpus", 0)
            if hostname in self.room:
                self.room[hostname].gpus -= held.get("gpus", 0)
                self.room[hostname].slots -= held.get("slots", 0)


def _within_quota(*, project: Project, demand: Demand, used: _Usage) -> bool:
    if project.max_concurrent_runs is not None and used.runs + 1 > project.max_concurrent_runs:
        return False
    return project.max_gpus is None or used.gpus + demand.gpus <= project.max_gpus


def _lock_scheduler() -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEDULER_LOCK_KEY])


def _fail_never_fits(*, run: Run, reason: str) -> None:
    try:
        run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
        run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
                       reason=f"cannot be scheduled: {reason}")
    except IllegalTransition:
        return  # cancelled meanwhile
    logger.warning("run %s can never fit: %s", run.pk, reason, extra={"run_id": run.pk})


def runs_schedule(*, now: datetime) -> list[int]:
    """Claim (queued→launching) the queued runs that fit now and return their ids, to hand to launch backends.

    Schedulers are serialized, so two of them never start one run twice or both spend the same capacity.
    """
    started: list[int] = []
    with transaction.atomic():
        _lock_scheduler()
        state = _Pass(room=inventory(usable_only=True), whole=inventory(usable_only=False))
        for run in Run.objects.filter(state__in=ACTIVE_STATES).select_related("experiment", "config").order_by("pk"):
            # A run started before the scheduler kept allocations holds what it asks for, where it fits.
            allocation = run.allocation or ({} if run.backend in EXTERNAL_BACKENDS else
                                            place(run_demand(run.config.run_config).pinned(known=state.whole), state.room)) or {}
            state.hold(project_id=run.experiment.project_id, allocation=allocation)
        queue = (Run.objects.filter(state=RunState.QUEUED).select_related("config", "experiment__project")
                 .order_by("-priority", "created_at", "pk"))
        for run in queue:
            demand = run_demand(run.config.run_config).pinned(known=state.whole)
            project = run.experiment.project
            if run.backend in EXTERNAL_BACKENDS:  # its cluster's scheduler queues and places it
                if _within_quota(project=project, demand=demand, used=state.usage.get(project.pk, _Usage())):
                    _claim(run=run, allocation={run.backend: {"gpus": demand.gpus, "slots": 0}}, state=state,
                           started=started, now=now)
                continue
            reason = never_fits(demand=demand, project=project, whole=state.whole)
            if reason:
                _fail_never_fits(run=run, reason=reason)
                continue
            if demand.resource in state.blocked:
                continue
            if not _within_quota(project=project, demand=demand, used=state.usage.get(project.pk, _Usage())):
                continue
            allocation = place(demand, state.room)
            if allocation is None:
                state.blocked.add(demand.resource)
                continue
            _claim(run=run, allocation=allocation, state=state, started=started, now=now)
    return started


def _claim(*, run: Run, allocation: Allocation, state: _Pass, started: list[int], now: datetime) -> None:
    try:
        run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING, allocation=allocation)
    except IllegalTransition:
        return  # cancelled meanwhile
    state.hold(project_id=run.experiment.project_id, allocation=allocation)
    started.append(run.pk)
    waited = max(0.0, (now - run.created_at).total_seconds())
    logger.info("run %s scheduled on %s after %.0f s", run.pk, ", ".join(allocation), waited, extra={"run_id": run.pk})


def _clean_quota(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_QUOTA:
        raise ValidationFailed.on(name, f"must be empty (unlimited) or an integer from 0 to {MAX_QUOTA}")
    return value


def project_quota_set(*, actor: Actor, project: Project, max_concurrent_runs: int | None,
                      max_gpus: int | None) -> Project:
    """Set a project's quotas (None: unlimited; 0 holds its queued runs). Platform operators only."""
    require_operator(actor=actor, action="changing project quotas")
    runs = _clean_quota("max_concurrent_runs", max_concurrent_runs)
    gpus = _clean_quota("max_gpus", max_gpus)
    with transaction.atomic():
        previous = {"max_concurrent_runs": project.max_concurrent_runs, "max_gpus": project.max_gpus}
        project.max_concurrent_runs, project.max_gpus = runs, gpus
        project.save(update_fields=["max_concurrent_runs", "max_gpus"])
        audit_record(actor=actor, action="project.quota", target=project, project=project,
                     payload={"from": previous, "to": {"max_concurrent_runs": runs, "max_gpus": gpus}})
    return project

