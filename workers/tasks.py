"""Celery tasks: thin, take IDs, call services. Long runs are never held inside a task.

Also the queues a worker consumes besides those of `-Q` (see forgeboard/dispatch.py), and its report of its
own host as soon as it is ready: this module is imported when the app is made (workers/celery.py).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import asdict

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_ready
from django.conf import settings

from forgeboard.dispatch import (
    ALERTS_DELIVER,
    CHECKPOINTS_EXPORT,
    CLUSTER_MARK_DOWN_HOSTS,
    CLUSTER_PROBE,
    CLUSTER_PROBE_HOST,
    IDEMPOTENCY_PURGE,
    RUNS_LAUNCH,
    RUNS_POLL_JOBS,
    RUNS_RECONCILE,
    RUNS_SCHEDULE,
    RUNS_START,
    RUNS_STOP_ATTEMPT,
    enqueue,
    pool_launch_queue,
    probe_queue,
)
from forgeboard.logs import run_log_context
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_enqueue_start, run_launch_queue
from forgeboard.runs.states import RunState

logger = logging.getLogger(__name__)


def _own_probe_queue() -> str:
    return probe_queue(socket.gethostname())  # the agent's Collector reports under this name too


@celeryd_after_setup.connect
def worker_queues(sender: str, instance, **_kwargs) -> None:
    """Subscribe this worker to its pool's launch queue and its host's probe queue (besides those of -Q)."""
    instance.app.amqp.queues.select_add(pool_launch_queue(settings.WORKER_POOL))
    instance.app.amqp.queues.select_add(_own_probe_queue())
    if settings.SLURM_PARTITION:  # this worker submits and follows SLURM jobs
        instance.app.amqp.queues.select_add(pool_launch_queue("slurm"))
    if settings.K8S_API_URL and settings.K8S_IMAGE:  # ... and Kubernetes Jobs
        instance.app.amqp.queues.select_add(pool_launch_queue("kubernetes"))


@worker_ready.connect
def _report_own_host(sender, **_kwargs) -> None:
    """A new worker's host joins the inventory without waiting for beat (if probes are on)."""
    if settings.PROBE_SECONDS:
        enqueue(CLUSTER_PROBE_HOST, queue=_own_probe_queue(), expires=max(settings.PROBE_SECONDS, 60))


def _start_scheduled() -> list[int]:
    """Run the scheduler and hand each run it claimed (queued→launching) to its launch backend."""
    from django.utils import timezone

    from forgeboard.runs.scheduling import runs_schedule
    from workers.launch.backends import start_run
    from workers.launch.jobs import launch_failed

    started = runs_schedule(now=timezone.now())
    own_queue = pool_launch_queue(settings.WORKER_POOL)
    for run_id in started:
        with run_log_context(run_id):
            try:
                queue = run_launch_queue(run_id=run_id)
                if queue is not None and queue != own_queue:
                    # Its host is in another pool: a worker of that pool starts it (runs.start). If none
                    # listens, the reconciler marks it lost after the launch timeout, with the reason.
                    run_enqueue_start(run_id=run_id, queue=queue)
                    logger.info("run handed to queue %s", queue)
                    continue
                start_run(run_id=run_id)
            except Exception as exc:  # one broken launch must not strand the others in launching
                logger.exception("launch failed")
                launch_failed(run_id=run_id, reason=f"launch failed: {exc}")  # or cancelled, if it was meanwhile
    return started


@shared_task(name=RUNS_LAUNCH, acks_late=True)
def launch_run(run_id: int) -> str:
    """A run was queued: start what fits now (this run only if it fits; otherwise it stays queued)."""
    with run_log_context(run_id):
        started = _start_scheduled()
        if run_id in started:
            return "launched"
        state = Run.objects.filter(pk=run_id).values_list("state", flat=True).first()
        if state == RunState.QUEUED:
            logger.info("run stays queued until capacity frees up")
            return "queued"
        logger.info("launch skipped: run is %s", state)
        return "skipped"


@shared_task(name=RUNS_START, acks_late=False)
def start_claimed_run(run_id: int) -> str:
    """A scheduler claimed this run for a host of this worker's pool: start it here (a run cancelled before it
    was submitted ends cancelled, never submitted: workers/launch/backends.py `start_run`).

    Not acknowledged late: a redelivered message must not start a run twice; a start lost with a
    crashed worker leaves the run launching, and the reconciler restarts or fails it.
    """
    from workers.launch.backends import start_run
    from workers.launch.jobs import launch_failed

    with run_log_context(run_id):
        if Run.objects.filter(pk=run_id, state__in=(RunState.LAUNCHING, RunState.CANCELLING), pid__isnull=True,
                              job_id="").exists():
            try:
                started = start_run(run_id=run_id)
            except Exception as exc:
                logger.exception("launch failed")
                launch_failed(run_id=run_id, reason=f"launch failed: {exc}")  # or cancelled, if it was meanwhile
                return "failed"
            if started:
                return "started"
        logger.info("start skipped: run is no longer waiting to be started")
        return "skipped"


@shared_task(name=RUNS_STOP_ATTEMPT, acks_late=False)
def stop_lost_attempt(run_id: int, job_id: str, pid: int | None, host: str) -> str:
    """Asked by the reconciler on a worker that reaches it: stop what a lost run's previous attempt left (its job, or
    its engine on this host), then restart the run (workers/launch/backends.py `stop_attempt`)."""
    from workers.launch.backends import stop_attempt

    with run_log_context(run_id):
        return stop_attempt(run_id=run_id, job_id=job_id, pid=pid, host=host)


@shared_task(name=RUNS_SCHEDULE)
def schedule_runs() -> list[int]:
    """Periodic: start queued runs that fit now that other runs have ended or hosts came back."""
    return _start_scheduled()


@shared_task(name=RUNS_RECONCILE)
def reconcile_runs() -> dict:
    """Periodic: lost runs are restarted from their checkpoint or failed (see runs/reconcile.py); lost checkpoint
    exports are queued again or failed (runs/checkpoints.py)."""
    from django.utils import timezone

    from forgeboard.runs.checkpoints import checkpoint_exports_reconcile
    from forgeboard.runs.reconcile import runs_reconcile

    now = timezone.now()
    report = runs_reconcile(now=now)  # which logs what it did
    exports = checkpoint_exports_reconcile(now=now)
    return asdict(report) | {"exports_requeued": exports.requeued, "exports_failed": exports.failed}


@shared_task(name=RUNS_POLL_JOBS)
def poll_jobs(backend: str) -> dict[int, str]:
    """Periodic, on the workers of a cluster scheduler: follow the jobs of active runs (workers/launch/jobs.py)."""
    if backend == "slurm":
        from workers.launch.slurm_backend import poll_slurm_runs

        return poll_slurm_runs()
    from workers.launch.kubernetes_backend import poll_kubernetes_runs

    return poll_kubernetes_runs()


@shared_task(name=CLUSTER_MARK_DOWN_HOSTS)
def mark_down_hosts() -> list[int]:
    """Periodic: hosts that stopped heartbeating are marked down; returns the active runs that were on them."""
    from django.conf import settings
    from django.utils import timezone

    from forgeboard.cluster.services import hosts_mark_down

    marked = hosts_mark_down(now=timezone.now(), timeout_s=settings.HOST_HEARTBEAT_TIMEOUT_S)
    for down in marked:
        logger.warning("host %s is down; active runs on it: %s", down.host.hostname, down.run_ids)
    return [run_id for down in marked for run_id in down.run_ids]


@shared_task(name=IDEMPOTENCY_PURGE)
def purge_idempotency_keys() -> int:
    """Periodic: forget the answers kept for idempotency keys past their lifetime; returns how many."""
    from django.utils import timezone

    from forgeboard.idempotency.services import idempotency_keys_purge

    return idempotency_keys_purge(now=timezone.now())


_collector = None  # one per worker process: NVML is initialised once, CPU use is measured between probes


@shared_task(name=CLUSTER_PROBE_HOST, acks_late=False)
def probe_own_host() -> str:
    """Report the host this worker runs on (CPUs, memory, utilization, GPUs through NVML), as the node agent does."""
    global _collector
    from forgeboard.cluster.services import DeviceReport, WorkerProbe, host_probe_record
    from workers.agent import AGENT_VERSION, Collector, load_nvml, register_body

    if _collector is None:
        _collector = Collector(nvml=load_nvml())
    # The agent's own reading and report body, so probes and agents describe a host the same way.
    body = register_body(_collector.collect(), pool=settings.WORKER_POOL, labels={})
    host = host_probe_record(
        probe=WorkerProbe(worker=body["hostname"]), hostname=body["hostname"], pool=body["pool"],
        cpu_count=body["cpu_count"], memory_bytes=body["memory_bytes"], cpu_utilization=body["cpu_utilization"],
        memory_utilization=body["memory_utilization"], version=AGENT_VERSION,
        devices=[DeviceReport(**device) for device in body["devices"]],
    )
    return host.hostname


@shared_task(name=CLUSTER_PROBE)
def probe_hosts() -> list[str]:
    """Periodic: report this worker's host, and ask the workers of every other host that probes reported (and
    that is not down) to report theirs, through their host's queue. Returns the hosts asked."""
    from forgeboard.cluster.models import Host, HostLiveness
    from forgeboard.cluster.services import PROBE_AGENT_PREFIX

    own = probe_own_host()
    others = list(Host.objects.filter(agent_version__startswith=PROBE_AGENT_PREFIX).exclude(liveness=HostLiveness.DOWN)
                  .exclude(hostname=own).order_by("hostname").values_list("hostname", flat=True))
    for hostname in others:
        # A probe not taken before the next one is pointless: it expires instead of piling up.
        enqueue(CLUSTER_PROBE_HOST, queue=probe_queue(hostname), expires=settings.PROBE_SECONDS or None)
    return others


@shared_task(name=CHECKPOINTS_EXPORT, acks_late=False)
def export_checkpoint(run_id: int, step: int, actor_kind: str | None = None, actor_id: int | None = None,
                      attempt: int | None = None, launch_child: bool = False, overrides: list[str] | None = None,
                      experiment_id: int | None = None, config_yaml: str | None = None,
                      priority: int | None = None) -> str:
    """Export a checkpoint as an HF folder, off the request that asked for it, then start the runs asked for from
    it meanwhile (see runs/checkpoints.py). A message of an attempt that is no longer the export's does nothing.

    Compatibility: a message queued before exports had attempts carries who asked (`actor_kind`, `actor_id`) and
    no `attempt`; the oldest also carry a run to start from the export (`launch_child`, `overrides`,
    `experiment_id`, `config_yaml`, `priority`), which waits for it like a run asked for now."""
    from forgeboard.runs.checkpoints import (
        checkpoint_export_queued,
        checkpoint_export_queued_before_upgrade,
    )

    with run_log_context(run_id):
        if attempt is not None:
            status = checkpoint_export_queued(run_id=run_id, step=step, attempt=attempt)
        elif actor_kind is not None and actor_id is not None:
            status = checkpoint_export_queued_before_upgrade(
                run_id=run_id, step=step, actor_kind=actor_kind, actor_id=actor_id, launch_child=launch_child,
                overrides=overrides or (), experiment_id=experiment_id, config_yaml=config_yaml, priority=priority)
        else:
            raise ValueError("a checkpoints.export message names its attempt (or, queued before attempts, who asked)")
        if status is None:
            logger.info("export of step %s skipped: it is no longer asked for", step)
            return "skipped"
        if status.error:
            logger.warning("export of step %s failed: %s", step, status.error)
        return status.state


@shared_task(name=ALERTS_DELIVER, bind=True, acks_late=True, max_retries=5)
def deliver_alert(self, delivery_id: int) -> str:
    """POST one webhook delivery; a failed attempt is retried after RETRY_DELAYS_S, then given up (recorded)."""
    from forgeboard.alerts.services import RETRY_DELAYS_S, delivery_attempt

    delivery = delivery_attempt(delivery_id=delivery_id)
    if delivery.delivered_at is not None or not delivery.webhook.active:
        return "done"
    retries = self.request.retries
    if retries >= min(self.max_retries, len(RETRY_DELAYS_S)):
        logger.warning("webhook delivery %s given up after %s attempts: %s", delivery_id, delivery.attempts,
                       delivery.last_error)
        return "given up"
    raise self.retry(countdown=RETRY_DELAYS_S[retries])
