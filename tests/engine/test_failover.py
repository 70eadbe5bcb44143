"""Failure bookkeeping without processes: one detection and one recovery per failure, and the limits."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from workers.engine.actors.calls import CallFailed, ProcFailure, exited
from workers.engine.actors.failover import Failover
from workers.engine.actors.hosts import Hosts
from workers.engine.actors.mesh_stops import MeshStops
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.actors.service import Service
from workers.engine.config import FailoverConfig
from workers.engine.drills import FaultInjector, FaultTarget
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.operations import parse_operation


class RefusingMesh:
    def stop(self) -> Any:
        raise RuntimeError("the mesh is damaged")


class StopFails(RefusingMesh):
    def stop(self) -> Any:
        return self

    def get(self, timeout: float | None = None) -> None:
        raise TimeoutError("the mesh did not stop in time")


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

    def __init__(self, role: str, count: int, *, setup_timeout_s: float = FailoverConfig().setup_timeout_s):
        super().__init__(role, spawn_actor=lambda procs, name: None, threads=1, routing="round_robin",
                         setup_timeout_s=setup_timeout_s)
        self.service = Service([self._fake(i, "a") for i in range(count)], routing="round_robin")

    def _fake(self, index: int, host: str) -> Replica:
        self.incarnations += 1
        return Replica(self.role, index, host, self.incarnations, f"{self.role}_{index}_{self.incarnations}", FakeMesh(), None,
                       pids=[])

    def spawn(self, index: int, host: str) -> Replica:
        return self._fake(index, host)

    def begin_replacement(self, index: int, host: str) -> tuple[Replica, Any]:
        """A replacement whose model has loaded by the time it is looked at."""
        replica = self._fake(index, host)
        self.replacing.append(replica)
        return replica, Loaded()


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


class Loaded:
    """A pid future that has answered."""

    def get(self, timeout: float | None = None) -> int:
        return 4241


class Loading:
    """A spare's pid future: not ready until `loaded`, or failing when `error` is set."""

    def __init__(self) -> None:
        self.loaded = False
        self.error: Exception | None = None

    def get(self, timeout: float | None = None) -> int:
        if self.error is not None:
            raise self.error
        if not self.loaded:
            time.sleep(min(timeout or 0, 0.01))
            raise TimeoutError
        return 4242


class SpareGroup(FakeGroup):
    """A fake group whose new replicas (spares included) load until the test says they are loaded."""

    def __init__(self, role: str, count: int, *, spares: int = 0, setup_timeout_s: float = FailoverConfig().setup_timeout_s):
        super().__init__(role, count, setup_timeout_s=setup_timeout_s)
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
    assert group.poll_spares() == ([], []) and group.take_spare(0, "a") is None, "a spare still loading cannot serve"

    # no spare is ready: the replacement is spawned
    failover.detect(group, group.replicas[0], "killed", hung=False)
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: replica.host)
    assert sink.records[-1]["name"] == "replica_replaced" and sink.records[-1]["from_spare"] is False

    group.loads[0].loaded = True
    [spare], [] = group.poll_spares()
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
    assert group.poll_spares() == ([], ["did not start: RuntimeError: ImportError in the spare's proc"])
    assert group.spare_replicas() == [] and first.procs.stopped
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


class LoadingGroup(SpareGroup):
    """A fake group whose replacements start as real ones do (`ReplicaGroup.begin_replacement`), each loading until
    the test says (`loads`)."""

    begin_replacement = ReplicaGroup.begin_replacement


def test_a_loaded_replacement_that_cannot_take_the_weights_for_the_trainers_sake_is_kept_for_the_next_repair() -> None:
    """A replacement that is no spare (spawned, its model loaded in the background) fails to take the weights for a
    reason not its own (the trainer holding them died): the error goes up to the step loop (the trainer's recovery),
    it is no replacement used up nor a failure of the replica, and it is kept loaded (a load costs minutes on GPUs):
    the next repair gives it the weights, with no new spawn. Kept, it is still stopped with its group."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2)
    dead = group.replicas[1]
    failover.detect(group, dead, "killed", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: "b")
    [loaded] = group.replacing
    group.loads[0].loaded = True

    def trainer_gone(replica: Replica) -> int:
        raise RuntimeError("the trainer holding the weights died")

    with pytest.raises(RuntimeError, match="the trainer holding the weights died"):
        failover.repair({"generator": trainer_gone}, host=lambda replica: "b")
    assert not loaded.procs.stopped and group.replacing == [loaded] and group.replicas[1] is dead
    assert failover.pending_repairs() and failover.replacements == {}
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "c")
    assert group.replicas[1] is loaded and loaded.version == 3 and loaded.host == "b" and len(group.loads) == 1
    assert group.service.routable() == [0, 1] and group.replacing == []
    assert failover.replacements == {"generator": 1} and not failover.pending_repairs()
    assert [e["reason"] for e in sink.events("failure_detected")] == ["killed"], "the trainer's failure, not the replica's"
    assert [e["replica"] for e in sink.events("replica_replaced")] == [1]


@pytest.mark.parametrize("fate", ["drained", "host lost", "group stopped"])
def test_a_kept_loaded_replacement_that_is_stopped_or_loses_its_host_is_started_again_uncounted(fate: str) -> None:
    """The replacement kept after the trainer's failure (above) is stopped by a drain of its host or with its group,
    or lost with its host: the next repair starts another, elsewhere, uncounted."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2)
    failover.detect(group, group.replicas[1], "killed", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: "b")
    [loaded] = group.replacing
    group.loads[0].loaded = True

    def trainer_gone(replica: Replica) -> int:
        raise RuntimeError("the trainer holding the weights died")

    with pytest.raises(RuntimeError):
        failover.repair({"generator": trainer_gone}, host=lambda replica: "b")
    if fate == "drained":
        group.drop_spares_on("b")
    elif fate == "host lost":
        group.hosts.lost.add("b")
    else:
        group.stop_all()
    assert group.replacing == ([loaded] if fate == "host lost" else []), "a lost host's is dropped at the next repair"
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "c")
    [again] = group.replacing
    assert again is not loaded and again.host == "c" and len(group.loads) == 2
    group.loads[1].loaded = True
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "c")
    assert group.replicas[1] is again and failover.replacements == {"generator": 1} and not failover.pending_repairs()


def _fails_once_as_it_takes_the_weights(hung: bool) -> Callable[[Replica], int]:
    """A `prepare` whose first call fails on the new replica's own call (its proc died, or it hangs), as
    `Supervisor.prepare_generator`'s wait for its take_weights does; later ones give policy version 3."""
    taken: list[Replica] = []

    def prepare(replica: Replica) -> int:
        taken.append(replica)
        if len(taken) == 1:
            raise CallFailed("no answer within 300 s" if hung else "ActorError: the proc died", hung=hung)
        return 3

    return prepare


@pytest.mark.parametrize("hung", [False, True])
@pytest.mark.parametrize("from_spare", [False, True])
def test_a_replacement_that_fails_as_it_takes_the_weights_is_one_more_failure_and_another_is_started(
        from_spare: bool, hung: bool) -> None:
    """The new replica's own call fails while it takes the weights (its proc died; or it hangs, then its procs are
    killed first): like a replacement that did not start, it is stopped and is one more failure of the replica
    (within failover.max_replacements), and another replacement is started. Before, the CallFailed escaped the repair
    and ended the run, and a spare was put back among the ready ones although its proc was dead."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2, spares=1 if from_spare else 0)
    killed: list[Replica] = []
    group.kill = killed.append  # from the replica's host: `test_a_hung_replica_is_killed_from_its_own_host`
    dead = group.replicas[1]
    prepare = {"generator": _fails_once_as_it_takes_the_weights(hung)}
    if from_spare:
        group.warm("a")
        group.loads[-1].loaded = True
        [failed], [] = group.poll_spares()
        failover.detect(group, dead, "killed", hung=False, request_failed=False)
    else:
        failover.detect(group, dead, "killed", hung=False, request_failed=False)
        failover.repair(prepare, host=lambda replica: "b")
        [failed] = group.replacing
        group.loads[-1].loaded = True
    failover.repair(prepare, host=lambda replica: "b")
    assert failed.procs.stopped and group.ready_spares == [] and group.replicas[1] is dead
    assert killed == ([failed] if hung else []), "a hung one may wake up later: killed first"
    [again] = group.replacing
    assert again is not failed and failover.replacements == {"generator": 1} and failover.pending_repairs()
    reason = "no answer within 300 s" if hung else "ActorError: the proc died"
    assert [(e["host"], e["reason"], e["hung"]) for e in sink.events("failure_detected")] == [
        ("a", "killed", False), (failed.host, f"the replacement did not take the current weights: {reason}", hung)]
    group.loads[-1].loaded = True
    failover.repair(prepare, host=lambda replica: "b")
    assert group.replicas[1] is again and again.version == 3 and group.service.routable() == [0, 1]
    assert failover.replacements == {"generator": 2} and not failover.pending_repairs()
    assert [e["from_spare"] for e in sink.events("replica_replaced")] == [False]


def test_a_replacement_loads_while_the_healthy_replicas_serve_and_serves_from_the_repair_after_it_has_loaded() -> None:
    """The run goes on while a replacement's model loads (minutes for a large model): each repair looks at it without
    waiting, and it serves from the first repair after it has loaded. Before, the repair, and with it the step loop,
    waited for the load."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2)
    dead = group.replicas[1]
    failover.detect(group, dead, "process 12 exited", hung=False, request_failed=False)
    started = time.monotonic()
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "b")
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "b")
    assert time.monotonic() - started < 0.5, "the repairs did not wait for the model"
    [new] = group.replacing
    assert dead.procs.stopped and group.replicas[1] is dead and group.service.routable() == [0]
    assert failover.pending_repairs() and "replica_replaced" not in _names(sink) and len(group.loads) == 1
    assert group.find(new.name + "-0") is new, "supervision reports name a loading replacement too"
    assert group.room("b") == math.inf and new.host == "b"

    time.sleep(0.05)
    group.loads[0].loaded = True
    failover.repair({"generator": lambda replica: 3}, host=lambda replica: "b")
    assert group.replicas[1] is new and new.version == 3 and new.pids == [4242] and group.service.routable() == [0, 1]
    assert group.replacing == [] and not failover.pending_repairs() and failover.replacements == {"generator": 1}
    replaced = sink.events("replica_replaced")[-1]
    assert replaced["from_spare"] is False and replaced["seconds"] >= 0.05 and replaced["host"] == "b"
    assert _names(sink) == ["failure_detected", "replica_replaced", "recovered"]


def test_a_repair_waits_for_a_loading_replacement_once_no_replica_of_its_role_serves() -> None:
    """Every replica of the role lost at once (their host died): each replacement starts loading, side by side, and
    the repair waits until one serves; the others join at a later repair."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2)
    failover.detect(group, group.replicas[1], "killed", hung=False, request_failed=False)
    failover.detect(group, group.replicas[0], "killed", hung=False, request_failed=False)
    loading_when_loaded: list[int] = []

    def load_the_first() -> None:
        loading_when_loaded.append(len(group.loads))
        group.loads[0].loaded = True

    loaded = threading.Timer(0.3, load_the_first)
    started = time.monotonic()
    loaded.start()
    failover.repair({}, host=lambda replica: "b")
    assert time.monotonic() - started >= 0.25, "nothing serves the role: the repair waits"
    assert loading_when_loaded == [2], "both replacements loaded side by side"
    assert group.service.routable() == [1] and failover.pending_repairs()
    group.loads[1].loaded = True
    failover.repair({}, host=lambda replica: "b")
    assert group.service.routable() == [0, 1] and not failover.pending_repairs()


def test_a_loading_replacement_that_fails_is_one_more_failure_and_another_loads_while_the_run_goes_on() -> None:
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("reward", 2)
    failover.detect(group, group.replicas[0], "process 12 exited", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: "b")
    first = group.replacing[0]
    group.loads[0].error = RuntimeError("CUDA error: out of memory")
    failover.repair({}, host=lambda replica: "c")
    [second] = group.replacing
    assert first.procs.stopped and second.host == "c" and failover.replacements == {"reward": 1}
    assert [(e["host"], e["reason"]) for e in sink.events("failure_detected")] == [
        ("a", "process 12 exited"), ("b", "the replacement did not start: RuntimeError: CUDA error: out of memory")]
    group.loads[1].loaded = True
    failover.repair({}, host=lambda replica: "c")
    assert group.replicas[0] is second and failover.replacements == {"reward": 2} and not failover.pending_repairs()


def test_a_loading_replacement_whose_host_is_lost_or_drained_starts_again_elsewhere_uncounted() -> None:
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = LoadingGroup("generator", 2)
    picked = iter(["b", "c", "d"])
    failover.detect(group, group.replicas[1], "killed", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: next(picked))
    on_b = group.replacing[0]
    group.hosts.lost.add("b")
    failover.repair({}, host=lambda replica: next(picked))
    [on_c] = group.replacing
    assert on_c.host == "c" and on_b not in group.replacing
    assert group.drop_spares_on("c") == 0 and on_c.procs.stopped and group.replacing == [], "a drain stops it"
    failover.repair({}, host=lambda replica: next(picked))
    [on_d] = group.replacing
    group.loads[-1].loaded = True
    failover.repair({}, host=lambda replica: "d")
    assert group.replicas[1] is on_d and on_d.host == "d" and failover.replacements == {"generator": 1}
    assert len(sink.events("failure_detected")) == 1, "neither the lost host nor the drain is the replica's failure"


def test_a_loading_replacement_is_stopped_with_its_group() -> None:
    failover, _ = _failover(MemorySink())
    group = LoadingGroup("generator", 2)
    failover.detect(group, group.replicas[1], "killed", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: "b")
    [loading] = group.replacing
    group.stop_all()
    assert loading.procs.stopped and group.replacing == []


class StartingGroup(SpareGroup):
    """A fake group whose replacements start as real ones do (`ReplicaGroup.spawn`), each loading until the test
    says (`loads`); `fates` makes the next starts fail ("dies") or never end ("hangs")."""

    spawn = ReplicaGroup.spawn
    begin_replacement = ReplicaGroup.begin_replacement

    def __init__(self, role: str, count: int, *, setup_timeout_s: float, fates: list[str]):
        super().__init__(role, count, setup_timeout_s=setup_timeout_s)
        self.fates = fates
        self.spawned: list[Replica] = []

    def _start(self, index: int, host: str, name: str) -> Replica:
        replica = super()._start(index, host, name)
        fate = self.fates.pop(0) if self.fates else "loads"
        self.loads[-1].loaded = fate == "loads"
        self.loads[-1].error = RuntimeError("CUDA error: out of memory") if fate == "dies" else None
        if fate == "unsendable":  # the pid call itself raises: Monarch could not send it to the new actor
            def unsendable() -> None:
                raise RuntimeError("the actor's mailbox is closed")
            replica.actor = type("Actor", (), {"pid": type("Endpoint", (), {"call_one": staticmethod(unsendable)})()})()
        self.spawned.append(replica)
        return replica


NOT_STARTED = {"hangs": ("did not start within 0.3 s (failover.setup_timeout_s)", True),
               "dies": ("did not start: RuntimeError: CUDA error: out of memory", False)}


@pytest.mark.parametrize("fate", ["hangs", "dies"])
def test_a_replacement_that_does_not_start_is_one_more_failure_of_the_replica_and_another_is_started(fate: str) -> None:
    """A replacement whose model load never ends (a stuck shared filesystem) is given up at failover.setup_timeout_s,
    one that fails as it starts at once: either is one more failure of the replica (within max_replacements), its own
    procs stopped, and another replacement is started. Before, a hung one held the run (for 600 s, then the run
    failed with a TimeoutError), and one that failed ended the run with its error."""
    sink = MemorySink()
    failover, _ = _failover(sink)
    group = StartingGroup("reward", 1, setup_timeout_s=0.3, fates=[fate])
    old = group.replicas[0]
    failover.detect(group, old, "process 12 exited", hung=False, request_failed=False)
    started = time.monotonic()
    failover.repair({}, host=lambda replica: "b")
    took = time.monotonic() - started
    stuck, new = group.spawned
    assert group.replicas[0] is new and new.pids == [4242] and group.service.routable() == [0]
    assert old.procs.stopped and stuck.procs.stopped, "the stuck replacement's procs are stopped too"
    assert (0.3 <= took < 2) if fate == "hangs" else took < 0.3
    reason, hung = NOT_STARTED[fate]
    assert [(e["replica"], e["host"], e["reason"], e["hung"]) for e in sink.events("failure_detected")] == [
        (0, "a", "process 12 exited", False), (0, "b", f"the replacement {reason}", hung)]
    assert _names(sink) == ["failure_detected", "failure_detected", "replica_replaced", "recovered", "recovered"]
    assert failover.replacements == {"reward": 2} and not failover.pending_repairs()


def test_replacements_that_never_start_end_the_run_at_max_replacements() -> None:
    failover, _ = _failover(MemorySink(), max_replacements=2)
    group = StartingGroup("reference", 1, setup_timeout_s=0.3, fates=["dies", "dies", "loads"])
    failover.detect(group, group.replicas[0], "killed", hung=False)
    with pytest.raises(ProcFailure, match=r"reference replica 0 failed and the run has used its 2 replacements for "
                                          r"reference \(failover.max_replacements\)"):
        failover.repair({}, host=lambda replica: "a")
    assert all(replica.procs.stopped for replica in group.spawned) and len(group.spawned) == 2


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


def test_a_straggler_deadline_follows_the_roles_typical_request_time_within_its_bounds() -> None:
    from workers.engine.actors.calls import request_deadline

    off = FailoverConfig(call_timeout_s=30.0)
    assert request_deadline(typical_s=0.5, config=off) == 30.0, "off by default: only the call timeout"
    on = FailoverConfig(call_timeout_s=30.0, straggler_factor=8.0, straggler_min_s=2.0)
    assert request_deadline(typical_s=None, config=on) == 30.0, "nothing measured yet"
    assert request_deadline(typical_s=0.5, config=on) == 4.0
    assert request_deadline(typical_s=0.1, config=on) == 2.0, "never under straggler_min_s"
    assert request_deadline(typical_s=10.0, config=on) == 30.0, "never over the call timeout"


def test_typical_seconds_is_the_median_over_routable_replicas() -> None:
    service = Service(["a", "b", "c", "d"], routing="least_loaded")
    assert service.typical_seconds() is None
    for index, seconds in enumerate([0.2, 0.4, 9.0]):  # replica 3 has not answered yet
        service.in_flight[index] = 1
        service.done(index, seconds)
    assert service.typical_seconds() == 0.4
    service.set_available(1, False)
    assert service.typical_seconds() == 9.0, "the upper median of the routable replicas' 0.2 and 9.0"


class Answer:
    """A future that answers after `after_s` (never when None), or fails with `error`."""

    def __init__(self, after_s: float | None, value: Any = None, error: Exception | None = None):
        self.ready_at = None if after_s is None else time.monotonic() + after_s
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        if self.ready_at is None or time.monotonic() < self.ready_at:
            time.sleep(timeout or 0)
            raise TimeoutError
        return self.value


def test_wait_all_declares_a_straggler_hung_long_before_the_call_timeout() -> None:
    from workers.engine.actors.calls import CallFailed, wait_all

    config = FailoverConfig(call_timeout_s=60.0, straggler_factor=4.0, straggler_min_s=0.3, poll_seconds=0.05)
    ticks: list[float] = []
    started = time.monotonic()
    outcomes = wait_all([Answer(0.02, "a"), Answer(None), Answer(0.0, error=RuntimeError("actor raised"))],
                        config=config, tick=lambda: ticks.append(time.monotonic()))
    assert time.monotonic() - started < 5.0, "the stopped one was declared hung at max(0.3, 4 x 0.02) s"
    assert outcomes[0] == "a"
    assert isinstance(outcomes[1], CallFailed) and outcomes[1].hung and "no answer within 0.3 s" in str(outcomes[1])
    assert isinstance(outcomes[2], CallFailed) and not outcomes[2].hung and "actor raised" in str(outcomes[2])
    assert ticks, "failures and drills are looked at while waiting"


def test_wait_all_without_a_straggler_factor_waits_for_the_call_timeout() -> None:
    from workers.engine.actors.calls import CallFailed, wait_all

    config = FailoverConfig(call_timeout_s=0.5, poll_seconds=0.05)
    started = time.monotonic()
    outcomes = wait_all([Answer(0.01, 1), Answer(None)], config=config, tick=lambda: None)
    assert outcomes[0] == 1 and isinstance(outcomes[1], CallFailed) and outcomes[1].hung
    assert time.monotonic() - started >= 0.5


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
    begin = group.begin_replacement

    def begin_or_fail(index: int, host: str) -> tuple[Replica, Any]:
        if host == "a":
            raise HostsUnreachable("host a stopped accepting connections while a proc was spawned there")
        return begin(index, host)

    group.begin_replacement = begin_or_fail
    picked = iter(["a", "b"])  # the probe finds host a lost only on the second look
    failover.detect(group, group.replicas[0], "process 12 exited", hung=False, request_failed=False)
    failover.repair({}, host=lambda replica: next(picked))
    assert group.replicas[0].host == "b" and group.service.routable() == [0, 1] and not failover.pending_repairs()
    assert [r["host"] for r in sink.records if r["name"] == "replica_replaced"] == ["b"]


class RecordedSignals:
    def __init__(self) -> None:
        self.killed: list[list[int]] = []

    def kill(self, pids: list[int]) -> None:
        self.killed.append(list(pids))


def test_a_hung_replica_is_killed_from_its_own_host() -> None:
    failover, _ = _failover(MemorySink())
    group = FakeGroup("generator", 3)
    for replica, pid, host in zip(group.replicas, (101, 202, 303), ("a", "b", "c")):
        replica.pids, replica.host = [pid], host
    agents = {"a": RecordedSignals(), "b": RecordedSignals()}
    group.hosts.signals = agents.__getitem__  # with workers: an agent proc on each host sends them
    group.hosts.lost.add("c")  # its procs went with it: nothing to kill, nothing to ask
    for replica in group.replicas:
        failover.detect(group, replica, "no answer within 10 s", hung=True)
    assert (agents["a"].killed, agents["b"].killed) == ([[101]], [[202]])
    assert failover.pending_repairs()


def test_mesh_stops_signal_the_given_pids_then_wait_for_every_stop_started() -> None:
    import subprocess

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    ended = subprocess.Popen(["true"])
    ended.wait()
    meshes = [FakeMesh(), FakeMesh(), FakeMesh()]
    stops = MeshStops()
    stops.add(meshes[0], pids=[procs[0].pid])
    stops.add(meshes[1], pids=[procs[1].pid, ended.pid])  # a pid that is gone already is passed over
    stops.add(meshes[2])
    stops.add(RefusingMesh())  # a damaged mesh that refuses to stop is passed over
    stops.add(StopFails())  # and so is one whose stop fails while waited for
    assert all(mesh.stopped for mesh in meshes)  # started at add, before any wait
    assert [p.wait(timeout=5) for p in procs] == [-15, -15]  # SIGTERM
    assert all(exited(p.pid) for p in procs)
    stops.wait()
    assert stops.stopping == []
