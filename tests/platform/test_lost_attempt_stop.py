"""A lost run's previous attempt is stopped before it restarts: its SLURM job scancelled (fake SLURM programs), its
Kubernetes Job deleted with its pods (a fake API server), its local engine's process group killed (a real process);
its old controller's token no longer works; a stop that fails is retried and said on the run's timeline."""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from datetime import timedelta

import pytest
from django.utils import timezone

from forgeboard.cluster.models import Host, HostLiveness
from forgeboard.runs.models import Run
from forgeboard.runs.reconcile import (PREVIOUS_ATTEMPT_NOT_CONFIRMED, PREVIOUS_ATTEMPT_NOT_STOPPED,
                                       PREVIOUS_ATTEMPT_STOPPED, runs_reconcile)
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_launch, run_transition
from forgeboard.runs.states import RunState
from forgeboard.runs.tokens import run_token_authenticate, run_token_issue
from forgeboard.telemetry.models import RunEvent
from tests.platform.test_kubernetes_backend import K8S_YAML, k8s  # noqa: F401 (a fixture)
from tests.platform.test_slurm_backend import SLURM_YAML, slurm  # noqa: F401 (a fixture)
from tests.support.processes import celery_worker, wait_for
from workers.engine.env import RUN_ID_ENV
from workers.launch import local
from workers.launch.backends import start_run, stop_attempt
from workers.tasks import stop_lost_attempt

pytestmark = pytest.mark.django_db


def _silent(run: Run) -> Run:
    """The run's controller last reported two minutes ago: the reconciler finds it lost."""
    Run.objects.filter(pk=run.pk).update(state=RunState.RUNNING, max_restarts=2,
                                         last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    return Run.objects.get(pk=run.pk)


def _out_of_restarts(run: Run) -> Run:
    """... and has used every restart it had: the reconciler fails it."""
    Run.objects.filter(pk=run.pk).update(restart_count=run.max_restarts)
    return Run.objects.get(pk=run.pk)


def _stop_asked(asks: list[dict], run: Run) -> dict:
    [ask] = [a for a in asks if a["name"] == "runs.stop_attempt" and a["kwargs"]["run_id"] == run.pk]
    asks.clear()
    return ask


def _messages(run: Run, name: str) -> list[dict]:
    return [e.payload for e in RunEvent.objects.filter(run=run, kind="message", payload__name=name).order_by("seq")]


def _launched(team, yaml: str) -> tuple[Run, str]:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=yaml)
    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    run.refresh_from_db()
    return run, run.job_id


def test_a_lost_slurm_runs_job_is_scancelled_before_it_restarts_with_a_fresh_job(
        team, slurm, asks, django_capture_on_commit_callbacks):  # noqa: F811
    run, old_job = _launched(team, SLURM_YAML)
    old_token = run_token_issue(run=run)  # as its engine holds it
    run = _silent(run)
    slurm.job("squeue", 18004, as_id=old_job)  # the job runs on: its engine hangs, or cannot reach the platform

    report = runs_reconcile(now=timezone.now())
    assert report.lost == [run.pk] and report.stopping == [run.pk] and report.restarted == []
    assert Run.objects.get(pk=run.pk).state == RunState.LOST, "not requeued while its job may still run"
    assert run_token_authenticate(raw=old_token) is None, "the old controller cannot report into the restart"
    ask = _stop_asked(asks, run)
    assert ask["queue"] == "launch.slurm" and ask["kwargs"]["job_id"] == "18004" and ask["expires"] > 0

    # scancel sent, SLURM still shows it running: not confirmed, said on the timeline, the run waits
    assert stop_attempt(**ask["kwargs"]) == "still stopping"
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"]]
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["attempt"] == "SLURM job 18004"

    # the next pass asks again; now the job has left the queue, cancelled: the run restarts
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id=old_job)  # CANCELLED
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]).endswith("restarted")
    run.refresh_from_db()
    assert (run.state, run.restart_count, run.job_id) == (RunState.QUEUED, 1, "")
    assert _messages(run, PREVIOUS_ATTEMPT_STOPPED)[-1]["detail"].startswith("SLURM job 18004 had ended")
    assert any(a["name"] == "runs.launch" for a in asks), "the relaunch is enqueued"

    # the new attempt gets a job of its own, and a token the old one's does not equal
    slurm.answer("sbatch", stdout="Submitted batch job 18010")
    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    run.refresh_from_db()
    assert run.job_id == "18010" and run.state == RunState.LAUNCHING
    assert run_token_authenticate(raw=old_token) is None
    # a late ask about the old job touches nothing
    assert stop_attempt(**ask["kwargs"]).startswith("skipped") and len(slurm.calls("scancel")) == 1


def test_a_scheduler_that_cannot_be_reached_is_retried_said_and_in_the_end_fails_the_run(team, slurm, asks):  # noqa: F811
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    slurm.answer("squeue", exit=1, stderr="slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    for _ in range(2):
        assert stop_attempt(**ask["kwargs"]).startswith("not stopped: squeue exited with 1")
    [said] = _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)
    assert "Unable to contact slurm controller" in said["problem"], "said once, not at every retry"
    assert Run.objects.get(pk=run.pk).state == RunState.LOST

    lost_at = Run.objects.get(pk=run.pk).state_changed_at
    report = runs_reconcile(now=lost_at + timedelta(seconds=60), stop_timeout_s=900)
    assert report.stopping == [run.pk] and _stop_asked(asks, run), "asked again while the stop timeout runs"
    report = runs_reconcile(now=lost_at + timedelta(seconds=901), stop_timeout_s=900)
    assert report.failed == [run.pk]
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.restart_count == 0
    assert f"SLURM job {old_job} could not be confirmed stopped within 900 s" in run.exit_reason
    assert _stop_asked(asks, run)["kwargs"]["job_id"] == old_job, "still asked to go once the scheduler is back"


def test_a_run_out_of_restarts_fails_and_its_job_is_asked_to_stop_at_every_pass_until_slurm_confirms_it(
        team, slurm, asks):  # noqa: F811
    """Failed at once, not reopened; its job, which may still hold the GPUs, is followed as a restart's would be."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _out_of_restarts(_silent(run))
    slurm.job("squeue", 18004, as_id=old_job)  # the job runs on
    report = runs_reconcile(now=timezone.now())
    assert report.failed == [run.pk] and report.leftover_stopping == []
    run.refresh_from_db()
    assert (run.state, run.restart_count) == (RunState.FAILED, 2) and "after 2 of 2 restarts" in run.exit_reason
    ask = _stop_asked(asks, run)
    assert ask["queue"] == "launch.slurm" and ask["kwargs"]["job_id"] == old_job
    assert stop_attempt(**ask["kwargs"]) == "still stopping"  # scancel sent; SLURM still runs it
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["problem"] == "asked to stop, still running"

    for _ in range(2):  # every pass asks again; the run stays failed
        report = runs_reconcile(now=timezone.now())
        assert report.leftover_stopping == [run.pk] and report.failed == []
        assert _stop_asked(asks, run)["kwargs"] == ask["kwargs"]
    assert Run.objects.get(pk=run.pk).state == RunState.FAILED

    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id=old_job)  # CANCELLED
    assert stop_attempt(**ask["kwargs"]) == f"SLURM job {old_job} had ended (the SLURM job was cancelled); not restarted"
    assert [m["detail"] for m in _messages(run, PREVIOUS_ATTEMPT_STOPPED)] == [
        f"SLURM job {old_job} had ended (the SLURM job was cancelled)"]
    failed = Run.objects.get(pk=run.pk)
    assert (failed.state, failed.restart_count, failed.exit_reason, failed.job_id) == (
        RunState.FAILED, 2, run.exit_reason, old_job), "the failed run is left as it was, its job's id kept"

    report = runs_reconcile(now=timezone.now() + timedelta(hours=1))
    assert report.leftover_stopping == [] and not [a for a in asks if a["name"] == "runs.stop_attempt"]
    assert stop_attempt(**ask["kwargs"]).startswith("skipped"), "a late ask touches nothing"
    assert len(slurm.calls("scancel")) == 1 and len(_messages(run, PREVIOUS_ATTEMPT_STOPPED)) == 1


@pytest.mark.parametrize(("backend", "left"), [
    ("slurm", "SLURM job 18004"),
    ("local", "its engine's process group 4242 on gpu-node-7"),
])
def test_a_failed_runs_attempt_not_confirmed_stopped_in_time_is_said_naming_what_may_be_left_running(
        team, slurm, grpo_yaml, asks, backend, left):  # noqa: F811
    if backend == "slurm":
        run, _ = _launched(team, SLURM_YAML)
        slurm.answer("squeue", exit=1, stderr="slurm_load_jobs error: Unable to contact slurm controller")
    else:  # its host's worker never takes the ask
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
        Run.objects.filter(pk=run.pk).update(pid=4242, host="gpu-node-7")
    run = _out_of_restarts(_silent(Run.objects.get(pk=run.pk)))
    failed_at = timezone.now()
    assert runs_reconcile(now=failed_at).failed == [run.pk]
    ask = _stop_asked(asks, run)
    if backend == "slurm":
        assert stop_attempt(**ask["kwargs"]).startswith("not stopped: squeue exited with 1")

    report = runs_reconcile(now=failed_at + timedelta(seconds=899), stop_timeout_s=900)
    assert report.leftover_stopping == [run.pk] and _stop_asked(asks, run)
    report = runs_reconcile(now=failed_at + timedelta(seconds=900), stop_timeout_s=900)
    assert report.leftover_unconfirmed == [run.pk] and report.leftover_stopping == []
    assert not [a for a in asks if a["name"] == "runs.stop_attempt"]
    [said] = _messages(run, PREVIOUS_ATTEMPT_NOT_CONFIRMED)
    assert said["left"] == left
    assert said["problem"] == (f"not confirmed stopped in the 15 minutes after the run failed: {left} may still be "
                               "running; stopping it is left to an operator")
    run.refresh_from_db()
    assert run.state == RunState.FAILED

    report = runs_reconcile(now=failed_at + timedelta(hours=1), stop_timeout_s=900)
    assert (report.leftover_stopping, report.leftover_unconfirmed) == ([], [])
    assert len(_messages(run, PREVIOUS_ATTEMPT_NOT_CONFIRMED)) == 1, "said once"
    assert stop_attempt(**ask["kwargs"]).startswith("skipped")


@pytest.mark.parametrize("shape", ["22.05", "23.11"])
def test_a_lost_runs_job_slurm_is_still_completing_is_not_confirmed_stopped_until_it_has_left_completing(
        team, slurm, asks, django_capture_on_commit_callbacks, shape):  # noqa: F811
    """SLURM says the job ended (sacct: CANCELLED; 23.11's squeue: CANCELLED, COMPLETING) while it still stops its
    processes, or runs its epilog, on its nodes: the restart's new job waits until that is done."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    slurm.completing(as_id=old_job, shape=shape)
    slurm.job("sacct", 17104, as_id=old_job)  # CANCELLED already
    nodes = "fbslurm1" if shape == "22.05" else "gpu-[001-002]"
    problem = (f"SLURM job {old_job} has ended, but SLURM is still stopping its processes on {nodes} "
               "(COMPLETING)")
    assert stop_attempt(**ask["kwargs"]) == f"still stopping: {problem}"
    assert slurm.calls("scancel") == [], "ending already: not cancelled again"
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1] == {
        "name": PREVIOUS_ATTEMPT_NOT_STOPPED, "attempt": f"SLURM job {old_job}", "problem": problem}

    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == f"still stopping: {problem}"
    assert len(_messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)) == 1, "said once while it lasts"

    slurm.answer("squeue", jobs=[])  # done: it left the queue
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]).endswith("; restarted")
    run.refresh_from_db()
    assert (run.state, run.restart_count) == (RunState.QUEUED, 1)


@pytest.mark.parametrize("job", [2, 4, 5, 6, 7], ids=["held", "special-exit", "configuring", "stopped", "signaling"])
def test_a_lost_runs_job_in_any_state_slurm_22_05_prints_is_scancelled_and_then_confirmed_stopped(
        team, slurm, asks, django_capture_on_commit_callbacks, job):  # noqa: F811
    """Held, requeued and held, setting up its node, stopped by SIGSTOP, being signalled: as the suite's Slurm 22.05
    cluster printed each (captured). Each was an unknown state: the job was never scancelled and the run failed after
    the stop timeout. Now the job is scancelled, and the run restarts once SLURM has ended it."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    slurm.captured(job=job, as_id=old_job)
    assert stop_attempt(**ask["kwargs"]) == "still stopping", "scancelled; SLURM has not ended it yet"
    assert [c["args"] for c in slurm.calls("scancel")] == [[old_job]]
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["problem"] == "asked to stop, still running"

    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id=old_job)  # CANCELLED
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == (
            f"SLURM job {old_job} had ended (the SLURM job was cancelled); restarted")


def test_a_lost_runs_job_slurm_says_is_stopped_but_has_cancelled_is_confirmed_stopped(
        team, slurm, asks, django_capture_on_commit_callbacks):  # noqa: F811
    """Slurm 22.05 says STOPPED in place of the base state of a job it has cancelled, until the job leaves the queue
    (captured from the suite's cluster: scancelled while its SIGSTOP was on its way): sacct says it has ended, and
    SLURM is done with it (one whose processes it still stops says COMPLETING first)."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    slurm.stopped_after_cancel(as_id=old_job)
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == (
            f"SLURM job {old_job} had ended (the SLURM job was cancelled); restarted")
    assert slurm.calls("scancel") == []


@pytest.mark.parametrize("shape", ["22.05", "23.11"])
def test_a_lost_runs_job_staging_out_its_data_is_not_confirmed_stopped_until_slurm_is_done(
        team, slurm, asks, django_capture_on_commit_callbacks, shape):  # noqa: F811
    """STAGE_OUT: the job's burst buffer's data (a checkpoint the restart would start from) is still being copied out;
    22.05 prints only that, 23.11 how the job ended besides. It was unknown (22.05) or ended (23.11). Once SLURM is
    done, the job had completed: the run finished after it was taken for lost, and is not restarted
    (tests/platform/test_lost_attempt_finished.py)."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    if shape == "22.05":
        slurm.captured(job=7, as_id=old_job, state="STAGE_OUT")
    else:
        slurm.job("squeue", 18004, as_id=old_job)
        [record] = slurm.answers["squeue"]["jobs"]
        slurm.answer("squeue", jobs=[record | {"job_state": ["COMPLETED", "STAGE_OUT"]}])
    problem = f"SLURM job {old_job} has ended, but SLURM is still staging out its burst buffer data (STAGE_OUT)"
    assert stop_attempt(**ask["kwargs"]) == f"still stopping: {problem}"
    assert slurm.calls("scancel") == [] and Run.objects.get(pk=run.pk).state == RunState.LOST
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["problem"] == problem

    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17101, as_id=old_job)  # COMPLETED
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == (
            "its job had completed: the run succeeded, not restarted")
    run.refresh_from_db()
    assert (run.state, run.restart_count) == (RunState.SUCCEEDED, 0)
    assert run.exit_reason.endswith(f"): SLURM job {old_job}: the job completed with exit code 0")


def test_an_unreadable_slurm_answer_is_said_on_the_timeline_and_the_stop_asked_again(
        team, slurm, asks, django_capture_on_commit_callbacks):  # noqa: F811
    """squeue answers, but with a state this code does not know (MIGRATING: no Slurm has it, but a later one may add
    a state): the stop is not confirmed, the timeline says why, and the next pass asks again."""
    run, old_job = _launched(team, SLURM_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    slurm.job("squeue", 18004, as_id=old_job)
    [record] = slurm.answers["squeue"]["jobs"]
    slurm.answer("squeue", jobs=[record | {"job_state": "MIGRATING"}])
    assert stop_attempt(**ask["kwargs"]) == "not stopped: job_state: unknown SLURM job state ['MIGRATING']"
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED) == [{
        "name": PREVIOUS_ATTEMPT_NOT_STOPPED, "attempt": f"SLURM job {old_job}",
        "problem": "job_state: unknown SLURM job state ['MIGRATING']"}]
    assert slurm.calls("scancel") == [] and Run.objects.get(pk=run.pk).state == RunState.LOST

    report = runs_reconcile(now=timezone.now())
    assert report.stopping == [run.pk] and report.restarted == []
    again = _stop_asked(asks, run)
    assert again["kwargs"] == ask["kwargs"] and again["queue"] == "launch.slurm"
    slurm.job("squeue", 18004, as_id=old_job)  # readable again: running, so it is scancelled
    assert stop_attempt(**again["kwargs"]) == "still stopping"
    assert [c["args"] for c in slurm.calls("scancel")] == [[old_job]]
    assert [m["problem"] for m in _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)] == [
        "job_state: unknown SLURM job state ['MIGRATING']", "asked to stop, still running"]
    slurm.answer("squeue", jobs=[])
    slurm.job("sacct", 17104, as_id=old_job)
    runs_reconcile(now=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]).endswith("; restarted")
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED


def test_a_lost_kubernetes_runs_job_is_deleted_with_its_pods_before_a_new_job_is_created(team, k8s, asks):  # noqa: F811
    run, old_job = _launched(team, K8S_YAML)
    old_token = k8s.created[0]["stringData"]["token"]
    k8s.show("k8s_running")
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    assert ask["queue"] == "launch.kubernetes" and ask["kwargs"]["job_id"] == old_job == f"forgeboard-run-{run.pk}"
    assert run_token_authenticate(raw=old_token) is None

    k8s.refuse = (503, "etcdserver: request timed out")
    assert stop_attempt(**ask["kwargs"]).startswith("not stopped: reading Job")
    assert "etcdserver: request timed out" in _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["problem"]
    assert Run.objects.get(pk=run.pk).state == RunState.LOST

    k8s.refuse = None
    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]) == (
        f"still stopping: Kubernetes Job {old_job} is being deleted: its pods are still stopping "
        "(forgeboard-run-42-0-x7k2p on gpu-node-07 terminating, forgeboard-run-42-1-q9m4d on gpu-node-08 terminating)"
    ), "deleted in the foreground: its pods are stopping"
    [delete] = [r for r in k8s.requests if r.method == "DELETE"]
    assert delete.url.path.endswith(f"/jobs/{old_job}") and delete.url.params["propagationPolicy"] == "Foreground"
    pods = [r.url.params["labelSelector"] for r in k8s.requests if r.url.path.endswith("/pods")]
    assert pods == [f"batch.kubernetes.io/job-name={old_job}"] * 2, (
        "the attempt's pods read with its Job, as the poller reads them (had it completed?), then by the stop: never "
        "another attempt's")

    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]).startswith("still stopping: "), "asked again while they stop"
    assert [r for r in k8s.requests if r.method == "DELETE"] == [], "being deleted already: not deleted again"

    k8s.pods_removed()  # its pods are gone, and with them the Job
    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]) == f"Kubernetes Job {old_job} and its pods are gone; restarted"
    deleted = [r.url.path.rsplit("/", 2)[-2:] for r in k8s.requests if r.method == "DELETE"]
    assert deleted == [["configmaps", old_job], ["secrets", f"{old_job}-token"]]
    run.refresh_from_db()
    assert (run.state, run.restart_count, run.job_id) == (RunState.QUEUED, 1, "")

    k8s.created.clear()
    assert run.pk in runs_schedule(now=timezone.now())
    start_run(run_id=run.pk)
    run.refresh_from_db()
    secret, config_map, job = k8s.created
    assert run.job_id == job["metadata"]["name"] == config_map["metadata"]["name"] == f"forgeboard-run-{run.pk}-1"
    assert secret["metadata"]["name"] == f"forgeboard-run-{run.pk}-1-token", "not the old Secret, which would 409"
    assert run_token_authenticate(raw=secret["stringData"]["token"]).run_id == run.pk


def test_a_lost_runs_job_deleted_without_its_pods_is_not_stopped_while_they_terminate(
        team, k8s, asks, django_capture_on_commit_callbacks):  # noqa: F811
    """`kubectl delete job` (the background cascade) removes the Job at once and leaves its pods Terminating: pod 0's
    engine may run on through its grace period (saving a checkpoint), or for as long as its node does not answer. The
    Job being gone does not stop the run's engine: the restart waits until its pods are gone too."""
    run, old_job = _launched(team, K8S_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    k8s.show("k8s_stopping_job_gone")
    problem = (f"Kubernetes Job {old_job} is gone, but its pods are still stopping: forgeboard-run-42-0-x7k2p on "
               "gpu-node-07 terminating, forgeboard-run-42-1-q9m4d on gpu-node-08 terminating")
    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]) == f"still stopping: {problem}"
    assert [r for r in k8s.requests if r.method == "DELETE"] == [], "its pods are being deleted already"
    [pods] = [r for r in k8s.requests if r.url.path.endswith("/pods")]
    assert pods.url.params["labelSelector"] == f"batch.kubernetes.io/job-name={old_job}"
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED) == [{
        "name": PREVIOUS_ATTEMPT_NOT_STOPPED, "attempt": f"Kubernetes Job {old_job}", "problem": problem}]

    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    k8s.pods = k8s.pods[:1]  # pod 1 is gone; pod 0 still terminates
    assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == (
        f"still stopping: Kubernetes Job {old_job} is gone, but its pods are still stopping: "
        "forgeboard-run-42-0-x7k2p on gpu-node-07 terminating")
    assert Run.objects.get(pk=run.pk).state == RunState.LOST

    k8s.pods_removed()
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    with django_capture_on_commit_callbacks(execute=True):
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]) == (
            f"Kubernetes Job {old_job} and its pods are gone; restarted")
    run.refresh_from_db()
    assert (run.state, run.restart_count) == (RunState.QUEUED, 1)


def test_a_lost_runs_pods_left_without_their_job_are_deleted_before_it_restarts(team, k8s, asks):  # noqa: F811
    """`kubectl delete job --cascade=orphan` leaves the Job's pods running without an owner: nothing else will delete
    them, so the stop does, pod by pod, and confirms once they are gone."""
    run, old_job = _launched(team, K8S_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    k8s.show("k8s_orphaned_pods")
    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]) == (
        f"still stopping: Kubernetes Job {old_job} is gone, but its pods are still stopping: forgeboard-run-42-0-x7k2p "
        "on gpu-node-07 left without its Job, deleted now, forgeboard-run-42-1-q9m4d on gpu-node-08 left without its "
        "Job, deleted now")
    deleted = [r.url.path for r in k8s.requests if r.method == "DELETE"]
    assert deleted == ["/api/v1/namespaces/research/pods/forgeboard-run-42-0-x7k2p",
                       "/api/v1/namespaces/research/pods/forgeboard-run-42-1-q9m4d"]

    k8s.requests.clear()
    assert stop_attempt(**ask["kwargs"]).endswith("forgeboard-run-42-1-q9m4d on gpu-node-08 terminating")
    assert [r for r in k8s.requests if r.method == "DELETE"] == [], "being deleted now: not deleted again"
    assert Run.objects.get(pk=run.pk).state == RunState.LOST

    k8s.pods_removed()
    assert stop_attempt(**ask["kwargs"]).endswith("and its pods are gone; restarted")


def test_a_pod_deletion_the_api_server_refuses_is_said_and_asked_again(team, k8s, asks):  # noqa: F811
    """The worker's role may not delete pods: the stop is not confirmed, the timeline says why, the next pass asks
    again."""
    run, old_job = _launched(team, K8S_YAML)
    run = _silent(run)
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    k8s.show("k8s_orphaned_pods")
    refusal = 'pods "forgeboard-run-42-0-x7k2p" is forbidden: User "system:serviceaccount:forgeboard:worker"'
    k8s.refuse_deleting["pods"] = (403, f'{refusal} cannot delete resource "pods"')
    assert stop_attempt(**ask["kwargs"]) == (
        f'not stopped: deleting Pod forgeboard-run-42-0-x7k2p: HTTP 403: {refusal} cannot delete resource "pods"')
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
    assert "cannot delete resource" in _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[-1]["problem"]

    del k8s.refuse_deleting["pods"]  # the worker's role may delete pods now
    assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
    assert stop_attempt(**_stop_asked(asks, run)["kwargs"]).startswith(
        f"still stopping: Kubernetes Job {old_job} is gone, but its pods are still stopping")


def _engine(run_id: int | None, *, ignore_term: bool = False) -> subprocess.Popen:
    """A sleeping process in a process group of its own, with the run's id in its environment as an engine has;
    reaped when it ends, as its supervisor (or init) would."""
    env = dict(os.environ)
    env.pop(RUN_ID_ENV, None)
    if run_id is not None:
        env[RUN_ID_ENV] = str(run_id)
    code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('ready', flush=True)\ntime.sleep(600)")
    engine = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, stdout=subprocess.PIPE)
    assert engine.stdout.readline() == b"ready\n"
    threading.Thread(target=engine.wait, daemon=True).start()
    return engine


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_lost_local_runs_engine_is_killed_on_its_host_before_it_restarts(team, grpo_yaml, asks, monkeypatch,
                                                                             ignore_term):
    monkeypatch.setattr(local, "STOP_GRACE_SECONDS", 2.0)
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    engine = _engine(run.pk, ignore_term=ignore_term)
    try:
        Run.objects.filter(pk=run.pk).update(pid=engine.pid, host=socket.gethostname())
        run = _silent(Run.objects.get(pk=run.pk))
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        ask = _stop_asked(asks, run)
        assert ask["queue"] == f"probe.{socket.gethostname()}", "a worker on the engine's host"
        assert not _gone(engine.pid)
        assert stop_lost_attempt(**ask["kwargs"]).endswith("restarted"), "the task the worker runs"
        assert _gone(engine.pid)
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
        [stopped] = _messages(run, PREVIOUS_ATTEMPT_STOPPED)
        assert stopped["detail"] == (f"its engine (pid {engine.pid} on {socket.gethostname()}) stopped with "
                                     f"{'SIGKILL' if ignore_term else 'SIGTERM'}")
    finally:
        if not _gone(engine.pid):
            os.killpg(engine.pid, signal.SIGKILL)


def test_a_pid_reused_by_another_process_is_left_alone_and_the_run_restarts(team, grpo_yaml, asks):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    stranger = _engine(None)  # its pid recorded as the engine's, but it is not the run's
    try:
        Run.objects.filter(pk=run.pk).update(pid=stranger.pid, host=socket.gethostname())
        run = _silent(Run.objects.get(pk=run.pk))
        runs_reconcile(now=timezone.now())
        assert stop_attempt(**_stop_asked(asks, run)["kwargs"]).endswith("had exited; restarted")
        assert not _gone(stranger.pid) and Run.objects.get(pk=run.pk).state == RunState.QUEUED
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)


def test_an_engine_on_another_host_is_not_stopped_from_here_and_the_run_waits(team, grpo_yaml, asks):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(pid=4242, host="gpu-node-7")
    run = _silent(Run.objects.get(pk=run.pk))
    runs_reconcile(now=timezone.now())
    ask = _stop_asked(asks, run)
    assert ask["queue"] == "probe.gpu-node-7", "only a worker on gpu-node-7 can reach its engine"
    assert stop_attempt(**ask["kwargs"]).startswith("not stopped: the engine runs on gpu-node-7")
    assert Run.objects.get(pk=run.pk).state == RunState.LOST
    assert _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)[0]["attempt"] == "its engine (pid 4242 on gpu-node-7)"


def test_a_lost_run_that_never_started_an_engine_restarts_at_once_and_its_old_token_is_refused(
        client, team, grpo_yaml, asks, django_capture_on_commit_callbacks):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    old_token = run_token_issue(run=run)
    run = _silent(run)
    with django_capture_on_commit_callbacks(execute=True):
        report = runs_reconcile(now=timezone.now())
    assert report.restarted == [run.pk] and not [a for a in asks if a["name"] == "runs.stop_attempt"]
    run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    response = client.post(f"/api/v1/controller/runs/{run.pk}/telemetry", data=json.dumps({"batches": []}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {old_token}")
    assert response.status_code == 401
    run.refresh_from_db()
    assert run.state == RunState.LAUNCHING and run.last_heartbeat_at is None, "the old controller's report is refused"


def test_an_engine_on_a_host_that_is_down_does_not_hold_back_the_restart(
        team, grpo_yaml, asks, django_capture_on_commit_callbacks):
    Host.objects.create(hostname="gpu-node-7", liveness=HostLiveness.DOWN)
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    Run.objects.filter(pk=run.pk).update(pid=4242, host="gpu-node-7")
    run = _silent(Run.objects.get(pk=run.pk))
    with django_capture_on_commit_callbacks(execute=True):
        report = runs_reconcile(now=timezone.now())
    assert report.restarted == [run.pk] and not [a for a in asks if a["name"] == "runs.stop_attempt"]
    run.refresh_from_db()
    assert (run.state, run.pid) == (RunState.QUEUED, None)
    [said] = _messages(run, PREVIOUS_ATTEMPT_NOT_STOPPED)
    assert said["attempt"] == "its engine (pid 4242 on gpu-node-7)"
    assert said["problem"].startswith("gpu-node-7 is down: its engine cannot be reached to stop it")
    assert "stop its process group 4242 there" in said["problem"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_on_the_engines_host_takes_the_ask_and_kills_the_engine_of_a_run_out_of_restarts(
        team, grpo_yaml, tmp_path):
    """Through the configured broker: the ask reaches the worker on the engine's host by its probe queue. The run is
    out of restarts, so it fails at once, and its engine is stopped all the same."""
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    engine = _engine(run.pk)
    try:
        with celery_worker(tmp_path / "worker.log"):  # purges the launch queued above
            Run.objects.filter(pk=run.pk).update(
                state=RunState.RUNNING, max_restarts=0, pid=engine.pid, host=socket.gethostname(),
                last_heartbeat_at=timezone.now() - timedelta(seconds=120))
            assert runs_reconcile(now=timezone.now()).failed == [run.pk]
            wait_for(lambda: _gone(engine.pid), timeout=60, what="the engine to be stopped")
            wait_for(lambda: _messages(run, PREVIOUS_ATTEMPT_STOPPED), timeout=30, what="the stop on the timeline")
        run.refresh_from_db()
        assert run.state == RunState.FAILED and run.restart_count == 0
        assert _messages(run, PREVIOUS_ATTEMPT_STOPPED)[0]["detail"].endswith("stopped with SIGTERM")
    finally:
        if not _gone(engine.pid):
            os.killpg(engine.pid, signal.SIGKILL)


def test_a_launch_that_fails_after_its_job_was_queued_has_the_job_stopped(team, slurm, asks):  # noqa: F811
    """The job was queued and recorded, then the launch failed (the worker raised after sbatch): the run fails, and its
    job, which nothing follows once the run has failed, is asked to stop at every pass until SLURM confirms it."""
    from forgeboard.runs.reconcile import runs_reconcile
    from workers.launch.jobs import launch_failed

    run, job = _launched(team, SLURM_YAML)
    assert run.state == RunState.LAUNCHING and job
    launch_failed(run_id=run.pk, reason="launch failed: the worker's connection dropped")
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.leftover_stop_since is not None
    slurm.job("squeue", 18004, as_id=job)  # the job runs on
    report = runs_reconcile(now=timezone.now())
    assert report.leftover_stopping == [run.pk]
    assert _stop_asked(asks, run)["kwargs"]["job_id"] == job


def test_a_launch_that_fails_before_anything_was_queued_leaves_nothing_to_stop(team, slurm):  # noqa: F811
    from workers.launch.jobs import launch_failed

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    assert run.pk in runs_schedule(now=timezone.now())
    launch_failed(run_id=run.pk, reason="sbatch: error: invalid partition")
    run.refresh_from_db()
    assert run.state == RunState.FAILED and run.leftover_stop_since is None


def _stuck_supervisor(folder, *, engine_pid: int) -> subprocess.Popen:
    """A supervisor of the run's engine, stuck once it has marked its progress (a database call that never returns),
    holding the supervisor lock through the real `supervising`, as a live supervisor does."""
    code = ("import time\nfrom pathlib import Path\nfrom workers.launch.supervisor_lock import supervising\n"
            f"with supervising(Path({str(folder)!r})) as marks:\n"
            f"    marks.progressed(engine_pid={engine_pid})\n"
            "    print('ready', flush=True)\n    time.sleep(600)\n")
    supervisor = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                                  start_new_session=True, stdout=subprocess.PIPE)
    assert supervisor.stdout.readline() == b"ready\n"
    return supervisor


def test_a_lost_runs_supervisor_stuck_after_its_engine_exited_is_killed_and_the_run_restarts(team, grpo_yaml, asks,
                                                                                              monkeypatch):
    """Its engine has exited, but its supervisor holds its lock and makes no progress: while it may still be settling
    the run the stop waits (it is asked again), but one with no progress for STALL_SECONDS is our own process stuck,
    killed, and the run restarts. On the old code the stop waited for it at every pass and the run failed at the stop
    timeout, 15 minutes on."""
    from forgeboard.runs.folders import run_dir
    from workers.launch import supervisor_lock

    monkeypatch.setattr(supervisor_lock, "SETTLE_GRACE_SECONDS", 0.5)
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    engine = _engine(run.pk)
    os.killpg(engine.pid, signal.SIGKILL)
    wait_for(lambda: _gone(engine.pid), timeout=10, what="the engine to exit")
    folder = run_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    supervisor = _stuck_supervisor(folder, engine_pid=engine.pid)
    try:
        Run.objects.filter(pk=run.pk).update(pid=engine.pid, host=socket.gethostname())
        run = _silent(Run.objects.get(pk=run.pk))
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        settling = "still stopping: it has exited, but its supervisor has not yet recorded how it ended"
        assert stop_lost_attempt(**_stop_asked(asks, run)["kwargs"]) == settling
        assert supervisor.poll() is None, "a supervisor that made progress just now is left to settle"

        [mark] = folder.glob("supervisor-*.progress")
        long_ago = mark.stat().st_mtime - 120  # its last progress, two minutes ago
        os.utime(mark, (long_ago, long_ago))
        assert runs_reconcile(now=timezone.now()).stopping == [run.pk]
        answer = stop_lost_attempt(**_stop_asked(asks, run)["kwargs"])

        killed = (re.escape(f"its supervisor (pid {supervisor.pid}) had made no progress for ") + r"12\d"
                  + re.escape(" s after its engine exited: killed"))
        assert re.fullmatch(rf"its engine \(pid {engine.pid} on {socket.gethostname()}\) had exited; {killed}; "
                            "restarted", answer), answer
        assert supervisor.wait(timeout=10) == -signal.SIGKILL
        run.refresh_from_db()
        assert (run.state, run.restart_count, run.pid) == (RunState.QUEUED, 1, None)
        [stopped] = _messages(run, PREVIOUS_ATTEMPT_STOPPED)
        assert re.fullmatch(rf"its engine .* had exited; {killed}", stopped["detail"]), stopped["detail"]
        assert not list(folder.glob("supervisor-*.progress"))
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
