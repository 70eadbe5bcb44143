"""Launch backends: start a claimed run's engine controller somewhere and return at once.

A run is submitted (its job queued, its engine started) only while it is launching: `submission_wanted` reads that
under the run's row lock, and a run cancelled before then ends cancelled there, never submitted. A slow submission (a
cluster scheduler's) is made after that lock is let go, so a cancel may come while it is under way; the launch looks
again once the job is recorded (`_removed_if_cancelled_meanwhile`), and from then on the job poller, which follows
the job of a run being cancelled, sees it. Either the launch sees the cancel and submits nothing, or the cancel finds
a job to remove. The local supervisor starts its engine while it holds the lock (a process starts at once), so a
cancel finds a local run either not started or running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction

from forgeboard.runs.models import LaunchBackend, Run
from forgeboard.runs.services import IllegalTransition, run_transition
from forgeboard.runs.states import RunState
from workers.launch.jobs import fail_launch, lost_job_finished

logger = logging.getLogger(__name__)

CANCELLED_BEFORE_SUBMISSION = "cancelled before it was submitted"


def submission_wanted(*, run_id: int) -> bool:
    """Whether the run is to be submitted now: it is launching and nothing was submitted for it yet (no job, no
    engine), read under its row lock. A run being cancelled that was not submitted ends cancelled here; one that moved
    on otherwise (failed, lost, restarted) or was submitted already (a start delivered twice) is left as it is. The
    lock lasts as long as the caller's transaction, if it holds one open."""
    with transaction.atomic():
        found = Run.objects.select_for_update().filter(pk=run_id).values_list("state", "pid", "job_id").first()
        if found is None:
            return False
        state, pid, job_id = found
        if pid is not None or job_id:
            return False
        if state == RunState.CANCELLING:
            run_transition(run_id=run_id, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                           reason=CANCELLED_BEFORE_SUBMISSION)
            logger.info("run %s %s", run_id, CANCELLED_BEFORE_SUBMISSION, extra={"run_id": run_id})
            return False
        if state != RunState.LAUNCHING:
            logger.info("run %s is %s: not submitted", run_id, state, extra={"run_id": run_id})
        return state == RunState.LAUNCHING


def start_run(*, run_id: int) -> bool:
    """Hand a launching run to its backend; a backend that cannot start it fails the run with the reason. False when
    the run was no longer to be submitted (`submission_wanted`: cancelled, moved on, or submitted already), and nothing
    was done."""
    if not submission_wanted(run_id=run_id):
        return False
    run = Run.objects.select_related("config").get(pk=run_id)
    if run.backend == LaunchBackend.LOCAL:
        from workers.launch.local import start_local

        try:
            start_local(run=run)
        except OSError as exc:
            fail_launch(run=run, reason=f"local launch failed: {exc}")
        return True
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import slurm_cli, slurm_configured, submit_slurm

        if slurm_configured():
            if job_id := submit_slurm(run=run):
                _removed_if_cancelled_meanwhile(run_id=run_id, job=f"SLURM job {job_id}",
                                                remove=lambda: slurm_cli().cancel(job_id))
            return True
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import kubernetes_api, kubernetes_configured, submit_kubernetes

        if kubernetes_configured():
            if name := submit_kubernetes(run=run):
                _removed_if_cancelled_meanwhile(run_id=run_id, job=f"Kubernetes Job {name}",
                                                remove=lambda: kubernetes_api().delete("Job", name))
            return True
    fail_launch(run=run, reason=f"launch backend {run.backend!r} is not configured on this worker")
    return True


def _removed_if_cancelled_meanwhile(*, run_id: int, job: str, remove: Callable[[], None]) -> None:
    """The run's job is recorded: a cancel from now on finds it (the job poller removes the job of a run being
    cancelled). One that came while it was being submitted found none, so the job is removed now, as the poller
    removes a queued one (`remove`), and the run ends cancelled. If it cannot be removed now, the poller does it."""
    from workers.launch.kubernetes_backend import KubernetesApiFailed
    from workers.launch.slurm_backend import SlurmCommandFailed

    if Run.objects.filter(pk=run_id, state=RunState.CANCELLING).exists():
        try:
            remove()
        except (SlurmCommandFailed, KubernetesApiFailed) as exc:
            logger.warning("run %s was cancelled while it was being submitted; %s is left to the job poller to "
                           "remove: %s", run_id, job, exc, extra={"run_id": run_id})
            return
        try:
            run_transition(run_id=run_id, from_state=RunState.CANCELLING, to_state=RunState.CANCELLED,
                           reason=f"cancelled while it was being submitted; {job} removed")
        except IllegalTransition:
            pass  # the job poller removed it first, and ended the run


class SupervisorStillSettling(RuntimeError):
    """A lost run's local engine has exited, but its supervisor, which may still end the run as the engine did, has
    not yet exited."""


def _job_finished(*, run: Run, job_id: str) -> bool:
    """Whether the lost run's job completed, as the job poller would find it (its engine finished the run after it was
    taken for lost), and the run ended succeeded for it: read before the job is stopped, since a deleted Kubernetes
    Job's end can no longer be read (workers/launch/jobs.py `lost_job_finished`). A Kubernetes Job that completes
    after this read and before its deletion is found by the stop, which reads it again after deleting it."""
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import job_status, slurm_cli

        return lost_job_finished(run=run, status=job_status(job_id=job_id, cli=slurm_cli()), job=f"SLURM job {job_id}")
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import kubernetes_api, kubernetes_attempt_status

        api = kubernetes_api()
        job = api.get_job(job_id)  # its pods are this attempt's (by the Job's label), never an earlier one's
        status = None if job is None else kubernetes_attempt_status(name=job_id, job=job, pods=api.job_pods(job_id))
        return lost_job_finished(run=run, status=status, job=f"Kubernetes Job {job_id}")
    return False  # a local engine's supervisor says so itself


def _stop_previous(*, run: Run, job_id: str, pid: int | None, host: str) -> str | None:
    if run.backend == LaunchBackend.SLURM:
        from workers.launch.slurm_backend import stop_slurm_job

        return stop_slurm_job(job_id=job_id)
    if run.backend == LaunchBackend.KUBERNETES:
        from workers.launch.kubernetes_backend import stop_kubernetes_job

        return stop_kubernetes_job(name=job_id, finished=lambda status: lost_job_finished(
            run=run, status=status, job=f"Kubernetes Job {job_id}"))
    from workers.launch import supervisor_lock
    from workers.launch.local import run_dir, stop_local_engine

    if pid is None:
        return "no engine was started"
    folder = run_dir(run)
    done = stop_local_engine(run_id=run.pk, pid=pid, host=host, folder=folder)
    if done is None or supervisor_lock.supervisor_gone_within(folder=folder,
                                                              seconds=supervisor_lock.SETTLE_GRACE_SECONDS):
        return done
    # Our own process, stuck past any settling (a database call that never returns): it must not hold the run.
    if (killed := supervisor_lock.stalled_supervisors_killed(folder=folder, engine_pid=pid)) and \
            supervisor_lock.supervisor_gone_within(folder=folder, seconds=supervisor_lock.SETTLE_GRACE_SECONDS):
        return "; ".join([done, *killed])
    raise SupervisorStillSettling("it has exited, but its supervisor has not yet recorded how it ended")


def stop_attempt(*, run_id: int, job_id: str, pid: int | None, host: str) -> str:
    """Stop what a lost run's previous attempt left (its SLURM job or Kubernetes Job, or its local engine on this
    host), then restart the run (runs/reconcile.py). A lost run whose job had completed is not restarted: it
    succeeded. A local engine that has exited is confirmed stopped once its supervisor has exited too, having ended
    the run if the engine finished it. A stop that fails or is not yet confirmed is said on the run's timeline, and
    the reconciler asks again."""
    from forgeboard.runs.reconcile import lost_attempt_not_stopped, lost_attempt_recorded, lost_attempt_stopped
    from workers.launch.kubernetes_backend import KubernetesApiFailed
    from workers.launch.slurm import LaunchSpecError
    from workers.launch.slurm_backend import JobStillCompleting, SlurmCommandFailed

    if not lost_attempt_recorded(run_id=run_id, job_id=job_id, pid=pid):
        return "skipped: the run no longer records that attempt"
    run = Run.objects.get(pk=run_id)
    try:
        # Lost, or failed with the attempt left (out of restarts): a job that completed finished the run all the same.
        if _job_finished(run=run, job_id=job_id):
            return "its job had completed: the run succeeded, not restarted"
        done = _stop_previous(run=run, job_id=job_id, pid=pid, host=host)
    except (JobStillCompleting, SupervisorStillSettling) as exc:
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
