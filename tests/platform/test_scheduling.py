"""The run queue: demand from the placement, capacity from the inventory, priorities, quotas, never-fits, races."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.db.models import Max
from django.utils import timezone

from forgeboard.accounts.models import Project
from forgeboard.accounts.services import project_create
from forgeboard.audit.models import AuditEvent
from forgeboard.cluster.models import Device, DeviceKind, Health, Host, HostLiveness
from forgeboard.errors import PermissionDenied, ValidationFailed
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import config_snapshot_create, experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.demand import LOCAL_HOST, run_demand
from forgeboard.runs.scheduling import project_quota_set, runs_schedule
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import RunState
from forgeboard.telemetry.models import RunEvent
from workers.engine.config import RunConfig


def _queued(team, grpo_yaml, *overrides: str, priority: int = 0, experiment: Experiment | None = None) -> Run:
    """A queued run, made without enqueueing a Celery launch (these tests call the scheduler themselves)."""
    experiment = experiment or team.experiment
    snapshot = config_snapshot_create(yaml_text=grpo_yaml, overrides=list(overrides), recipe=experiment.recipe)
    number = (Run.objects.filter(experiment=experiment).aggregate(n=Max("number"))["n"] or 0) + 1
    return Run.objects.create(experiment=experiment, number=number, config=snapshot, priority=priority,
                              launched_by=team.member)


def _gpus(n: int, per_host: int | None = None) -> tuple[str, ...]:
    """Overrides for a trainer of n ranks with one GPU each, at most per_host ranks (default: all) on one host."""
    return (f"trainer.ranks={n}", "placement.trainer.gpus_per_proc=1",
            f"placement.trainer.procs_per_host={per_host or n}")


def _host(name: str, gpus: int, *, liveness: str = HostLiveness.UP, unhealthy: int = 0) -> Host:
    host = Host.objects.create(hostname=name, liveness=liveness,
                               health=Health.UNHEALTHY if unhealthy or liveness == HostLiveness.DOWN else Health.HEALTHY)
    for index in range(gpus):
        Device.objects.create(host=host, kind=DeviceKind.GPU, index=index, model="H200",
                              health=Health.UNHEALTHY if index < unhealthy else Health.HEALTHY)
    return host


def _schedule() -> list[int]:
    return runs_schedule(now=timezone.now())


def _end(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(state=RunState.SUCCEEDED)


@pytest.fixture(autouse=True)
def two_slots(settings):
    settings.LOCAL_RUN_SLOTS = 2


def test_demand_counts_processes_and_gpus_per_role(team, grpo_yaml):
    config = _queued(team, grpo_yaml, *_gpus(4, per_host=2), "generator.replicas=2",
                     "placement.generator.gpus_per_proc=1", "reference.enabled=true",
                     "placement.backend=monarch", "placement.reward.colocate_with=trainer").config.run_config
    demand = run_demand(config)
    # the reward follows the trainer's host in procs of its own
    assert {r.role: r.procs for r in demand.roles} == {"trainer": 4, "generator": 2, "reference": 1, "reward": 1,
                                                       "replay_buffer": 1}
    assert (demand.processes, demand.gpus, demand.resource) == (9, 6, "gpus")
    sft = run_demand(RunConfig.model_validate({"recipe": "sft", "model": {"path": "/models/m"}, "trainer": {"ranks": 1},
                                               "generator": {"replicas": 3}}))
    assert [(r.role, r.procs, r.gpus) for r in sft.roles] == [("trainer", 1, 0)]
    assert sft.resource == "slots"


def test_cpu_runs_take_local_slots_by_priority_then_age(team, grpo_yaml):
    low_old = _queued(team, grpo_yaml)
    high_old = _queued(team, grpo_yaml, priority=5)
    low_new = _queued(team, grpo_yaml)
    high_new = _queued(team, grpo_yaml, priority=5)
    assert _schedule() == [high_old.pk, high_new.pk]
    high_old.refresh_from_db()
    assert high_old.state == RunState.LAUNCHING and high_old.allocation == {LOCAL_HOST: {"gpus": 0, "slots": 1}}
    assert _schedule() == []  # both slots are held
    _end(high_old)
    assert _schedule() == [low_old.pk]
    assert Run.objects.get(pk=low_new.pk).state == RunState.QUEUED
    path = [e.payload["to"] for e in RunEvent.objects.filter(run=low_old, kind="state_changed").order_by("seq")]
    assert path == ["launching"]


def test_active_runs_without_an_allocation_still_hold_capacity(team, grpo_yaml):
    legacy = _queued(team, grpo_yaml)
    Run.objects.filter(pk=legacy.pk).update(state=RunState.RUNNING)  # started before allocations were kept
    first, second = _queued(team, grpo_yaml), _queued(team, grpo_yaml)
    assert _schedule() == [first.pk]
    assert Run.objects.get(pk=second.pk).state == RunState.QUEUED


def test_gpu_runs_fit_hosts_and_wait_for_free_gpus(team, grpo_yaml):
    _host("big", 4)
    _host("small", 2)
    _host("broken", 8, unhealthy=1)  # unhealthy: none of its GPUs count
    _host("gone", 8, liveness=HostLiveness.DOWN)
    four = _queued(team, grpo_yaml, *_gpus(4, per_host=4), priority=3)
    two = _queued(team, grpo_yaml, *_gpus(2, per_host=2), priority=2)
    waits = _queued(team, grpo_yaml, *_gpus(2, per_host=2), priority=1)
    assert _schedule() == [four.pk, two.pk]
    assert Run.objects.get(pk=four.pk).allocation == {"big": {"gpus": 4, "slots": 0}}
    assert Run.objects.get(pk=two.pk).allocation == {"small": {"gpus": 2, "slots": 0}}
    assert Run.objects.get(pk=waits.pk).state == RunState.QUEUED
    _end(four)
    assert _schedule() == [waits.pk]
    assert Run.objects.get(pk=waits.pk).allocation == {"big": {"gpus": 2, "slots": 0}}


def test_ranks_spread_over_hosts_at_most_procs_per_host_each(team, grpo_yaml):
    _host("a", 2)
    _host("b", 2)
    _host("c", 1)
    spread = _queued(team, grpo_yaml, *_gpus(4, per_host=2))
    assert _schedule() == [spread.pk]
    assert Run.objects.get(pk=spread.pk).allocation == {"a": {"gpus": 2, "slots": 0}, "b": {"gpus": 2, "slots": 0}}
    pinned = _queued(team, grpo_yaml, *_gpus(1), "placement.trainer.hosts=[a]")
    anywhere = _queued(team, grpo_yaml, *_gpus(1))
    # The pinned run waits for host a; the run behind it needs GPUs too, so it waits as well (no starvation).
    assert _schedule() == []
    cpu = _queued(team, grpo_yaml)
    assert _schedule() == [cpu.pk]  # CPU runs compete for slots, not GPUs
    _end(spread)
    assert _schedule() == [pinned.pk, anywhere.pk]
    assert Run.objects.get(pk=pinned.pk).allocation == {"a": {"gpus": 1, "slots": 0}}


def test_project_quotas_hold_runs_without_blocking_other_projects(team, grpo_yaml):
    _host("h", 8)
    project_quota_set(actor=team.operator, project=team.project, max_concurrent_runs=2, max_gpus=3)
    other = project_create(actor=team.owner, slug="beta", name="Beta")
    beta = experiment_create(actor=team.owner, project=other, name="math", recipe="grpo")
    first = _queued(team, grpo_yaml, *_gpus(2), priority=9)
    over_gpus = _queued(team, grpo_yaml, *_gpus(2), priority=8)  # 2 + 2 > 3
    cpu = _queued(team, grpo_yaml, priority=7)
    over_runs = _queued(team, grpo_yaml, priority=6)  # a third active run
    beta_run = _queued(team, grpo_yaml, *_gpus(4), experiment=beta)
    assert _schedule() == [first.pk, cpu.pk, beta_run.pk]
    assert Run.objects.get(pk=over_gpus.pk).state == Run.objects.get(pk=over_runs.pk).state == RunState.QUEUED
    _end(first)
    assert _schedule() == [over_gpus.pk]
    project_quota_set(actor=team.operator, project=team.project, max_concurrent_runs=None, max_gpus=None)
    assert _schedule() == [over_runs.pk]


def test_runs_that_can_never_fit_fail_with_the_reason(team, grpo_yaml):
    _host("h1", 4)
    _host("h2", 2, liveness=HostLiveness.DOWN)  # down now, but it may come back: it counts for never-fits
    too_big = _queued(team, grpo_yaml, *_gpus(8, per_host=8))
    too_wide = _queued(team, grpo_yaml, *_gpus(6, per_host=3))
    unknown = _queued(team, grpo_yaml, *_gpus(1), "placement.trainer.hosts=[nowhere]")
    waits = _queued(team, grpo_yaml, *_gpus(6, per_host=4))  # 4 on h1 + 2 on h2 once h2 is back
    small = project_create(actor=team.owner, slug="small", name="Small")
    project_quota_set(actor=team.operator, project=small, max_concurrent_runs=None, max_gpus=1)
    over_quota = _queued(team, grpo_yaml, *_gpus(2),
                         experiment=experiment_create(actor=team.owner, project=small, name="m", recipe="grpo"))
    split_cpu = _queued(team, grpo_yaml, "placement.trainer.hosts=[h1]", "placement.generator.hosts=[h2]")
    assert _schedule() == []
    reasons = {run.pk: Run.objects.get(pk=run.pk) for run in (too_big, too_wide, unknown, over_quota, waits, split_cpu)}
    assert all(reasons[r.pk].state == RunState.FAILED for r in (too_big, too_wide, unknown, over_quota, split_cpu))
    assert "pinned to hosts with no host in common" in reasons[split_cpu.pk].exit_reason
    assert "puts 8 GPUs on one host; the largest host has 4" in reasons[too_big.pk].exit_reason
    assert "needs 6 GPUs (trainer 6×1 GPU, ≤3 per host); the whole cluster (2 hosts, 6 GPUs) cannot hold it" in \
        reasons[too_wide.pk].exit_reason
    assert "placement.trainer.hosts names nowhere: not in the cluster inventory" in reasons[unknown.pk].exit_reason
    assert "needs 2 GPUs but project 'small' may hold at most 1" in reasons[over_quota.pk].exit_reason
    assert reasons[too_big.pk].exit_reason.startswith("cannot be scheduled: ")
    assert reasons[waits.pk].state == RunState.QUEUED
    path = [e.payload["to"] for e in RunEvent.objects.filter(run=too_big, kind="state_changed").order_by("seq")]
    assert path == ["launching", "failed"]


def test_gpu_run_on_a_machine_without_inventory_never_fits(team, grpo_yaml):
    run = _queued(team, grpo_yaml, *_gpus(1))
    assert _schedule() == []
    run.refresh_from_db()
    assert run.state == RunState.FAILED and "the largest host has 0" in run.exit_reason


def test_a_run_may_start_at_most_64_processes_without_a_gpu(team, grpo_yaml):
    """CPU processes are not capacity the scheduler counts (a CPU-only run takes one slot), so one config could start
    thousands on a shared host: a launch asking for more than 64 is refused at the field to change, and a queued one
    fails with the reason. GPU procs are bounded by the GPUs and do not count."""
    _host("h1", 8)
    with pytest.raises(ValidationFailed) as raised:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml,
                   overrides=["placement.backend=monarch", "generator.replicas=100000"])
    assert [p.field for p in raised.value.problems] == ["config.generator.replicas"]
    assert "starts 100003 processes without a GPU (trainer 1, generator 100000, reward 1, replay_buffer 1); a run " \
           "may start at most 64" in raised.value.problems[0].message
    many = _queued(team, grpo_yaml, "placement.backend=monarch", "trainer.ranks=62")
    fits = _queued(team, grpo_yaml, "placement.backend=monarch", "trainer.ranks=61")
    gpus = _queued(team, grpo_yaml, "placement.backend=monarch", *_gpus(8))
    started = _schedule()
    assert fits.pk in started and gpus.pk in started and many.pk not in started
    many.refresh_from_db()
    assert many.state == RunState.FAILED and "starts 65 processes without a GPU" in many.exit_reason


def test_quota_service_is_for_operators_validated_and_audited(team):
    with pytest.raises(PermissionDenied):
        project_quota_set(actor=team.owner, project=team.project, max_concurrent_runs=1, max_gpus=None)
    for field, kwargs in (("max_concurrent_runs", {"max_concurrent_runs": -1, "max_gpus": None}),
                          ("max_gpus", {"max_concurrent_runs": None, "max_gpus": True}),
                          ("max_gpus", {"max_concurrent_runs": 1, "max_gpus": "4"})):
        with pytest.raises(ValidationFailed) as raised:
            project_quota_set(actor=team.operator, project=team.project, **kwargs)
        assert raised.value.problems[0].field == field
    stored = Project.objects.get(pk=team.project.pk)
    assert (stored.max_concurrent_runs, stored.max_gpus) == (None, None)
    project_quota_set(actor=team.operator, project=team.project, max_concurrent_runs=3, max_gpus=0)
    stored.refresh_from_db()
    assert (stored.max_concurrent_runs, stored.max_gpus) == (3, 0)
    entry = AuditEvent.objects.get(action="project.quota")
    assert entry.payload["to"] == {"max_concurrent_runs": 3, "max_gpus": 0} and entry.actor == team.operator


def test_launch_task_starts_only_what_the_scheduler_claims(team, grpo_yaml, monkeypatch):
    from workers import tasks
    from workers.launch import backends

    started: list[int] = []
    monkeypatch.setattr(backends, "start_run", lambda *, run_id: started.append(run_id))
    _host("h", 2)
    fits = _queued(team, grpo_yaml, *_gpus(2))
    waits = _queued(team, grpo_yaml, *_gpus(2))
    never = _queued(team, grpo_yaml, *_gpus(3, per_host=3))
    assert tasks.launch_run(waits.pk) == "queued"  # the scheduler started `fits` (older) instead
    assert started == [fits.pk]
    assert tasks.launch_run(fits.pk) == "skipped"
    assert Run.objects.get(pk=never.pk).state == RunState.FAILED
    _end(fits)
    assert tasks.schedule_runs() == [waits.pk]
    assert started == [fits.pk, waits.pk]


@pytest.mark.django_db(transaction=True)
def test_concurrent_schedulers_start_each_run_once_and_never_overcommit(team, grpo_yaml):
    runs = [_queued(team, grpo_yaml) for _ in range(6)]
    contenders = 4
    barrier = threading.Barrier(contenders)
    results: list[list[int]] = []
    lock = threading.Lock()

    def schedule() -> None:
        try:
            barrier.wait()
            started = _schedule()
            with lock:
                results.append(started)
        finally:
            connection.close()

    threads = [threading.Thread(target=schedule) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    started = [run_id for result in results for run_id in result]
    assert len(results) == contenders
    assert sorted(started) == [runs[0].pk, runs[1].pk], results  # two slots, each run started once
    launching = Run.objects.filter(state=RunState.LAUNCHING).values_list("pk", flat=True)
    assert sorted(launching) == sorted(started)


def test_without_procs_per_host_trainer_ranks_share_a_host_and_replicas_may_too(team, grpo_yaml):
    """As the engine places them: all ranks on one host; generator replicas several to a host."""
    _host("a", 4)
    _host("b", 2)
    run = _queued(team, grpo_yaml, "placement.backend=monarch", "trainer.ranks=4", "placement.trainer.gpus_per_proc=1",
                  "generator.replicas=2", "placement.generator.gpus_per_proc=1")
    demand = run_demand(run.config.run_config)
    assert [r.describe() for r in demand.roles if r.gpus] == ["trainer 4×1 GPU, on one host", "generator 2×1 GPU"]
    assert _schedule() == [run.pk]
    assert Run.objects.get(pk=run.pk).allocation == {"a": {"gpus": 4, "slots": 0}, "b": {"gpus": 2, "slots": 0}}
