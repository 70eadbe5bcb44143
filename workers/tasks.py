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
