"""The Celery app. Imported by the worker (`celery -A workers.celery worker`), never by the engine."""

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
