"""A run cancelled while it is queued or launching is never submitted: the launch checks the run's state under its
row lock right before it submits, and a run being cancelled ends cancelled there, at once. A cancel that comes while
a cluster scheduler's submission is under way finds no job yet: the launch, once the job is recorded, removes it.

The local backend is real; SLURM's programs and Kubernetes' API server answer as recorded
(tests/platform/test_slurm_backend.py, test_kubernetes_backend.py). The real SLURM cluster's tests are in
tests/system/test_slurm_cancel_live.py; the local supervisor's own check, with the engine's start, in
test_local_supervisor_races.py.
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from forgeboard.runs.folders import run_dir
from forgeboard.runs.models import Run
from forgeboard.runs.scheduling import runs_schedule
from forgeboard.runs.services import run_cancel, run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.platform.test_kubernetes_backend import K8S_YAML, k8s  # noqa: F401 (a fixture)
from tests.platform.test_slurm_backend import SLURM_YAML, slurm  # noqa: F401 (a fixture)
from workers.launch import kubernetes_backend, slurm_backend
from workers.launch.backends import start_run
from workers.launch.jobs import launch_failed
from workers.launch.slurm_backend import SlurmCli, poll_slurm_runs
from workers.tasks import launch_run, start_claimed_run

MISSING_MODEL_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /nonexistent/forgeboard-test-model
"""
CANCELLED_BEFORE = "cancelled before it was submitted"


def _claimed(team, yaml: str) -> Run:
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=yaml)
    assert runs_schedule(now=timezone.now()) == [run.pk]
    return Run.objects.get(pk=run.pk)


def _cancelled(team, run: Run) -> Run:
    return run_cancel(actor=team.member, run=Run.objects.get(pk=run.pk))


def _path(run: Run) -> list[str]:
    return [e.payload["to"] for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]


def _submitted_events(run: Run) -> list[dict]:
    return [e.payload for e in RunEvent.objects.filter(run=run, kind="message", payload__name="job_submitted")]


@pytest.mark.django_db
def test_a_local_run_cancelled_before_its_launch_starts_no_supervisor(team, settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    run = _claimed(team, MISSING_MODEL_YAML)
    assert _cancelled(team, run).state == RunState.CANCELLING

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, CANCELLED_BEFORE)
    assert run.finished_at is not None and run.pid is None
    assert not run_dir(run).exists(), "no files written, no supervisor started"
    assert _path(run) == ["queued", "launching", "cancelling", "cancelled"]
    assert submitted is False, "nothing was submitted"


@pytest.mark.django_db
def test_a_start_routed_to_another_pool_ends_a_run_cancelled_before_it_and_submits_nothing(team, slurm):  # noqa: F811
    run = _claimed(team, SLURM_YAML)
    _cancelled(team, run)

    assert start_claimed_run(run.pk) == "skipped"

    run.refresh_from_db()
    assert (run.state, run.exit_reason) == (RunState.CANCELLED, CANCELLED_BEFORE)
    assert slurm.calls("sbatch") == [] and run.job_id == ""


@pytest.mark.django_db
def test_a_slurm_run_cancelled_before_its_launch_is_never_sbatched(team, slurm):  # noqa: F811
    run = _claimed(team, SLURM_YAML)
    _cancelled(team, run)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.exit_reason, run.job_id) == (RunState.CANCELLED, CANCELLED_BEFORE, "")
    assert slurm.calls("sbatch") == [] and slurm.calls("scancel") == []
    assert _submitted_events(run) == []
    assert submitted is False, "nothing was submitted"


@pytest.fixture
def cancelled_during_sbatch(team, monkeypatch):
    """The operator cancels while sbatch is queuing the run's job: after the launch's check, before its job id is
    recorded."""
    submit = SlurmCli.submit

    def submit_then_cancel(cli, request, *, folder):
        try:
            return submit(cli, request, folder=folder)
        finally:
            _cancelled(team, Run.objects.get(pk=request.run_id))

    monkeypatch.setattr(SlurmCli, "submit", submit_then_cancel)


@pytest.mark.django_db
def test_a_slurm_job_queued_as_its_run_was_cancelled_is_scancelled_by_the_launch(
        team, slurm, cancelled_during_sbatch):  # noqa: F811
    run = _claimed(team, SLURM_YAML)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    assert run.state == RunState.CANCELLED and run.job_id == "18004"
    assert run.exit_reason == "cancelled while it was being submitted; SLURM job 18004 removed"
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"]]
    assert [e["job_id"] for e in _submitted_events(run)] == ["18004"], "what was submitted stays on the timeline"
    assert _path(run) == ["queued", "launching", "cancelling", "cancelled"]
    assert poll_slurm_runs() == {}, "an ended run's job is followed no more"
    assert submitted is True, "it was submitted"


@pytest.mark.django_db
def test_a_job_the_launch_cannot_scancel_is_left_to_the_poller(team, slurm, cancelled_during_sbatch):  # noqa: F811
    slurm.answer("scancel", exit=1, stderr="scancel: error: Unable to contact slurm controller")
    run = _claimed(team, SLURM_YAML)

    start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.job_id) == (RunState.CANCELLING, "18004"), "the poller follows it: it has its job id"
    slurm.answer("scancel", stdout="")
    slurm.job("squeue", 18001, as_id="18004")  # pending, waiting for resources
    assert poll_slurm_runs() == {run.pk: "cancelled in the queue"}
    assert [c["args"] for c in slurm.calls("scancel")] == [["18004"], ["18004"]]
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED


@pytest.mark.django_db
def test_a_submission_refused_as_its_run_was_cancelled_ends_the_run_cancelled_at_once(
        team, slurm, cancelled_during_sbatch):  # noqa: F811
    """Nothing was queued and nothing follows the run: it does not wait the launch timeout for the reconciler."""
    slurm.answer("sbatch", exit=1, stderr="sbatch: error: Batch job submission failed: Invalid partition specified")
    run = _claimed(team, SLURM_YAML)

    start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.job_id) == (RunState.CANCELLED, "")
    assert run.exit_reason.startswith("cancelled while it was being submitted, which failed: SLURM refused the job: ")
    assert run.exit_reason.endswith("Invalid partition specified")
    assert slurm.calls("scancel") == []


@pytest.mark.django_db
def test_a_kubernetes_run_cancelled_before_its_launch_creates_nothing(team, k8s):  # noqa: F811
    run = _claimed(team, K8S_YAML)
    _cancelled(team, run)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    assert (run.state, run.exit_reason, run.job_id) == (RunState.CANCELLED, CANCELLED_BEFORE, "")
    assert k8s.requests == []
    assert submitted is False, "nothing was submitted"


@pytest.mark.django_db
def test_a_kubernetes_job_created_as_its_run_was_cancelled_is_deleted_by_the_launch(team, k8s, monkeypatch):  # noqa: F811
    run = _claimed(team, K8S_YAML)
    transport = kubernetes_backend.kubernetes_api().transport

    def cancel_as_the_job_is_created(request):
        if request.method == "POST" and request.url.path.endswith("/jobs"):
            _cancelled(team, run)  # the operator, while the API server creates the Job
        return k8s.handle(request)

    monkeypatch.setattr(transport, "handler", cancel_as_the_job_is_created)

    submitted = start_run(run_id=run.pk)

    run.refresh_from_db()
    name = f"forgeboard-run-{run.pk}"
    assert (run.state, run.job_id) == (RunState.CANCELLED, name)
    assert run.exit_reason == f"cancelled while it was being submitted; Kubernetes Job {name} removed"
    assert [(r.method, r.url.path.rsplit("/", 1)[-1]) for r in k8s.requests] == [
        ("POST", "secrets"), ("POST", "configmaps"), ("POST", "jobs"), ("PATCH", f"{name}-token"), ("PATCH", name),
        ("DELETE", name)]
    assert k8s.requests[-1].url.params["propagationPolicy"] == "Background", "its pods go with it"
    assert k8s.left(name) == [], "its Secret (the run's token) and ConfigMap go with the Job that owns them"
    assert submitted is True, "it was submitted"


@pytest.fixture
def cancelled_as_the_launch_raises(team, slurm, settings, tmp_path, monkeypatch):  # noqa: F811
    """The operator cancels while the launch prepares the run's SLURM job (after the launch's check), and the launch
    then raises: the run's folder cannot be made (the data folder is not a folder)."""
    settings.DATA_DIR = tmp_path / "data-is-a-file"
    settings.DATA_DIR.write_text("")
    request = slurm_backend.slurm_request

    def request_as_the_run_is_cancelled(*, run, folder):
        try:
            return request(run=run, folder=folder)
        finally:
            _cancelled(team, Run.objects.get(pk=run.pk))

    monkeypatch.setattr(slurm_backend, "slurm_request", request_as_the_run_is_cancelled)


@pytest.mark.django_db
@pytest.mark.parametrize("task", ["runs.launch", "runs.start"])
def test_a_launch_that_raises_as_its_run_is_cancelled_ends_the_run_cancelled_at_once(
        team, slurm, cancelled_as_the_launch_raises, settings, task):  # noqa: F811
    """Nothing was submitted and nothing follows the run: it ends cancelled with the launch's error, rather than stay
    cancelling until the reconciler ends it minutes later. Through either task that launches: the scheduler's
    (runs.launch, on a worker of the run's pool) or a start routed to this worker (runs.start)."""
    if task == "runs.launch":
        settings.WORKER_POOL = "slurm"  # this worker submits SLURM jobs: it starts the run it schedules
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=SLURM_YAML)
        assert launch_run(run.pk) == "launched"
    else:
        run = _claimed(team, SLURM_YAML)
        assert start_claimed_run(run.pk) == "failed"

    run.refresh_from_db()
    assert (run.state, run.job_id, run.pid) == (RunState.CANCELLED, "", None)
    assert run.exit_reason.startswith("cancelled while it was being submitted, which failed: launch failed: "
                                      "[Errno 20] Not a directory: "), run.exit_reason
    assert run.finished_at is not None
    assert _path(run) == ["queued", "launching", "cancelling", "cancelled"]
    assert slurm.calls("sbatch") == [] and _submitted_events(run) == []


@pytest.mark.django_db
def test_a_launch_that_failed_after_its_job_was_recorded_leaves_the_cancel_to_the_poller(
        team, slurm, cancelled_during_sbatch):  # noqa: F811
    """The job was queued and recorded, the cancel came meanwhile, and the launch failed after that (it could not
    remove the job, or raised): ended cancelled now, the run's job would run on with nobody following it. The poller
    removes it and ends the cancel."""
    slurm.answer("scancel", exit=1, stderr="scancel: error: Unable to contact slurm controller")
    run = _claimed(team, SLURM_YAML)
    start_run(run_id=run.pk)

    launch_failed(run_id=run.pk, reason="launch failed: the worker's connection dropped")

    run.refresh_from_db()
    assert (run.state, run.job_id) == (RunState.CANCELLING, "18004")
    slurm.answer("scancel", stdout="")
    slurm.job("squeue", 18001, as_id="18004")  # pending
    assert poll_slurm_runs() == {run.pk: "cancelled in the queue"}
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED
