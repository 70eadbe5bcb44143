"""How the control plane hands work to the Celery workers: the task and queue names, and `enqueue`.

The only platform module that reaches the Celery app (`workers/celery.py`); services call `enqueue` with
a task name, so no service imports the app and the app imports no service. The tasks are in workers/tasks.py.

Every worker also consumes, whatever `-Q` says, `launch.<FORGEBOARD_WORKER_POOL>` (`pool_launch_queue`):
the runs that the scheduler placed on hosts of that pool are started from there; and `probe.<its hostname>`
(`probe_queue`): the `cluster.probe` beat task asks each worker-reported host to report itself there. A
worker with FORGEBOARD_SLURM_PARTITION also consumes `launch.slurm`, and one with FORGEBOARD_K8S_API_URL and
FORGEBOARD_K8S_IMAGE `launch.kubernetes` (see `worker_queues` in workers/tasks.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

RUNS_LAUNCH = "runs.launch"
RUNS_START = "runs.start"
RUNS_SCHEDULE = "runs.schedule"
RUNS_RECONCILE = "runs.reconcile"
RUNS_POLL_JOBS = "runs.poll_jobs"
RUNS_STOP_ATTEMPT = "runs.stop_attempt"
CLUSTER_MARK_DOWN_HOSTS = "cluster.mark_down_hosts"
CLUSTER_PROBE = "cluster.probe"
CLUSTER_PROBE_HOST = "cluster.probe_host"
CHECKPOINTS_EXPORT = "checkpoints.export"
ALERTS_DELIVER = "alerts.deliver"
IDEMPOTENCY_PURGE = "idempotency.purge"

LAUNCH_QUEUE_PREFIX = "launch."
PROBE_QUEUE_PREFIX = "probe."


def pool_launch_queue(pool: str) -> str:
    """The Celery queue whose workers start runs on the hosts of `pool` (`launch.<pool>`)."""
    return f"{LAUNCH_QUEUE_PREFIX}{pool}"


def probe_queue(hostname: str) -> str:
    """The queue only the workers on `hostname` consume."""
    return f"{PROBE_QUEUE_PREFIX}{hostname}"


def enqueue(task: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            queue: str | None = None, expires: float | None = None) -> None:
    """Send the task named `task` to a worker: to `queue` when given (else the default queue), dropped
    unstarted after `expires` seconds when given."""
    from workers.celery import app  # the Celery app lives in the data plane package

    options: dict[str, Any] = {}
    if kwargs:
        options["kwargs"] = dict(kwargs)
    if queue:
        options["queue"] = queue
    if expires is not None:
        options["expires"] = expires
    app.send_task(task, args=list(args), **options)
