"""Failure bookkeeping without processes: one detection and one recovery per failure, and the limits."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.actors.fleet import Failover, ProcFailure, Replica, ReplicaGroup
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.service import Service
from workers.engine.config import FailoverConfig
from workers.engine.drills import FaultInjector, FaultTarget
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.operations import parse_operation


class FakeMesh:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> Any:
        self.stopped = True
        return self

    def get(self, timeout: float | None = None) -> None:
        return None


class FakeGroup(ReplicaGroup):
    """A replica group whose spawns are plain objects."""

    def __init__(self, role: str, count: int):
        super().__init__(role, spawn_actor=lambda procs, name: None, threads=1, routing="round_robin")
        self.service = Service([self._fake(i, "a") for i in range(count)], routing="round_robin")

    def _fake(self, index: int, host: str) -> Replica:
        self.incarnations += 1
        return Replica(self.role, index, host, self.incarnations, f"{self.role}_{index}_{self.incarnations}", FakeMesh(), None,
                       pids=[])

    def spawn(self, index: int, host: str) -> Replica:
        return self._fake(index, host)


def _failover(sink: MemorySink, **config: Any) -> tuple[Failover, FaultInjector]:
    recorder = Recorder([sink])
    injector = FaultInjector(recorder)
    failover = Failover(recorder=recorder, injector=injector, config=FailoverConfig(retry_backoff_s=0.0, **config),
                        step=lambda: 7, policy_version=lambda: 7)
    return failover, injector


def _names(sink: MemorySink) -> list[str]:
    return [r["name"] for r in sink.records]


def test_a_dead_replica_is_detected_once_replaced_and_recovered_after_its_request_is_served() -> None:
    sink = MemorySink()
    failover, injector = _failover(sink)
    group = FakeGroup("generator", 2)
    dead = group.replicas[1]
    fault = injector.inject(parse_operation("fault_drill", {"kind": "raise", "role": "generator", "replica": 1}),
                            FaultTarget("generator", 1, [], arm=lambda kind, **_: None), step=7)
    incident = failover.detect(group, dead, "SupervisionError: killed", hung=False)
    assert failover.detect(group, dead, "the same failure, seen by a second request", hung=False) is incident
    assert group.service.routable() == [0] and failover.pending_repairs()
    failover.repair({"generator": lambda replica: 7}, host=lambda replica: "b")
    assert dead.procs.stopped and group.replicas[1] is not dead and group.replicas[1].host == "b"
    assert group.service.routable() == [0, 1]
    assert "recovered" not in _names(sink), "recovered only once the failed request has been served again"
    failover.served(incident)
    failover.served(incident)
    assert _names(sink) == ["fault_injected", "failure_detected", "replica_replaced", "recovered"]
    recovered = sink.records[-1]
    assert recovered["fault_id"] == fault.id and recovered["action"] == "replaced" and recovered["policy_version"] == 7
    assert recovered["time_to_detect_s"] >= 0.0 and recovered["time_to_recover_s"] >= 0.0


def test_an_alive_replica_is_retried_and_a_later_failure_is_a_new_incident() -> None:
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = FakeGroup("reward", 1)
    replica = group.replicas[0]
    first = failover.detect(group, replica, "ActorError: InjectedFault", hung=False, alive=True)
    assert group.service.routable() == [0] and not failover.pending_repairs()
    failover.served(first)
    second = failover.detect(group, replica, "no answer within 10 s", hung=True)
    assert second is not first and failover.pending_repairs()
    assert _names(sink) == ["failure_detected", "recovered", "failure_detected"]
    assert sink.records[1]["action"] == "retried"


def test_limits_end_the_run_with_the_reason() -> None:
    failover, _ = _failover(MemorySink(), max_replacements=1, max_retries=2)
    group = FakeGroup("reference", 1)
    failover.detect(group, group.replicas[0], "killed", hung=False)
    failover.repair({}, host=lambda replica: replica.host)
    failover.detect(group, group.replicas[0], "killed again", hung=False)
    with pytest.raises(ProcFailure, match=r"reference replica 0 failed .* its 1 replacements for reference \(failover.max_replacements\)"):
        failover.repair({}, host=lambda replica: replica.host)
    failover.backoff(2, what="a reward request")
    with pytest.raises(ProcFailure, match=r"a reward request failed 3 times \(failover.max_retries is 2\)"):
        failover.backoff(3, what="a reward request")


def test_replicas_on_a_lost_host_are_not_stopped_and_the_others_are() -> None:
    from workers.engine.actors.hosts import parse_workers

    group = FakeGroup("generator", 2)
    group.hosts = Hosts(workers=parse_workers("a=tcp://127.0.0.1:1,b=tcp://127.0.0.1:2"))
    group.hosts.lost.add("a")
    on_b = group._fake(1, "b")
    group.service.replace(1, on_b)
    group.stop_all()  # stopping a mesh on a lost host would wait for the host
    assert [r.procs.stopped for r in group.replicas] == [False, True]


def test_a_replacement_whose_host_dies_while_it_spawns_goes_to_the_next_host_picked() -> None:
    from workers.engine.actors.hosts import HostsUnreachable

    sink = MemorySink()
    failover, _ = _failover(sink)
    group = FakeGroup("generator", 2)
    spawn = group.spawn

    def spawn_or_fail(index: int, host: str) -> Replica:
        if host == "a":
            raise HostsUnreachable("host a stopped accepting connections while a proc was spawned there")
        return spawn(index, host)

    group.spawn = spawn_or_fail
    picked = iter(["a", "b"])  # the probe finds host a lost only on the second look
    failover.detect(group, group.replicas[0], "process 12 exited", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: next(picked))
    assert group.replicas[0].host == "b" and group.service.routable() == [0, 1] and not failover.pending_repairs()
    assert [r["host"] for r in sink.records if r["name"] == "replica_replaced"] == ["b"]


def test_a_hung_replica_on_another_machine_is_not_signalled_here(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.engine.actors.fleet as fleet

    signalled: list[list[int]] = []
    monkeypatch.setattr(fleet, "_signal", lambda pids, sig: signalled.append(list(pids)))
    failover, _ = _failover(MemorySink())
    group = FakeGroup("generator", 2)
    group.replicas[0].pids, group.replicas[1].pids = [101], [202]
    group.replicas[1].pids_visible = False  # pid 202 is a process of a remote host
    failover.detect(group, group.replicas[0], "no answer within 10 s", hung=True)
    failover.detect(group, group.replicas[1], "no answer within 10 s", hung=True)
    assert signalled == [[101]]
