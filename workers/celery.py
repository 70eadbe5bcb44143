"""The Celery app. Imported by the worker (`celery -A workers.celery worker`), never by the engine.

Every worker also consumes, whatever `-Q` says, `launch.<FORGEBOARD_WORKER_POOL>` (default
`launch.default`): the runs that the scheduler placed on hosts of that pool are started from there;
and `probe.<its hostname>`: the `cluster.probe` beat task asks each worker-reported host to report
itself there, and a worker reports its host as soon as it is ready. A worker with
FORGEBOARD_SLURM_PARTITION also consumes `launch.slurm` (it submits SLURM runs and polls their jobs),
and one with FORGEBOARD_K8S_API_URL and FORGEBOARD_K8S_IMAGE `launch.kubernetes`.
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
from celery.signals import celeryd_after_setup, worker_ready  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:
    django.setup()

app = Celery("forgeboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"], related_name="tasks", force=True)


@celeryd_after_setup.connect
def _consume_pool_queue(sender: str, instance, **_kwargs) -> None:
    """Subscribe this worker to its pool's launch queue and its host's probe queue (besides those of -Q)."""
    from django.conf import settings

    from forgeboard.runs.services import pool_launch_queue

    instance.app.amqp.queues.select_add(pool_launch_queue(settings.WORKER_POOL))
    instance.app.amqp.queues.select_add(_probe_queue())
    if settings.SLURM_PARTITION:  # this worker submits and follows SLURM jobs
        instance.app.amqp.queues.select_add(pool_launch_queue("slurm"))
    if settings.K8S_API_URL and settings.K8S_IMAGE:  # ... and Kubernetes Jobs
        instance.app.amqp.queues.select_add(pool_launch_queue("kubernetes"))


def _probe_queue() -> str:
    import socket

    from workers.tasks import probe_queue

    return probe_queue(socket.gethostname())  # the agent's Collector reports under this name too


@worker_ready.connect
def _report_own_host(sender, **_kwargs) -> None:
    """A new worker's host joins the inventory without waiting for beat (if probes are on)."""
    from django.conf import settings

    if settings.PROBE_SECONDS:
        sender.app.send_task("cluster.probe_host", queue=_probe_queue(), expires=max(settings.PROBE_SECONDS, 60))
