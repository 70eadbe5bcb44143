"""A role's replicas and spares without processes (actors/replica_group.py): how a new replica, a replacement or a
spare starts or fails to, the run's start, drained and lost hosts."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.engine.fake_fleet import NOT_STARTED, FakeGroup, SpareGroup, StartingGroup
from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.replica_group import ReplicaGroup


def test_a_spare_that_fails_to_start_is_dropped_and_started_again() -> None:
    group = SpareGroup("reward", 1, spares=1)
    group.warm("a")
    first = group.warming[0][0]
    group.loads[-1].error = RuntimeError("ImportError in the spare's proc")
    assert group.poll_spares() == ([], ["did not start: RuntimeError: ImportError in the spare's proc"])
    assert group.spare_replicas() == [] and first.procs.stopped
    assert group.warm("a") == 1 and group.spare_replicas()[0] is not first


@pytest.mark.parametrize("fate", ["loads", "dies"])
def test_a_spawned_replica_is_no_replacement(fate: str) -> None:
    """`spawn` (an operator's add or move) and `begin_replacement` start a replica the same way; only a replacement is
    among `replacing` (stopped with the group, counted by `room`) and its repair's failover.max_replacements."""
    group = StartingGroup("reference", 1, setup_timeout_s=0.3, fates=[fate, "loads"])
    if fate == "dies":
        with pytest.raises(CallFailed, match="did not start: RuntimeError: CUDA error: out of memory"):
            group.spawn(1, "b")
        assert group.spawned[0].procs.stopped
    else:
        added = group.spawn(1, "b")
        assert added.pids == [4242] and added.index == 1 and added.host == "b"
    assert group.replacing == []
    replacement, _ = group.begin_replacement(0, "b")
    assert group.replacing == [replacement]


@pytest.mark.parametrize("replacement", [False, True])
def test_a_new_replica_whose_pid_call_cannot_be_sent_did_not_start_and_its_procs_are_stopped(replacement: bool) -> None:
    """The pid call (the sign that a new replica started) raising as it is sent: the replica did not start, as one
    whose load failed, and its procs are stopped (they ran on, their GPUs counted as taken) and it is no replacement."""
    group = StartingGroup("reference", 1, setup_timeout_s=0.3, fates=["unsendable"])
    with pytest.raises(CallFailed, match="did not start: RuntimeError: the actor's mailbox is closed"):
        group.begin_replacement(0, "b") if replacement else group.spawn(1, "b")
    assert group.spawned[0].procs.stopped and group.replacing == []


def test_a_spare_whose_pid_call_cannot_be_sent_is_told_at_the_next_poll_and_its_procs_are_stopped() -> None:
    group = StartingGroup("reference", 1, setup_timeout_s=0.3, fates=["unsendable"])
    group.spares = 1
    assert group.warm("b") == 0 and group.spawned[0].procs.stopped and group.warming == []
    assert group.poll_spares() == ([], ["did not start: RuntimeError: the actor's mailbox is closed"])
    assert group.warm("b") == 1 and [spare for spare, _ in group.warming] == [group.spawned[1]]


@pytest.mark.parametrize("fate", ["hangs", "dies"])
def test_a_role_whose_replica_does_not_start_ends_the_run_at_its_start_naming_the_role_and_the_option(fate: str):
    """At the run's start (the roles polled side by side) a replica whose model load never ends ends the run at
    failover.setup_timeout_s, one that fails at once; each names the role. Before, the start waited without end."""
    group = StartingGroup("generator", 1, setup_timeout_s=0.3, fates=["loads", fate])
    group.launch(["a", "b"])
    reason, _ = NOT_STARTED[fate]
    started = time.monotonic()
    with pytest.raises(ProcFailure) as failed:
        while not group.await_started(wait_s=0.02):
            assert time.monotonic() - started < 3, "waited past every bound"
    assert str(failed.value) == f"generator replica 1 {reason}"
    assert group.replicas[0].pids == [4242], "the replica that started"


def test_a_replica_whose_actor_does_not_spawn_as_the_run_starts_ends_the_run_naming_the_role_and_stops_every_proc():
    """Before, the error escaped the launch and the procs spawned (the failed one's and those of the replicas before it)
    were never stopped nor their GPUs released: the group had no service yet, so its stop at the run's end missed
    them."""
    from tests.engine.fake_fleet import FakeActor, FakeHosts, fails_to_spawn

    hosts = FakeHosts(["a", "b"])
    group = ReplicaGroup("reference", spawn_actor=lambda procs, name: FakeActor(1, name=name), threads=1,
                         routing="round_robin", setup_timeout_s=5, hosts=hosts)
    spawned: list[Any] = []
    spawn_procs = hosts.spawn_procs
    hosts.spawn_procs = lambda **kwargs: spawned.append(spawn_procs(**kwargs)) or spawned[-1]
    fails_to_spawn(group, RuntimeError("the proc mesh failed as the actor was spawned on it"), on="b")
    with pytest.raises(ProcFailure) as failed:
        group.launch(["a", "b"])
    assert str(failed.value) == "reference replica 1 did not start: RuntimeError: the proc mesh failed as the actor " \
                                "was spawned on it"
    assert [procs.stopped for procs in spawned] == [True, True]
    assert sorted(hosts.released) == sorted(owner for _, owner in hosts.spawned) == ["reference_0_1", "reference_1_2"]


def test_a_spare_that_does_not_start_in_time_is_dropped_and_started_again() -> None:
    group = StartingGroup("generator", 1, setup_timeout_s=0.3, fates=["hangs"])
    group.spares = 1
    group.warm("a")
    first = group.warming[0][0]
    started = time.monotonic()
    while group.warming:
        ready, failed = group.poll_spares(wait_s=0.02)
        assert time.monotonic() - started < 3, "waited past every bound"
    assert 0.3 <= time.monotonic() - started and ready == [] and failed == [NOT_STARTED["hangs"][0]]
    assert first.procs.stopped and group.spare_replicas() == []
    assert group.warm("a") == 1 and group.spare_replicas()[0] is not first


def test_spares_on_a_drained_host_are_stopped() -> None:
    group = SpareGroup("generator", 1, spares=2)
    group.spares = 1
    group.warm("a")
    group.spares = 2
    group.warm("b")
    on_a, on_b = (s for s in group.spare_replicas())
    assert group.drop_spares_on("a") == 1 and on_a.procs.stopped and group.spare_replicas() == [on_b]
    assert group.warm("b") == 1


def test_replicas_on_a_lost_host_are_not_stopped_and_the_others_are() -> None:
    from workers.engine.actors.hosts import parse_workers

    group = FakeGroup("generator", 2)
    group.hosts = Hosts(workers=parse_workers("a=tcp://127.0.0.1:1,b=tcp://127.0.0.1:2"))
    group.hosts.lost.add("a")
    on_b = group._fake(1, "b")
    group.service.replace(1, on_b)
    group.stop_all()  # stopping a mesh on a lost host would wait for the host
    assert [r.procs.stopped for r in group.replicas] == [False, True]
