"""Cancelling a SLURM run before or while its launch submits it, on the real test cluster (slurmctld, slurmdbd and
two slurmd nodes: tests/support/slurm_cluster.py) with real sbatch, squeue, scancel and sacct.

A run cancelled before the launch's check is never sbatched: no job of it is ever queued, and it ends cancelled at
once. One cancelled while sbatch queues its job (after the check, before the job id is recorded) has that job
scancelled by the launch as soon as it is recorded, and ends cancelled at once, not at the poller's next look.
"""

from __future__ import annotations

import json
import sys

import pytest
from django.utils import timezone

from forgeboard.runs.models import Run
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.processes import free_port, wait_for
from workers.launch.backends import start_run
from workers.launch.slurm import run_comment
from workers.launch.slurm_backend import SlurmCli

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SLURM_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /nonexistent/forgeboard-test-model
placement:
  backend: slurm
  trainer:
    procs_per_host: 1
trainer:
  ranks: 2
  steps: 2
  batch_size: 2
  threads_per_process: 1
grpo:
  group_size: 4
"""


@pytest.fixture
def cluster(slurm_cluster, settings, tmp_path):
    """This process is the launch.slurm worker; the cluster's nodes are kept busy by another job, so that a run's job
    waits in the queue (its state when it is scancelled does not depend on how fast the cluster starts it)."""
    settings.SLURM_PARTITION = "debug"
    settings.SLURM_VENV = sys.prefix
    settings.SLURM_CPUS_PER_NODE = 1
    settings.SLURM_MEMORY = "1000M"
    settings.SLURM_MONARCH_PORT = free_port()
    settings.SLURM_BIN_DIR = None
    settings.SLURM_IMAGE = None
    settings.PUBLIC_URL = "http://127.0.0.1:9"  # no engine gets to report: every job here is cancelled
    settings.DATA_DIR = tmp_path / "data"
    blocker = slurm_cluster.command("sbatch", "--parsable", "-N2", "--exclusive", "-o", "/dev/null", "--wrap",
                                    "sleep 600")
    assert blocker.returncode == 0, blocker.stderr
    try:
        wait_for(lambda: _job(slurm_cluster, "squeue", blocker.stdout.strip())["job_state"] == "RUNNING", timeout=60,
                 what="the job that fills the cluster to run")
        yield slurm_cluster
    finally:
        slurm_cluster.command("scancel", "--full", "--user=root")
        wait_for(lambda: not slurm_cluster.command("squeue", "-h").stdout.strip(), timeout=60,
                 what="the test's jobs to leave the queue")


def _jobs(cluster, program: str, *args: str) -> list[dict]:
    answer = cluster.command(program, "--json", *args)
    assert answer.returncode == 0, answer.stderr
    return json.loads(answer.stdout)["jobs"]


def _job(cluster, program: str, job_id: str) -> dict:
    return next(job for job in _jobs(cluster, program, f"--jobs={job_id}") if str(job["job_id"]) == job_id)


def _run_jobs(cluster, run: Run) -> list[str]:
    """Every job SLURM queued or accounted for the run (its comment names the run), whatever became of it."""
    found = set()
    # sacct lists a job cancelled before it started only when asked from before it was submitted
    for program, args in (("squeue", ()), ("sacct", ("--allusers", "--starttime=now-1hours"))):
        for job in _jobs(cluster, program, *args):
            comment = job.get("comment")
            text = comment.get("job", "") if isinstance(comment, dict) else (comment or "")
            if text == run_comment(run.pk):
                found.add(str(job["job_id"]))
    return sorted(found)


def _claimed(team) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    return Run.objects.get(pk=run.pk)


def test_a_run_cancelled_before_its_launch_is_never_sbatched(team, cluster):
    run = _claimed(team)
    run_cancel(actor=team.member, run=run)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.exit_reason, run.job_id) == (RunState.CANCELLED, "cancelled before it was submitted", "")
    assert _run_jobs(cluster, run) == [], "SLURM never saw a job for it"
    assert submitted is False, "nothing was submitted"


def test_a_job_queued_as_its_run_was_cancelled_is_scancelled_by_the_launch_at_once(team, cluster, monkeypatch):
    submit = SlurmCli.submit

    def submit_then_cancel(cli, request, *, folder):  # the operator cancels while sbatch queues the job
        try:
            return submit(cli, request, folder=folder)
        finally:
            run_cancel(actor=team.member, run=Run.objects.get(pk=request.run_id))

    monkeypatch.setattr(SlurmCli, "submit", submit_then_cancel)
    run = _claimed(team)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    job_id = run.job_id
    assert job_id and _run_jobs(cluster, run) == [job_id]
    assert run.state == RunState.CANCELLED
    assert run.exit_reason == f"cancelled while it was being submitted; SLURM job {job_id} removed"
    event = RunEvent.objects.get(run=run, kind="message", payload__name="job_submitted")
    assert event.payload["job_id"] == job_id
    wait_for(lambda: _job(cluster, "sacct", job_id)["state"]["current"] == "CANCELLED", timeout=60,
             what="accounting to record the job cancelled")
    wait_for(lambda: job_id not in cluster.command("squeue", "-h", "-o", "%i").stdout.split(), timeout=30,
             what="the job to leave the queue")
    assert _run_jobs(cluster, run) == [job_id], "accounting keeps it: what the test above finds none of"
    assert submitted is True, "it was submitted"
