"""A real Celery worker process picks up a launch through the configured broker (Redis or embedded)."""

from __future__ import annotations

import pytest

from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from tests.support.processes import celery_worker, wait_for

MISSING_MODEL_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /nonexistent/forgeboard-test-model
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_worker_claims_launches_and_records_a_failing_engine(team, tmp_path):
    with celery_worker(tmp_path / "worker.log"):
        run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=MISSING_MODEL_YAML)
        state = wait_for(
            lambda: Run.objects.filter(pk=run.pk, state__in=[RunState.FAILED, RunState.SUCCEEDED])
            .values_list("state", flat=True).first(),
            timeout=90, what="the run to end",
        )
    run.refresh_from_db()
    assert state == RunState.FAILED
    assert "engine exited with code 2" in run.exit_reason
    assert "model.path" in run.exit_reason, run.exit_reason
    assert run.pid and run.host and run.log_path.endswith("engine.log")
    path = [e.payload["to"] for e in RunEvent.objects.filter(run=run, kind="state_changed").order_by("seq")]
    assert path == ["queued", "launching", "running", "failed"]


@pytest.mark.parametrize("backend", ["monarch", "slurm", "kubernetes"])
def test_a_backend_this_worker_lacks_fails_the_run_with_the_reason(team, backend):
    from forgeboard.runs.services import run_transition
    from workers.launch.backends import start_run

    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=MISSING_MODEL_YAML)
    Run.objects.filter(pk=run.pk).update(backend=backend)
    run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING)
    start_run(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.exit_reason == f"launch backend {backend!r} is not configured on this worker"
