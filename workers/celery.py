"""The Celery app. Imported by the worker (`celery -A workers.celery worker`) and by the control plane's
dispatch module (platform/forgeboard/dispatch.py), never by the engine; it imports no service.

Its tasks, and the queues each worker consumes besides those of `-Q`, are in workers/tasks.py (imported
here, by name, when the app is made); the task and queue names in forgeboard/dispatch.py.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_PLATFORM_DIR = str(Path(__file__).resolve().parents[1] / "platform")
if _PLATFORM_DIR not in sys.path:
    sys.path.insert(0, _PLATFORM_DIR)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")

import django  # noqa: E402
from celery import Celery, signals  # noqa: E402
from celery.app import trace  # noqa: E402
from django.apps import apps  # noqa: E402
from django.conf import settings  # noqa: E402

if not apps.ready:
    django.setup()

app = Celery("forgeboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"], related_name="tasks", force=True)


# The lines Celery logs at INFO for a task sent by beat, received and succeeded, and where each names the task.
ROUTINE_LINES = {
    ("celery.beat", "Scheduler: Sending due task %s (%s)"): lambda args: args[1],
    ("celery.worker.strategy", trace.LOG_RECEIVED): lambda args: args["name"],
    ("celery.app.trace", trace.LOG_SUCCESS): lambda args: args["name"],
}


class QuietRoutineTasks(logging.Filter):
    """Drops those lines for the beat schedule's own tasks: its housekeeping (scheduling, reconciling, probing hosts)
    every few seconds would bury what a worker's console is for. What such a task does it logs itself, a failure is
    an ERROR and stays, and a worker at --loglevel debug shows every line."""

    def __init__(self, task_names: set[str]):
        super().__init__()
        self.task_names = frozenset(task_names)

    def filter(self, record: logging.LogRecord) -> bool:
        task_name = ROUTINE_LINES.get((record.name, record.msg))
        if task_name is None or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        try:
            return task_name(record.args) not in self.task_names
        except (KeyError, IndexError, TypeError):
            return True


@signals.after_setup_logger.connect
def _quiet_routine_tasks(logger: logging.Logger, **_: object) -> None:
    routine = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    for handler in logger.handlers:
        handler.addFilter(QuietRoutineTasks(routine))
