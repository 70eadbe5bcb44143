"""A SLURM or Kubernetes run taken for lost (silent past the heartbeat timeout: a long final checkpoint save) whose job
then completes has finished: it ends succeeded, said on its timeline, and is not restarted to train again from its last
checkpoint. Whoever finds the job completed ends it while the run still records the job: the job poller, whose move
from running loses to the reconciler's, or the reconciler's own stop, which looks at the job before it stops it. A job
that ended otherwise (cancelled by that stop, say) is still the reconciler's: the run restarts.

SLURM's programs and Kubernetes' API server answer as recorded (tests/platform/test_slurm_backend.py,
test_kubernetes_backend.py); the reconciler, the poller and the stop are the real functions, and the broker (the
machine's edge) is where the reconciler's asks are caught.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import PREVIOUS_ATTEMPT_STOPPED, runs_reconcile
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.platform.test_kubernetes_backend import K8S_YAML, k8s  # noqa: F401 (a fixture)
from tests.platform.test_slurm_backend import SLURM_YAML, slurm  # noqa: F401 (a fixture)
from workers.launch import kubernetes_backend
from workers.launch.backends import start_run
from workers.launch.kubernetes_backend import poll_kubernetes_runs
from workers.launch.slurm_backend import SlurmCli, poll_slurm_runs
from workers.tasks import stop_lost_attempt

pytestmark = pytest.mark.django_db

LOST_FOR = r"no heartbeat for \d+ s \(timeout 60 s\)"


def _stop_ask(asks: list[dict]) -> dict:
    [ask] = [a["kwargs"] for a in asks if a["name"] == "runs.stop_attempt"]
    asks.clear()
    return ask


def _running(team, yaml: str) -> Run:
    """Submitted, its engine reported in, and silent for the last two minutes."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=yaml)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    start_run(run_id=run.pk)
    run_transition(run_id=run.pk, from_state=RunState.LAUNCHING, to_state=RunState.RUNNING)
    Run.objects.filter(pk=run.pk).update(max_restarts=2, last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    return Run.objects.get(pk=run.pk)


def _taken_for_lost(run: Run) -> None:
    report = runs_reconcile(now=timezone.now())
    assert (report.lost, report.stopping) == ([run.pk], [run.pk]), "lost; its job asked to stop before a restart"


def _path(run: Run) -> list[str]:
    return [e.payload["to"] for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]


def _finished(run: Run, *, how: str) -> None:
    """The run ended succeeded for its job, with the story in its reason, and nothing restarts it."""
    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.exit_reason
    prefix, _, rest = run.exit_reason.partition(" (")
    assert prefix == "finished after it was taken for lost", run.exit_reason
    assert rest.endswith(f"): {how}") and re.match(LOST_FOR, rest), run.exit_reason
    assert run.restart_count == 0 and run.finished_at is not None
    assert _path(run) == ["queued", "launching", "running", "lost", "succeeded"]
    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert (report.restarted, report.stopping, report.failed) == ([], [], [])
    assert Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED
    assert not RunEvent.objects.filter(run=run, kind="message", payload__name=PREVIOUS_ATTEMPT_STOPPED).exists()


@pytest.mark.parametrize("ended", ["completed", "was cancelled"])
def test_a_slurm_job_the_poller_finds_ended_as_its_run_is_taken_for_lost(team, slurm, asks, monkeypatch, ended):  # noqa: F811
    """The poller read the run as running and asks SLURM; the reconciler takes the run for lost while sacct answers,
    so the poller's running -> succeeded loses. A completed job finished the run all the same; a cancelled one (the
    reconciler's stop, an operator's scancel) leaves the run to the reconciler."""
    run = _running(team, SLURM_YAML)
    slurm.answer("squeue", jobs=[])  # it left the queue
    slurm.job("sacct", 17101 if ended == "completed" else 17104, as_id=run.job_id)  # COMPLETED, exit 0 / CANCELLED
    accounting = SlurmCli.accounting

    def accounting_as_the_run_is_taken_for_lost(cli, job_id):
        try:
            return accounting(cli, job_id)
        finally:
            _taken_for_lost(run)

    monkeypatch.setattr(SlurmCli, "accounting", accounting_as_the_run_is_taken_for_lost)

    done = poll_slurm_runs()

    monkeypatch.setattr(SlurmCli, "accounting", accounting)
    ask = _stop_ask(asks)
    if ended == "completed":
        assert done == {run.pk: "succeeded after it was taken for lost"}
        _finished(run, how=f"SLURM job {run.job_id}: the job completed with exit code 0")
        assert stop_lost_attempt(**ask) == "skipped: the run no longer records that attempt"
        assert slurm.calls("scancel") == []
    else:
        assert done == {run.pk: "moved meanwhile"}
        assert Run.objects.get(pk=run.pk).state == RunState.LOST
        assert stop_lost_attempt(**ask) == f"SLURM job {run.job_id} had ended (the SLURM job was cancelled); restarted"
        assert Run.objects.get(pk=run.pk).state == RunState.QUEUED


def test_a_lost_slurm_runs_job_that_completed_before_its_stop_ends_the_run_succeeded(team, slurm, asks):  # noqa: F811
    """The job completed after the poller last looked and before the reconciler's stop came: the stop finds it
    completed, and the run succeeds rather than restart."""
    run = _running(team, SLURM_YAML)
    slurm.job("squeue", 18004, as_id=run.job_id)  # running as the run is taken for lost
    _taken_for_lost(run)
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id=run.job_id)  # COMPLETED, exit 0

    assert stop_lost_attempt(**_stop_ask(asks)) == "its job had completed: the run succeeded, not restarted"

    _finished(run, how=f"SLURM job {run.job_id}: the job completed with exit code 0")
    assert slurm.calls("scancel") == []
    assert poll_slurm_runs() == {}, "an ended run's job is followed no more"


def test_a_lost_kubernetes_runs_job_that_completed_before_its_stop_ends_the_run_succeeded_and_is_not_deleted(
        team, k8s, asks):  # noqa: F811
    run = _running(team, K8S_YAML)
    k8s.show("k8s_running")
    _taken_for_lost(run)
    k8s.show("k8s_succeeded")
    k8s.requests.clear()

    assert stop_lost_attempt(**_stop_ask(asks)) == "its job had completed: the run succeeded, not restarted"

    _finished(run, how=f"Kubernetes Job {run.job_id}: the controller pod succeeded")
    assert [r.method for r in k8s.requests] == ["GET", "GET"], "the Job and its pods read; nothing deleted"


def test_a_kubernetes_job_the_poller_finds_completed_as_its_run_is_taken_for_lost_ends_the_run_succeeded(
        team, k8s, asks, monkeypatch):  # noqa: F811
    run = _running(team, K8S_YAML)
    k8s.show("k8s_succeeded")
    transport = kubernetes_backend.kubernetes_api().transport

    def taken_for_lost_as_the_pods_are_read(request):
        if request.url.path.endswith("/pods"):
            _taken_for_lost(run)
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", taken_for_lost_as_the_pods_are_read)

    assert poll_kubernetes_runs() == {run.pk: "succeeded after it was taken for lost"}

    monkeypatch.setattr(transport, "handler", k8s.handle)
    _finished(run, how=f"Kubernetes Job {run.job_id}: the controller pod succeeded")
    assert stop_lost_attempt(**_stop_ask(asks)) == "skipped: the run no longer records that attempt"
    assert not [r for r in k8s.requests if r.method == "DELETE"]


def _failed_as_lost(run: Run) -> None:
    """Out of restarts: the reconciler takes the silent run for lost and fails it in the same pass, its job asked to
    stop (and followed, pass after pass, until that is confirmed)."""
    Run.objects.filter(pk=run.pk).update(max_restarts=0)
    report = runs_reconcile(now=timezone.now())
    assert (report.lost, report.failed) == ([run.pk], [run.pk])
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.leftover_stop_since is not None, run.exit_reason


def test_a_run_failed_as_lost_without_restarts_whose_job_then_completed_succeeded_after_all(team, slurm, asks):  # noqa: F811
    """Silent through a long final checkpoint, the run is lost with no restart left and fails; its job then completes
    with exit 0 before the stop that follows it comes. The run finished: it ends succeeded, the failure and the
    finish both on its timeline, and its job is not followed any more (on the old code it stayed failed)."""
    run = _running(team, SLURM_YAML)
    slurm.job("squeue", 18004, as_id=run.job_id)  # still running as the run fails
    _failed_as_lost(run)
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id=run.job_id)  # COMPLETED, exit 0

    assert stop_lost_attempt(**_stop_ask(asks)) == "its job had completed: the run succeeded, not restarted"

    run.refresh_from_db()
    assert run.state == RunState.SUCCEEDED, run.exit_reason
    assert re.fullmatch(rf"finished after all: it had failed \(lost \({LOST_FOR}\) after 0 of 0 restarts\), then "
                        rf"SLURM job {run.job_id}: the job completed with exit code 0", run.exit_reason), run.exit_reason
    assert run.leftover_stop_since is None and run.restart_count == 0
    assert _path(run) == ["queued", "launching", "running", "lost", "failed", "succeeded"]
    assert slurm.calls("scancel") == []
    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert (report.leftover_stopping, report.leftover_unconfirmed, report.restarted) == ([], [], [])
    assert asks == [] and Run.objects.get(pk=run.pk).state == RunState.SUCCEEDED


def test_a_run_failed_as_lost_whose_job_was_cancelled_stays_failed(team, slurm, asks):  # noqa: F811
    run = _running(team, SLURM_YAML)
    slurm.job("squeue", 18004, as_id=run.job_id)
    _failed_as_lost(run)
    failed_because = Run.objects.get(pk=run.pk).exit_reason
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id=run.job_id)  # CANCELLED

    assert stop_lost_attempt(**_stop_ask(asks)) == (f"SLURM job {run.job_id} had ended (the SLURM job was cancelled); "
                                                    "not restarted")

    run.refresh_from_db()
    assert (run.state, run.exit_reason, run.leftover_stop_since) == (RunState.FAILED, failed_because, None)
    assert _path(run) == ["queued", "launching", "running", "lost", "failed"]


def test_a_run_that_failed_for_itself_is_not_made_succeeded_by_its_leftover_job_completing(team, slurm, asks):  # noqa: F811
    """Only a failure for being lost is undone by a finished attempt: a launch that failed after its job was queued
    (the run never ran, as far as the platform knows) stays failed whatever that job does."""
    from workers.launch.jobs import launch_failed

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    start_run(run_id=run.pk)
    launch_failed(run_id=run.pk, reason="launch failed: the worker died")
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.leftover_stop_since is not None
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id=run.job_id)  # COMPLETED, exit 0
    assert runs_reconcile(now=timezone.now()).leftover_stopping == [run.pk]

    assert stop_lost_attempt(**_stop_ask(asks)) == f"SLURM job {run.job_id} had ended (the job completed with exit " \
                                                   "code 0); not restarted"

    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.FAILED, "launch failed: the worker died")
