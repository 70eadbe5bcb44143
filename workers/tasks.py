"""Celery tasks: thin, take IDs, call services. Long runs are never held inside a task."""

from __future__ import annotations

import logging

from celery import shared_task

from forgeboard.errors import NotFound
from forgeboard.logs import run_log_context
from forgeboard.runs.services import IllegalTransition, run_transition
from forgeboard.runs.states import RunState

logger = logging.getLogger(__name__)


@shared_task(name="runs.launch", acks_late=True)
def launch_run(run_id: int) -> str:
    """Claim a queued run (only one worker can) and hand it to its launch backend."""
    with run_log_context(run_id):
        try:
            run_transition(run_id=run_id, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
        except (IllegalTransition, NotFound) as exc:
            logger.info("launch skipped: %s", exc)
            return "skipped"
        from workers.launch.backends import start_run

        start_run(run_id=run_id)
        return "launched"


@shared_task(name="runs.reconcile")
def reconcile_runs() -> dict:
    """Periodic: lost runs are restarted from their checkpoint or failed (see runs/reconcile.py)."""
    from django.utils import timezone

    from forgeboard.runs.reconcile import runs_reconcile

    report = runs_reconcile(now=timezone.now())
    if report.lost or report.restarted or report.failed:
        logger.info("reconcile: lost %s, restarted %s, failed %s", report.lost, report.restarted, report.failed)
    return {"lost": report.lost, "restarted": report.restarted, "failed": report.failed}


@shared_task(name="cluster.mark_down_hosts")
def mark_down_hosts() -> list[int]:
    """Periodic: hosts that stopped heartbeating are marked down; returns the active runs that were on them."""
    from django.conf import settings
    from django.utils import timezone

    from forgeboard.cluster.services import hosts_mark_down

    marked = hosts_mark_down(now=timezone.now(), timeout_s=settings.HOST_HEARTBEAT_TIMEOUT_S)
    for down in marked:
        logger.warning("host %s is down; active runs on it: %s", down.host.hostname, down.run_ids)
    return [run_id for down in marked for run_id in down.run_ids]
