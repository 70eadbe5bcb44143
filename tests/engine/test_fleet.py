"""Failure bookkeeping without processes: one detection and one recovery per failure, and the limits."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.actors.fleet import Failover, ProcFailure, Replica, ReplicaGroup
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


class Loading:
    """A spare's pid future: not ready until `loaded`, or failing when `error` is set."""

    def __init__(self) -> None:
        self.loaded = False
        self.error: Exception | None = None

    def get(self, timeout: float | None = None) -> int:
        if self.error is not None:
            raise self.error
        if not self.loaded:
            raise TimeoutError
        return 4242


class SpareGroup(FakeGroup):
    """A fake group whose new replicas (spares included) load until the test says they are loaded."""

    def __init__(self, role: str, count: int, *, spares: int):
        super().__init__(role, count)
        self.spares = spares
        self.loads: list[Loading] = []

    def _start(self, index: int, host: str, name: str) -> Replica:
        loading = Loading()
        self.loads.append(loading)
        actor = type("Actor", (), {"pid": type("Endpoint", (), {"call_one": staticmethod(lambda: loading)})()})()
        return Replica(self.role, index, host, self.incarnations, name, FakeMesh(), actor)


def test_a_failed_replica_is_replaced_by_a_warm_spare_once_one_has_loaded() -> None:
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = SpareGroup("generator", 2, spares=1)
    assert group.warm("a") == 1 and group.warm("a") == 0, "one spare is enough"
    assert group.poll_spares() == [] and group.take_spare(0, "a") is None, "a spare still loading cannot serve"

    # no spare is ready: the replacement is spawned
    failover.detect(group, group.replicas[0], "killed", hung=False)
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: replica.host)
    assert sink.records[-1]["name"] == "replica_replaced" and sink.records[-1]["from_spare"] is False

    group.loads[0].loaded = True
    [spare] = group.poll_spares()
    assert spare.pids == [4242] and spare.name.startswith("generator_spare_")
    dead = group.replicas[1]
    failover.detect(group, dead, "killed", hung=False)
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: replica.host)
    assert group.replicas[1] is spare and spare.index == 1 and spare.version == 3 and dead.procs.stopped
    assert sink.records[-1]["from_spare"] is True and sink.records[-1]["pids"] == [4242]
    assert group.ready_spares == [] and group.warm("a") == 1, "a used spare is started again"
    assert group.find(group.warming[0][0].name + "-0") is group.warming[0][0], "supervision reports name spares too"


def test_a_spare_that_fails_to_start_is_dropped_and_started_again() -> None:
    group = SpareGroup("reward", 1, spares=1)
    group.warm("a")
    first = group.warming[0][0]
    group.loads[-1].error = RuntimeError("ImportError in the spare's proc")
    assert group.poll_spares() == [] and group.spare_replicas() == [] and first.procs.stopped
    assert group.warm("a") == 1 and group.spare_replicas()[0] is not first


def test_a_spare_is_not_taken_back_when_preparing_it_fails() -> None:
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = SpareGroup("generator", 1, spares=1)
    group.warm("a")
    group.loads[-1].loaded = True
    group.poll_spares()
    failover.detect(group, group.replicas[0], "killed", hung=False)

    def trainer_gone(replica: Replica) -> int:
        raise RuntimeError("the trainer holding the weights died")

    with pytest.raises(RuntimeError):
        failover.repair({"generator": trainer_gone}, host=lambda replica: replica.host)
    assert len(group.ready_spares) == 1 and group.ready_spares[0].index == -1 and failover.pending_repairs()


def test_spares_on_a_drained_host_are_stopped() -> None:
    group = SpareGroup("generator", 1, spares=2)
    group.spares = 1
    group.warm("a")
    group.spares = 2
    group.warm("b")
    on_a, on_b = (s for s in group.spare_replicas())
    assert group.drop_spares_on("a") == 1 and on_a.procs.stopped and group.spare_replicas() == [on_b]
    assert group.warm("b") == 1
