"""Failover without processes (actors/failover.py): one detection and one recovery per failure, a replacement that
loads while the run goes on or takes a warm spare, one that does not start or take the weights, and the limits."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.engine.fake_fleet import NOT_STARTED, FakeGroup, SpareGroup, StartingGroup
from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.failover import Failover
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.config import FailoverConfig
from workers.engine.drills import FaultInjector, FaultTarget
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.operations import parse_operation


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
