"""Which process, host and replica a drill hits, and when planned drills fire, over fake hosts (no process is
spawned or signalled: signal drills are only targeted here; the in-actor kinds are injected)."""

from __future__ import annotations

import re
import time

import pytest

from tests.engine.fake_fleet import FakeActor, FakeHosts, FakeProcs, Fleet, controller_parts, fake_group, grpo_config
from workers.engine.actors.replica_group import ReplicaGroup
from workers.engine.controller.drill_targets import DrillTargets, measure_replica
from workers.engine.drills import DrillPlan
from workers.engine.operations import parse_operation


def drill(**fields) -> object:
    return parse_operation("fault_drill", fields)


def _targets(*, ranks: int = 2, plan: DrillPlan | None = None) -> tuple[Fleet, DrillTargets]:
    config = grpo_config("trainer: {procs_per_host: 1}", trainer=f"{{ranks: {ranks}}}")
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["b", "c"], spares=1), "reward": fake_group("reward", hosts, ["b"])}
    fleet = controller_parts(config, hosts, groups, trainer_hosts=["a", "b"][:ranks], trainer_pids=[101, 102][:ranks])
    groups["generator"].warm("b")
    targets = DrillTargets(plan=plan or DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                           groups=groups, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    return fleet, targets


def test_a_kill_hits_the_replicas_process_through_its_hosts_agent():
    fleet, targets = _targets()
    generator = fleet.groups["generator"].replicas[1]
    target = targets.target(drill(kind="kill", role="generator", replica=1))
    assert (target.role, target.replica, target.pids, target.signals.where) == ("generator", 1, generator.pids, "c")
    rank1 = targets.target(drill(kind="hang", role="trainer", replica=1))
    assert (rank1.pids, rank1.signals.where) == ([102], "b"), "a trainer rank by its rank's host"


def test_a_slow_host_drill_hits_every_process_of_the_run_on_that_host():
    fleet, targets = _targets()
    target = targets.target(drill(kind="slow_host", role="generator", replica=0, duration_s=5, duty_cycle=0.5))
    generators, reward = fleet.groups["generator"], fleet.groups["reward"].replicas[0]
    spare = generators.spare_replicas()[0]
    on_b = [*generators.replicas[0].pids, 102, *reward.pids, *spare.pids]
    assert sorted(target.pids) == sorted(on_b), "the trainer rank, the replicas and the spare on host b"
    assert len(target.pids) == len(set(target.pids))


def test_a_drill_on_something_the_run_lacks_is_refused_with_its_reason():
    fleet, targets = _targets()
    refusals = {
        "trainer has ranks 0..1, not 5": drill(kind="kill", role="trainer", replica=5),
        "this run has no reference (reference.enabled is false)": drill(kind="kill", role="reference", replica=0),
        "generator replica 4 is not serving; serving replicas: [0, 1]": drill(kind="raise", role="generator", replica=4),
    }
    for reason, request in refusals.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            targets.target(request)
    fleet.hosts.lost.add("c")
    with pytest.raises(ValueError, match="generator replica 1's host cannot be signalled: host c is lost"):
        targets.target(drill(kind="kill", role="generator", replica=1))
    assert targets.target(drill(kind="raise", role="generator", replica=1)).pids, "an in-actor drill needs no agent"


def test_planned_drills_fire_when_due_and_a_waiting_controller_fires_only_timed_ones():
    at_step = drill(kind="raise", role="reward", replica=0, schedule={"at_step": 2})
    trainer = drill(kind="raise", role="trainer", replica=0, schedule={"every_s": 0.01})
    timed = drill(kind="latency", role="generator", replica=0, latency_ms=50, duration_s=1, schedule={"every_s": 0.01})
    plan = DrillPlan([at_step, trainer, timed], start=time.monotonic() - 1)
    fleet, targets = _targets(plan=plan)
    targets.inject_due(timed_only=True)
    assert [(f.role, f.replica) for f in fleet.injector.faults] == [("generator", 0)], "not the step or trainer drills"
    assert fleet.groups["generator"].replicas[0].actor.inject_fault.calls[0][0] == "latency"
    fleet.state.step = 1  # step 2 is about to train
    targets.inject_due()
    roles = [f.role for f in fleet.injector.faults]
    assert (roles.count("reward"), roles.count("trainer")) == (1, 1), "the step drill and the trainer's, between steps"
    assert fleet.events("fault_injected")[-1]["step"] == 2


def test_a_scheduled_operator_drill_is_checked_now_and_a_failing_one_is_reported_not_raised():
    fleet, targets = _targets()
    assert targets.schedule(drill(kind="raise", role="reward", replica=0, schedule={"at_step": 3})) == \
        {"scheduled": {"at_step": 3}}
    with pytest.raises(ValueError, match="reward replica 2 is not serving"):
        targets.schedule(drill(kind="raise", role="reward", replica=2, schedule={"at_step": 3}))
    fleet.groups["reward"].service.set_available(0, False)  # the replica went away before its drill was due
    fleet.state.step = 2
    targets.inject_due()
    assert fleet.injector.faults == []
    assert any("fault drill not run: reward replica 0 is not serving" in e["text"] for e in fleet.events("message"))


def test_a_nan_gradients_drill_arms_its_trainer_rank_alone_and_explains_no_trainer_failure():
    fleet, targets = _targets(plan=DrillPlan([drill(kind="nan_gradients", role="trainer", replica=1,
                                                    schedule={"at_step": 3})]))
    mesh, ranks = fleet.trainer.actors, {}
    mesh.slice = lambda **where: ranks.setdefault(tuple(sorted(where.items())), FakeActor(0))
    fleet.state.step = 2  # step 3 is about to train
    targets.inject_due()
    [fault] = fleet.injector.faults
    assert (fault.request.kind, fault.role, fault.replica, fault.pids, fault.step) == ("nan_gradients", "trainer", 1, [102], 3)
    assert ranks[(("hosts", 1), ("procs", 0))].inject_fault.calls == [("nan_gradients",)]
    assert mesh.inject_fault.calls == [], "not every rank: the all-reduced norm carries one rank's NaN to the others"
    [injected] = fleet.events("fault_injected")
    assert (injected["fault_kind"], injected["step"], injected["duration_s"]) == ("nan_gradients", 3, None)
    assert fleet.log.notice("trainer", "process exited").fault is None, "a skipped update fails no call"


class Loading:
    """A new replica's pid call that answers once `loaded` is set: its model is still loading until then."""

    def __init__(self, pid: int):
        self.pid, self.loaded = pid, False

    def get(self, timeout: float | None = None) -> int:
        if not self.loaded:
            raise TimeoutError
        return self.pid


def loads_slowly(group: ReplicaGroup) -> list[Loading]:
    """From now on the group's new replicas load their model until the test says they have: their pid calls."""
    spawn_actor, loading = group.spawn_actor, []

    def slow(procs: FakeProcs, name: str) -> FakeActor:
        actor = spawn_actor(procs, name)
        loading.append(Loading(actor.pid.answer))
        actor.pid.call_one = lambda future=loading[-1]: future
        return actor

    group.spawn_actor = slow
    return loading


def _fail_generator_0(fleet: Fleet) -> Loading:
    """Generator replica 0 fails; its replacement, spawned on host c, loads its model (replica 1 serves meanwhile)."""
    group = fleet.groups["generator"]
    loading = loads_slowly(group)
    fleet.failover.detect(group, group.replicas[0], "process exited", hung=False)
    fleet.failover.repair({}, host=lambda replica: "c")
    assert len(group.replacing) == 1 and len(loading) == 1 and group.replicas[0].failed
    return loading[0]


def test_a_planned_drill_on_a_replica_being_replaced_waits_for_it_and_runs_once_it_serves():
    planned = drill(kind="raise", role="generator", replica=0, schedule={"at_step": 2})
    missing = drill(kind="raise", role="generator", replica=4, schedule={"at_step": 2})
    fleet, targets = _targets(plan=DrillPlan([planned, missing]))
    load = _fail_generator_0(fleet)
    group = fleet.groups["generator"]
    fleet.state.step = 1  # step 2 is about to train
    targets.inject_due()
    fleet.state.step = 2
    targets.inject_due()
    targets.inject_due(timed_only=True)  # a step drill is not tried while the controller waits
    texts = [e["text"] for e in fleet.events("message")]
    assert texts.count("fault drill deferred: generator replica 0 is being replaced; it runs once the replica serves") \
        == 1, "told once, at step 2"
    assert [t for t in texts if t.startswith("fault drill not run")] == \
        ["fault drill not run: generator replica 4 is not serving; serving replicas: [1]"], "a missing replica: at once"
    assert fleet.injector.faults == []
    load.loaded = True
    fleet.failover.repair({}, host=lambda replica: "c")
    assert group.live()[0].index == 0 and not group.replicas[0].failed, "the replacement serves"
    fleet.state.step = 3
    targets.inject_due()
    targets.inject_due()
    assert [(f.role, f.replica, f.step) for f in fleet.injector.faults] == [("generator", 0, 4)], "once, at step 4"
    assert fleet.events("fault_injected")[-1]["step"] == 4
    assert group.replicas[0].actor.inject_fault.calls == [("raise",)], "armed in the replacement"
    assert targets.told_deferred == []


def test_an_immediate_drill_on_a_replica_being_replaced_is_refused_and_a_scheduled_one_is_taken():
    fleet, targets = _targets()
    _fail_generator_0(fleet)
    for kind in ("raise", "kill"):
        with pytest.raises(ValueError, match=re.escape(
                "generator replica 0 is being replaced (it failed and its replacement does not serve yet); the drill "
                "can be sent again once it serves; serving replicas: [1]")):
            targets.schedule(drill(kind=kind, role="generator", replica=0))
    assert targets.schedule(drill(kind="kill", role="generator", replica=0, schedule={"at_step": 3})) == \
        {"scheduled": {"at_step": 3}}, "it exists: planned, and deferred if it is still being replaced then"
    with pytest.raises(ValueError, match=re.escape("generator replica 2 is not serving; serving replicas: [1]")):
        targets.schedule(drill(kind="kill", role="generator", replica=2, schedule={"at_step": 3}))
    assert fleet.injector.faults == []


def test_a_slow_host_drill_hits_a_replacement_once_its_pid_is_known():
    fleet, targets = _targets()
    group = fleet.groups["generator"]
    load = _fail_generator_0(fleet)
    new = group.replacing[0]
    assert new.host == "c" and new.pids == [], "loading: its pid call answers once its model has loaded"
    on_c = []

    def prepare(replica) -> int:  # the replacement takes the current weights: a slow_host drill may come meanwhile
        on_c.append(targets.target(drill(kind="slow_host", role="generator", replica=1, duration_s=5,
                                          duty_cycle=0.5)).pids)
        return 0

    load.loaded = True
    fleet.failover.repair({"generator": prepare}, host=lambda replica: "c")
    assert new.pids and group.replicas[0] is new
    assert sorted(on_c[0]) == sorted([*group.replicas[1].pids, *new.pids]), "replica 1 and the replacement, on c"


def test_a_replicas_measure_is_its_served_requests_and_recent_seconds():
    fleet, _ = _targets()
    service = fleet.groups["generator"].service
    index, _ = service.submit(lambda replica: None)
    service.done(index, 0.25)
    assert measure_replica(fleet.groups, "generator", index) == {"requests_served": 1, "seconds_per_request": 0.25}
    assert measure_replica(fleet.groups, "reference", 0) == {} and measure_replica(fleet.groups, "generator", 9) == {}
