"""The Celery app. Imported by the worker (`celery -A workers.celery worker`) and by the control plane's
dispatch module (platform/forgeboard/dispatch.py), never by the engine; it imports no service.

Its tasks, and the queues each worker consumes besides those of `-Q`, are in workers/tasks.py (imported
here, by name, when the app is made); the task and queue names in forgeboard/dispatch.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_PLATFORM_DIR = str(Path(__file__).resolve().parents[1] / "platform")
if _PLATFORM_DIR not in sys.path:
    sys.path.insert(0, _PLATFORM_DIR)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")

import django  # noqa: E402
from celery import Celery  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:
    django.setup()

app = Celery("forgeboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"], related_name="tasks", force=True)
