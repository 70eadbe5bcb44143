from __future__ import annotations

from django.db.models import QuerySet

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, project_role
from forgeboard.errors import NotFound, is_db_id
from forgeboard.runs.models import Command, CommandState, Run


def runs_for_project(*, project: Project, state: str | None = None) -> QuerySet[Run]:
    runs = Run.objects.filter(experiment__project=project).select_related("experiment", "launched_by")
    return runs.filter(state=state) if state else runs


def run_get(*, actor: Actor, run_id: int) -> Run:
    run = Run.objects.select_related("experiment__project", "config").filter(pk=run_id).first() if is_db_id(run_id) else None
    if run is None or project_role(actor=actor, project=run.experiment.project) is None:
        raise NotFound(f"no run {run_id}")
    return run


def commands_pending(*, run: Run, after_id: int = 0) -> QuerySet[Command]:
    """Commands the controller has not finished: pending, or delivered without a result (at-least-once)."""
    open_states = [CommandState.PENDING, CommandState.DELIVERED]
    return Command.objects.filter(run=run, state__in=open_states, pk__gt=after_id).order_by("pk")
