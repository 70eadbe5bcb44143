"""Launch backends: start a claimed run's engine controller somewhere and return at once."""

from __future__ import annotations

import logging

from forgeboard.runs.models import LaunchBackend, Run
from forgeboard.runs.services import run_transition
from forgeboard.runs.states import RunState

logger = logging.getLogger(__name__)


def start_run(*, run_id: int) -> None:
    """Hand a launching run to its backend; a backend that cannot start it fails the run with the reason."""
    run = Run.objects.select_related("config").get(pk=run_id)
    if run.backend == LaunchBackend.LOCAL:
        from workers.launch.local import start_local

        try:
            start_local(run=run)
        except OSError as exc:
            run_transition(run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
                           reason=f"local launch failed: {exc}")
        return
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import slurm_configured, submit_slurm

        if slurm_configured():
            submit_slurm(run=run)
            return
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import kubernetes_configured, submit_kubernetes

        if kubernetes_configured():
            submit_kubernetes(run=run)
            return
    run_transition(
        run_id=run_id, from_state=RunState.LAUNCHING, to_state=RunState.FAILED,
        reason=f"launch backend {run.backend!r} is not configured on this worker",
    )


def _stop_previous(*, run: Run, job_id: str, pid: int | None, host: str) -> str | None:
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import stop_slurm_job

        return stop_slurm_job(job_id=job_id)
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import stop_kubernetes_job

        return stop_kubernetes_job(name=job_id)
    from workers.launch.local import stop_local_engine

    return stop_local_engine(run_id=run.pk, pid=pid, host=host) if pid is not None else "no engine was started"


def stop_attempt(*, run_id: int, job_id: str, pid: int | None, host: str) -> str:
    """Stop what a lost run's previous attempt left (its SLURM job or Kubernetes Job, or its local engine on this
    host), then restart the run (runs/reconcile.py). A stop that fails or is not yet confirmed is said on the run's
    timeline, and the reconciler asks again."""
    from forgeboard.runs.reconcile import lost_attempt_not_stopped, lost_attempt_recorded, lost_attempt_stopped
    from workers.launch.kubernetes_backend import KubernetesApiFailed
    from workers.launch.slurm import LaunchSpecError
    from workers.launch.slurm_backend import JobStillCompleting, SlurmCommandFailed

    if not lost_attempt_recorded(run_id=run_id, job_id=job_id, pid=pid):
        return "skipped: the run no longer records that attempt"
    run = Run.objects.get(pk=run_id)
    try:
        done = _stop_previous(run=run, job_id=job_id, pid=pid, host=host)
    except JobStillCompleting as exc:
        lost_attempt_not_stopped(run_id=run_id, job_id=job_id, pid=pid, problem=str(exc))
        return f"still stopping: {exc}"
    except (OSError, SlurmCommandFailed, LaunchSpecError, KubernetesApiFailed) as exc:
        lost_attempt_not_stopped(run_id=run_id, job_id=job_id, pid=pid, problem=str(exc))
        return f"not stopped: {exc}"
    if done is None:
        lost_attempt_not_stopped(run_id=run_id, job_id=job_id, pid=pid, problem="asked to stop, still running")
        return "still stopping"
    restarted = lost_attempt_stopped(run_id=run_id, job_id=job_id, pid=pid, done=done)
    return f"{done}; " + ("restarted" if restarted else "not restarted")
