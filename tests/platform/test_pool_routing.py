"""A claimed run is started by a worker of its host's node pool (Celery queue `launch.<pool>`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.db.models import Max

from forgeboard.cluster.models import Health, Host
from forgeboard.cluster.services import host_register
from forgeboard.errors import ValidationFailed
from forgeboard.experiments.services import config_snapshot_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import launch_queue_for, run_launch_queue, run_transition
from forgeboard.runs.states import RunState
from tests.support.processes import REPO_DIR, celery_worker, platform_env, wait_for

MISSING_MODEL_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /nonexistent/forgeboard-test-model
"""


def test_the_queue_is_the_pool_of_the_host_holding_most_gpus():
    pools = {"a-1": "cpu", "g-1": "h200", "g-2": "a100"}
    assert launch_queue_for(allocation={"g-2": {"gpus": 2, "slots": 0}, "g-1": {"gpus": 6, "slots": 0}},
                            host_pools=pools) == "launch.h200"
    assert launch_queue_for(allocation={"a-1": {"gpus": 0, "slots": 1}}, host_pools=pools) == "launch.cpu"
    # A tie on GPUs and slots goes to the first host by name, whatever the allocation's order.
    assert launch_queue_for(allocation={"g-2": {"gpus": 4, "slots": 0}, "g-1": {"gpus": 4, "slots": 0}},
                            host_pools=pools) == "launch.h200"


def test_no_inventory_host_means_no_pool_queue():
    # The local demo's allocation names "(local)", which is not an inventory host; an empty one names nothing.
    assert launch_queue_for(allocation={"(local)": {"gpus": 0, "slots": 1}}, host_pools={}) is None
    assert launch_queue_for(allocation={}, host_pools={"a-1": "cpu"}) is None
    # A host that left the inventory is skipped in favour of one that is still there.
    assert launch_queue_for(allocation={"gone": {"gpus": 8, "slots": 0}, "a-1": {"gpus": 0, "slots": 1}},
                            host_pools={"a-1": "cpu"}) == "launch.cpu"


def _claimed(team, *, allocation: dict) -> Run:
    """A run claimed by a scheduler (launching) with this allocation, without enqueueing anything."""
    snapshot = config_snapshot_create(yaml_text=MISSING_MODEL_YAML, overrides=[], recipe="grpo")
    number = (Run.objects.filter(experiment=team.experiment).aggregate(n=Max("number"))["n"] or 0) + 1
    run = Run.objects.create(experiment=team.experiment, number=number, config=snapshot, launched_by=team.member)
    return run_transition(run_id=run.pk, from_state=RunState.QUEUED, to_state=RunState.LAUNCHING,
                          allocation=allocation)


def test_run_launch_queue_reads_the_allocation_and_the_inventory(team):
    host_register(actor=team.operator, hostname="node-a", pool="gpu-a")
    assert run_launch_queue(run_id=_claimed(team, allocation={"node-a": {"gpus": 0, "slots": 1}}).pk) == "launch.gpu-a"
    assert run_launch_queue(run_id=_claimed(team, allocation={"(local)": {"gpus": 0, "slots": 1}}).pk) is None


def test_a_pool_must_be_a_plain_name_because_it_names_a_queue(team):
    with pytest.raises(ValidationFailed) as caught:
        host_register(actor=team.operator, hostname="node-x", pool="gpu a/../b")
    assert caught.value.problems[0].field == "pool"
    assert not Host.objects.filter(hostname="node-x").exists()


def test_the_scheduling_worker_hands_a_run_for_another_pool_to_that_pool(team, settings, monkeypatch):
    """The worker that claims runs starts those of its own pool (or with no inventory host) and forwards the rest."""
    from workers import tasks

    settings.WORKER_POOL = "cpu"
    host_register(actor=team.operator, hostname="node-cpu", pool="cpu")
    host_register(actor=team.operator, hostname="node-h200", pool="h200")
    Host.objects.update(health=Health.HEALTHY)
    mine = _claimed(team, allocation={"node-cpu": {"gpus": 0, "slots": 1}})
    theirs = _claimed(team, allocation={"node-h200": {"gpus": 0, "slots": 1}})
    local = _claimed(team, allocation={"(local)": {"gpus": 0, "slots": 1}})
    started, forwarded = [], []
    monkeypatch.setattr("forgeboard.runs.scheduling.runs_schedule", lambda *, now: [mine.pk, theirs.pk, local.pk])
    monkeypatch.setattr("workers.launch.backends.start_run", lambda *, run_id: started.append(run_id))
    monkeypatch.setattr(tasks, "run_enqueue_start", lambda *, run_id, queue: forwarded.append((run_id, queue)))
    assert tasks._start_scheduled() == [mine.pk, theirs.pk, local.pk]
    assert started == [mine.pk, local.pk]
    assert forwarded == [(theirs.pk, "launch.h200")]


def test_runs_start_starts_only_a_run_still_waiting_to_be_started(team, monkeypatch):
    from workers.tasks import start_claimed_run

    started = []
    monkeypatch.setattr("workers.launch.backends.start_run", lambda *, run_id: started.append(run_id) or True)
    waiting = _claimed(team, allocation={})
    assert start_claimed_run(waiting.pk) == "started"
    Run.objects.filter(pk=waiting.pk).update(pid=4242)  # its supervisor already runs: a second start is refused
    assert start_claimed_run(waiting.pk) == "skipped"
    failed = _claimed(team, allocation={})
    run_transition(run_id=failed.pk, from_state=RunState.LAUNCHING, to_state=RunState.FAILED, reason="test")
    assert start_claimed_run(failed.pk) == "skipped"
    assert started == [waiting.pk]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_of_the_pool_starts_a_run_sent_to_its_pool_queue(team, tmp_path):
    """A real worker started with FORGEBOARD_WORKER_POOL consumes launch.<pool>, besides its -Q queues."""
    from forgeboard.runs.services import run_enqueue_start

    host_register(actor=team.operator, hostname="node-a", pool="gpu-a")
    run = _claimed(team, allocation={"node-a": {"gpus": 0, "slots": 1}})
    with celery_worker(tmp_path / "worker.log", FORGEBOARD_WORKER_POOL="gpu-a"):
        assert "launch.gpu-a" in (tmp_path / "worker.log").read_text()
        run_enqueue_start(run_id=run.pk, queue=run_launch_queue(run_id=run.pk))
        state = wait_for(
            lambda: Run.objects.filter(pk=run.pk, state__in=[RunState.FAILED, RunState.SUCCEEDED])
            .values_list("state", flat=True).first(),
            timeout=90, what="the run to end",
        )
    run.refresh_from_db()
    assert state == RunState.FAILED
    # The engine itself ran (and refused the missing model): the worker started the run, not a fallback.
    assert "engine exited with code 2" in run.exit_reason, run.exit_reason


def test_a_bad_worker_pool_stops_startup_naming_the_variable():
    result = subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), "check"], capture_output=True, text=True,
                            env=platform_env(FORGEBOARD_WORKER_POOL="gpu a"), timeout=120)
    assert result.returncode != 0
    assert "FORGEBOARD_WORKER_POOL: expected 1-100 letters" in result.stderr

