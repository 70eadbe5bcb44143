"""Going back to the last checkpoint after a lost control proc, and the limits on recoveries, over fake hosts; the
run's counters and what a checkpoint saves; the end of a step every recipe shares."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engine.fake_fleet import (Done, FakeActor, FakeEndpoint, FakeHosts, FakeProcs, Fleet, controller_parts, fake_group,
                                     grpo_config, staged_part)
from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.actors.weight_inbox import UNREAD, Unread
from workers.engine.controller.control_procs import ControlLost
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.generation import GenerationPipeline
from workers.engine.controller.generators import ReplicaGenerators, ReplicaRequest
from workers.engine.controller.operator import Operator
from workers.engine.controller.recovery import Recovery, SftRecovery
from workers.engine.controller.requests import Router
from workers.engine.controller.state import PendingGeneration, RunState
from workers.engine.controller.trainer import TrainerLost
from workers.engine.config import load_config
from workers.engine.drills import DrillPlan
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.operations import parse_operation
from workers.engine.step_end import StepEnd
from workers.engine.tasks import Problem
from workers.engine.tasks.stream import ProblemStream
from workers.engine.training import UPDATE_SKIPPED, PhaseTimer

SAVED = {"step": 4, "policy_version": 4, "generations": 5, "staleness": {"0": 3, "1": 1},
         "data": {"position": 40}, "buffer": {"records": []}}


def _recovery(placement: str = "replay_buffer: {hosts: [c, b]}", replicas_host: str = "a", generators: int = 1,
              **sections: str) -> tuple[Fleet, Recovery]:
    config = grpo_config(placement, **sections)
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, [replicas_host] * generators, generate=([], 0.1)),
              "reward": fake_group("reward", hosts, [replicas_host])}
    fleet = controller_parts(config, hosts, groups, trainer_hosts=["a"], control_host="c")
    fleet.trainer.actors.load = type(fleet.trainer.actors.pid)(lambda path: {0: dict(SAVED)})
    fleet.router = Router(failover=fleet.failover, waits=fleet.waits, supervisor=fleet.supervisor)
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                          groups=groups, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    generators = ReplicaGenerators(group=groups["generator"], router=fleet.router, trainer=fleet.trainer,
                                   supervisor=fleet.supervisor, state=fleet.state)
    pipeline = GenerationPipeline(config=config, tokenizer=None, groups=groups, generators=generators,
                                  trainer=fleet.trainer, control=fleet.control, router=fleet.router, drills=drills,
                                  state=fleet.state)
    return fleet, Recovery(config=config, trainer=fleet.trainer, control=fleet.control, supervisor=fleet.supervisor,
                           pipeline=pipeline, failover=fleet.failover, log=fleet.log, recorder=fleet.recorder,
                           state=fleet.state)


def _in_flight(fleet: Fleet, prompts: int) -> None:
    request = ReplicaRequest(fleet.router.send(fleet.groups["generator"], lambda actor: actor.generate.call_one()), 0)
    fleet.state.pending.append(PendingGeneration([], [[1]] * prompts, [request], {"position": 48}, 5, [(0, 1)]))


def test_a_lost_control_host_restarts_dataset_and_buffer_on_the_next_host_at_the_last_checkpoint():
    fleet, recovery = _recovery()
    state = fleet.state
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    _in_flight(fleet, prompts=8)
    fleet.hosts.fail("c")
    fleet.supervisor.scan()
    recovery.recover_control(ControlLost("host c of the dataset and replay buffer was lost"))
    assert fleet.control.host == "b", "the next of placement.replay_buffer.hosts still up"
    assert fleet.control.dataset.load_state_dict.calls == [({"position": 40},)]
    assert fleet.control.buffer.load_state_dict.calls == [({"records": []},)]
    assert (state.step, state.policy_version, state.generations, state.generator_version) == (4, 4, 5, -1)
    assert dict(state.staleness) == {0: 3, 1: 1}
    assert not state.pending and state.totals.samples_dropped == 8, "generations launched from later states are dropped"
    assert (state.totals.steps_lost, state.totals.control_recoveries) == (2, 1)
    replaced, recovered = fleet.events("replica_replaced")[0], fleet.events("recovered")[0]
    assert (replaced["role"], replaced["host"]) == ("replay_buffer", "b")
    assert (recovered["role"], recovered["action"], recovered["steps_lost"], recovered["step"]) == \
        ("replay_buffer", "restored_checkpoint", 2, 4)
    assert [e["role"] for e in fleet.events("failure_detected")] == ["replay_buffer"], "noticed once"


def test_a_lost_control_proc_before_the_first_checkpoint_fails_the_run_saying_why():
    fleet, recovery = _recovery()
    with pytest.raises(ProcFailure, match=r"no checkpoint to restore them from yet \(checkpoint.every_steps\)"):
        recovery.recover_control(ControlLost("the control proc failed"))


def test_the_control_proc_is_replaced_at_most_max_replacements_times():
    fleet, recovery = _recovery(failover="{max_replacements: 1}")
    fleet.state.last_checkpoint = "ckpt/step_000004"
    for _ in range(2):
        fleet.control.detect("the control proc failed")
        if fleet.state.totals.control_recoveries == 1:
            with pytest.raises(ProcFailure, match=r"failed 2 times \(failover.max_replacements 1\)"):
                recovery.recover_control(ControlLost("the control proc failed"))
        else:
            recovery.recover_control(ControlLost("the control proc failed"))
    fleet.hosts.lost.update({"b", "c"})
    fleet.state.totals.control_recoveries = 0
    with pytest.raises(ProcFailure, match=r"no host left: c, b \(placement.replay_buffer.hosts\) are lost"):
        fleet.control.start()


def test_the_trainer_is_restored_at_most_recover_failures_times():
    fleet, recovery = _recovery(trainer="{recover_failures: 0}")
    fleet.state.step = 3
    with pytest.raises(ProcFailure, match=r"trainer failed at step 4 \(0 recoveries allowed, trainer.recover_failures\): "
                                          r"trainer process 7 exited"):
        recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert fleet.events("failure_detected")[0]["role"] == "trainer"


class _WaitsForWeights:
    """A generate call (or the inbox's read) on a replica whose inbox still reads the weights it names from dead ranks:
    no answer until the inbox is told they will not arrive, then the generator's PublicationLost; or, untold, the
    read's timeout (shortened here to 4 s)."""

    def __init__(self, inbox_told: list) -> None:
        self.inbox_told, self.read_timeout_at = inbox_told, time.monotonic() + 4

    def get(self, timeout: float | None = None) -> None:
        if self.inbox_told:
            raise RuntimeError("weight publication 1 will not reach this generator: the trainer ranks it was read "
                               "from were lost")
        if time.monotonic() < self.read_timeout_at:
            raise TimeoutError
        raise RuntimeError("RDMA submit failed: tcp read chunk timed out")


@pytest.mark.parametrize("awaited_by", ["finish", "score_ahead"])
def test_a_trainer_that_dies_while_a_generator_reads_its_weights_fails_the_step_and_not_the_generator(awaited_by: str):
    """The ranks die while the generator's inbox reads their publication (that read would wait for its timeout, and
    the requests naming it with it): the trainer's failure is noticed while waiting for the generation, not the
    generator's after failover.call_timeout_s; the trainer's relaunch tells the inbox the publication will not arrive,
    and its restore drops the generation, whose requests then fail for want of weights without blaming the replica.
    The same whether the step awaits the generation (`finish`) or the controller does while the trainer trains
    (`score_ahead`, async)."""
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}")
    replica = fleet.groups["generator"].replicas[0]
    generation, calls, told = _waiting_for_weights(fleet, recovery, _WaitsForWeights)  # the read never ends
    fleet.hosts.fail("a")  # the trainer's host: its ranks are gone
    started = time.monotonic()
    with pytest.raises(TrainerLost, match="host a of the trainer was lost"):
        if awaited_by == "finish":
            recovery.pipeline.finish(generation, PhaseTimer())
        else:
            fleet.state.pending.append(generation)
            recovery.pipeline.score_ahead(PhaseTimer())
    assert time.monotonic() - started < 2, "noticed at the next poll, not at the call timeout (5 s)"
    assert list(fleet.state.pending) == [generation] and generation.calls == calls, "back in flight, for the restore"
    assert generation.scored is None
    fleet.trainer.fetches.abandon(waits=fleet.waits)  # what the trainer's relaunch does first
    assert told == [1]
    recovery.restore(None)
    assert not fleet.state.pending and fleet.state.totals.samples_dropped == 8
    assert [e["role"] for e in fleet.events("failure_detected")] == ["trainer"], "the generator is not blamed"
    assert not replica.failed and replica.outstanding == 0 and fleet.groups["generator"].service.in_flight == [0]
    assert fleet.groups["generator"].service.served == [2], "dropped, not retried"


def _waiting_for_weights(fleet: Fleet, recovery: Recovery, read: Callable[[list], Any]
                         ) -> tuple[PendingGeneration, list, list]:
    """Publication 1 sent to the one generator replica (on host b), whose inbox reads it with `read(told)` (a future;
    `told`: the publications the inbox was told were abandoned), and a generation of two requests naming it: (the
    generation, its requests, told)."""
    fleet.waits.ticks = [fleet.supervisor.tick]
    replica = fleet.groups["generator"].replicas[0]
    told: list[tuple[int, ...]] = []
    sent: list = []
    replica.inbox.fetch.call_one = lambda publication: sent.append(publication) or read(told)
    replica.inbox.abandon = type(replica.inbox.pid)(lambda publication: told.append(publication))
    replica.actor.generate.call_one = lambda *args: _WaitsForWeights(told)
    generators = recovery.pipeline.generators
    fleet.state.policy_version = 1
    generators.before_launch(PhaseTimer())  # publication 1
    calls = [generators.send([[1]] * 4, None, seed=s, number=s, key=f"k{s}") for s in range(2)]
    assert [p.read_timeout_s for p in sent] == [fleet.config.failover.weight_read_s]
    return PendingGeneration([], [[1]] * 8, calls, {"position": 8}, 0, [(0, 1), (1, 2)]), calls, told


def _dropped_without_blaming_the_generator(fleet: Fleet, recovery: Recovery, generation: PendingGeneration,
                                           told: list) -> None:
    assert list(fleet.state.pending) == [generation], "back in flight, for the restore"
    fleet.trainer.fetches.abandon(waits=fleet.waits)  # what the trainer's relaunch does first
    assert told == [1]
    recovery.restore(None)
    replica, generators = fleet.groups["generator"].replicas[0], fleet.groups["generator"]
    assert not fleet.state.pending and fleet.state.totals.samples_dropped == 8
    assert not replica.failed and replica.outstanding == 0 and generators.service.in_flight == [0]
    assert generators.service.served == [2], "dropped, not retried"
    assert fleet.failover.replacements.get("generator", 0) == 0


def test_a_trainer_rank_reported_dead_on_a_host_still_up_fails_the_step_while_a_generator_waits_for_its_weights():
    """Remote workers (pids not visible here): a rank dies while the generator's inbox reads its publication, and its
    host still answers. Monarch's failure report of the trainer's mesh is the trainer's failure at once; before, it was
    ignored, and the request naming the publication ran until the read's timeout and was blamed on the generator."""
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}")
    generation, calls, told = _waiting_for_weights(fleet, recovery, _WaitsForWeights)
    fleet.supervisor.reports.append(SimpleNamespace(mesh_name="trainer-0", detail="rank 1: Killed(sig=9)"))
    started = time.monotonic()
    with pytest.raises(TrainerLost, match="a trainer process failed") as lost:
        recovery.pipeline.finish(generation, PhaseTimer())
    assert time.monotonic() - started < 2, "noticed at the next poll, not at the read's timeout (4 s)"
    assert not lost.value.failure.hung and generation.calls == calls
    assert [(e["role"], e["host"]) for e in fleet.events("failure_detected")] == [("trainer", "a")]
    _dropped_without_blaming_the_generator(fleet, recovery, generation, told)
    assert [e["role"] for e in fleet.events("failure_detected")] == ["trainer"], "the generator is not blamed"


class _ReadGivesUp:
    """An inbox's read of ranks that are stopped (SIGSTOP): it gives up after failover.weight_read_s (shortened)."""

    def __init__(self) -> None:
        self.gives_up_at = time.monotonic() + 0.3

    def get(self, timeout: float | None = None) -> Unread:
        if time.monotonic() < self.gives_up_at:
            raise TimeoutError
        return Unread(publication=1, why=f"{UNREAD} within 2.5 s (MonarchError: RDMA submit failed: tcp read chunk "
                                         "timed out)")


def test_a_trainer_that_hangs_while_a_generator_reads_its_weights_is_blamed_when_the_read_gives_up():
    """The ranks stop (not die) mid-read: no report, no lost host. The inbox's read gives up within the call timeout
    and the step fails as the trainer's (hung: its procs are killed before the relaunch); before, the request naming
    the weights failed and the healthy generator was blamed for it."""
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}")
    generation, calls, told = _waiting_for_weights(fleet, recovery, lambda told: _ReadGivesUp())
    with pytest.raises(TrainerLost, match="the trainer ranks did not serve generator replica 0's read of weight "
                                          "publication 1") as lost:
        recovery.pipeline.finish(generation, PhaseTimer())
    assert lost.value.failure.hung, "stopped ranks: killed before the relaunch"
    assert generation.calls == calls and fleet.events("failure_detected") == []
    _dropped_without_blaming_the_generator(fleet, recovery, generation, told)
    assert fleet.events("failure_detected") == [], "the generator is not blamed"


def test_a_trainer_that_dies_while_a_retrys_generator_reads_its_weights_fails_the_step_and_not_that_generator():
    """Replica 0 read publication 1 and then fails its request for a reason of its own (it still answers: it is not
    replaced), so the request is retried on replica 1, whose inbox still reads the publication when the trainer's host
    is lost. The trainer's failure is noticed while waiting for the retry, and the restore drops the retry without
    blaming replica 1. Before, only the first attempt's read was the trainer's: the retry waited for weights that never
    came, replica 1 was blamed for it and the request retried until the run failed."""
    fleet, recovery = _recovery(replicas_host="b", generators=2, failover="{call_timeout_s: 5, poll_seconds: 0.05}")
    fleet.waits.ticks = [fleet.supervisor.tick]
    replicas = fleet.groups["generator"].replicas
    told: list[int] = []
    replicas[1].inbox.fetch.call_one = lambda publication: _WaitsForWeights(told)  # replica 0's read ends at once
    for replica in replicas:
        replica.inbox.abandon = type(replica.inbox.pid)(lambda publication, i=replica.index: told.append((i, publication)))
    own_failure = RuntimeError("CUDA error: an illegal memory access was encountered")
    replicas[0].actor.generate.call_one = lambda *args: Done(error=own_failure)
    replicas[1].actor.generate.call_one = lambda *args: fleet.hosts.fail("a") or _WaitsForWeights(told)
    generators = recovery.pipeline.generators
    fleet.state.policy_version = 1
    generators.before_launch(PhaseTimer())  # publication 1
    calls = [generators.send([[1]] * 4, None, seed=0, number=0, key="k0")]  # routed to replica 0
    generation = PendingGeneration([], [[1]] * 4, calls, {"position": 4}, 0, [(0, 1)])
    started = time.monotonic()
    with pytest.raises(TrainerLost, match="host a of the trainer was lost"):
        recovery.pipeline.finish(generation, PhaseTimer())
    assert time.monotonic() - started < 2, "noticed at the next poll, not at the read's timeout (4 s)"
    assert list(fleet.state.pending) == [generation] and generation.calls == calls, "back in flight, for the restore"
    assert [(e["role"], e["replica"]) for e in fleet.events("failure_detected")] == [("generator", 0), ("trainer", None)]
    fleet.trainer.fetches.abandon(waits=fleet.waits)  # what the trainer's relaunch does first
    assert told == [(0, 1), (1, 1)]
    recovery.restore(None)
    assert not fleet.state.pending and fleet.state.totals.samples_dropped == 4
    assert [(e["role"], e["replica"]) for e in fleet.events("failure_detected")] == [("generator", 0), ("trainer", None)], \
        "replica 1 is not blamed"
    assert not replicas[1].failed and [r.outstanding for r in replicas] == [0, 0]
    service = fleet.groups["generator"].service
    assert service.in_flight == [0, 0] and service.served == [1, 1], "the retry dropped, not retried again"
    assert fleet.failover.replacements.get("generator", 0) == 0
    assert [(e["role"], e["replica"], e["action"]) for e in fleet.events("recovered")] == [("generator", 0, "retried")], \
        "replica 0's failure is over: nothing waits to be served again (a later failure of it is a new one)"


def test_a_trainer_lost_while_a_dead_generators_replacement_is_published_drops_the_retry_without_blaming_its_replica():
    """Replica 0's proc dies with its request: the request is retried on replica 1 (whose inbox still reads publication
    1) and replica 0 replaced meanwhile; the trainer's host is lost as the retry is sent, so the replacement's
    publication fails as the trainer's. The retry, still out, is dropped at the restore, and replica 1's read of the
    lost ranks is abandoned with the others. Before, the restore received the failed first attempt again (counting it
    done twice) and left the retry out, and the publication's wait for the reads forgot replica 1's, so no inbox was
    told it would not arrive."""
    fleet, recovery = _recovery(replicas_host="b", generators=2, failover="{call_timeout_s: 5, poll_seconds: 0.05}")
    fleet.waits.ticks = [fleet.supervisor.tick]
    replicas = fleet.groups["generator"].replicas
    told: list[tuple[int, int]] = []
    replicas[1].inbox.fetch.call_one = lambda publication: _WaitsForWeights(told)  # replica 0's read ends at once
    for replica in replicas:
        replica.inbox.abandon = type(replica.inbox.pid)(lambda publication, i=replica.index: told.append((i, publication)))
    died = RuntimeError("actor mesh generator-0 failed: the process exited")
    replicas[0].actor.generate.call_one = lambda *args: Done(error=died)
    replicas[0].actor.pid.call_one = lambda *args: Done(error=died)
    replicas[1].actor.generate.call_one = lambda *args: fleet.hosts.fail("a") or _WaitsForWeights(told)
    generators = recovery.pipeline.generators
    fleet.state.policy_version = 1
    generators.before_launch(PhaseTimer())  # publication 1
    fleet.trainer.actors.stage_weights.call = lambda every_read_ended: Done(error=RuntimeError("rank 0 is unreachable"))
    calls = [generators.send([[1]] * 4, None, seed=0, number=0, key="k0")]  # routed to replica 0
    generation = PendingGeneration([], [[1]] * 4, calls, {"position": 4}, 0, [(0, 1)])
    with pytest.raises(TrainerLost, match="rank 0 is unreachable"):
        recovery.pipeline.finish(generation, PhaseTimer())
    assert list(fleet.state.pending) == [generation] and generation.calls == calls, "back in flight, for the restore"
    assert replicas[0].failed and fleet.failover.pending_repairs(), "replaced once the trainer is back"
    fleet.trainer.fetches.abandon(waits=fleet.waits)  # what the trainer's relaunch does first
    assert told == [(1, 1)], "replica 1's read of the lost ranks"
    recovery.restore(None)
    assert not fleet.state.pending and fleet.state.totals.samples_dropped == 4
    assert [(e["role"], e["replica"]) for e in fleet.events("failure_detected")] == [("generator", 0), ("trainer", None)], \
        "replica 1 is not blamed"
    assert not replicas[1].failed and replicas[1].outstanding == 0
    assert fleet.groups["generator"].service.in_flight == [0, 0], "each attempt done once"


class _TrainerProcs(FakeProcs):
    """A relaunched trainer mesh's procs: torch elastic's set-up actor (whose call fails with `elastic_fails`), then
    the trainer's ranks (`ranks`)."""

    _labels = ("procs",)

    def __init__(self, host: str, ranks: FakeActor, *, elastic_fails: bool = False):
        super().__init__(host)
        self.ranks, self.elastic_fails = ranks, elastic_fails

    def spawn(self, name: str, actor_class: type, *args: Any) -> FakeActor:
        if name == "trainer":
            return self.ranks
        setup_env = FakeActor(0, get_host_port=("a.cluster", 29500), setup_env=None)
        if self.elastic_fails:
            setup_env.setup_env.call = lambda *args: Done(error=RuntimeError(UNREACHABLE))
        return setup_env


class _NeverAnswers:
    """A call to ranks that hang (or died where Monarch does not fail the call: `then`, run at the first poll). Waited
    for without polling (`get()`), or still waited for `fails_after_s` after the call, it fails the test instead of
    hanging it."""

    def __init__(self, then: Callable[[], None] = lambda: None, *, fails_after_s: float | None = None):
        self.then = then
        self.fails_at = None if fails_after_s is None else time.monotonic() + fails_after_s

    def get(self, timeout: float | None = None) -> None:
        assert timeout is not None, "waited for the trainer without polling for its failure"
        assert self.fails_at is None or time.monotonic() < self.fails_at, "still waited for, past every bound"
        self.then()
        time.sleep(timeout)
        raise TimeoutError


def _relaunches(fleet: Fleet, *fates: bool | str, saved: dict[str, Any] = SAVED) -> list[FakeActor]:
    """Each relaunch of the trainer spawns a mesh whose ranks load the checkpoint as `saved` and stage weights, or, by the
    next of `fates` each time, fail: as they stage them (False), as torch elastic's environment is set ("elastic"), as
    they start ("start", or "dies": Monarch reports a rank failed and the setup never answers), as they load the
    checkpoint ("load"), or hang as they start ("setup_hangs": no failure, no report) or load it ("load_hangs"); the
    meshes spawned, in order. The waits tick the supervisor (which reads Monarch's reports)."""
    fleet.waits.ticks = [fleet.supervisor.tick]
    meshes: list[FakeActor] = []

    def spawn_across(*, hosts: list[str], **_: Any) -> _TrainerProcs:
        ranks = FakeActor(0, name="trainer", setup={0: {"n_params": 1, "master_addr": hosts[0]}},
                          pids={0: 100 + len(meshes)}, load=lambda path: {0: dict(saved)}, stage_weights=staged_part,
                          shutdown=None, save=_saved_at)
        fate = fates[len(meshes)]
        failed = Done(error=RuntimeError(UNREACHABLE))
        if fate is False:
            ranks.stage_weights.call = lambda every_read_ended: failed
        elif fate == "start":
            ranks.setup.call = lambda master: failed
        elif fate == "dies":
            died = SimpleNamespace(mesh_name="trainer-0", detail="rank 0: Killed(sig=9)")
            ranks.setup.call = lambda master: _NeverAnswers(then=lambda: fleet.supervisor.reports.append(died))
        elif fate == "setup_hangs":
            ranks.setup.call = lambda master: _NeverAnswers(fails_after_s=5)
        elif fate == "load":
            ranks.load.call = lambda path: failed
        elif fate == "load_hangs":
            ranks.load.call = lambda path: _NeverAnswers()
        meshes.append(ranks)
        return _TrainerProcs(hosts[0], ranks, elastic_fails=fate == "elastic")

    fleet.hosts.spawn_across = spawn_across
    return meshes


UNREACHABLE = "rank 0 of the new trainer mesh is unreachable"


def _saved_at(step: int, progress: dict[str, Any]) -> str:
    return f"ckpt/step_{step:06d}"


def _retried_during_the_restore(recovery_failures: int) -> tuple[Fleet, Recovery, PendingGeneration]:
    """A generation in flight at step 6 whose request's replica (0) dies: the restore's drop of it retries the request
    on replica 1 and replaces replica 0 meanwhile, with the weights of the trainer's new mesh, which fails as they are
    staged."""
    fleet, recovery = _recovery(replicas_host="b", generators=2, failover="{call_timeout_s: 5, poll_seconds: 0.05}",
                                trainer=f"{{recover_failures: {recovery_failures}}}")
    fleet.waits.ticks = [fleet.supervisor.tick]
    state, replicas = fleet.state, fleet.groups["generator"].replicas
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    state.generator_version = 6
    died = RuntimeError("actor mesh generator-0 failed: the process exited")
    replicas[0].actor.generate.call_one = lambda *args: Done(error=died)
    replicas[0].actor.pid.call_one = lambda *args: Done(error=died)
    request = fleet.router.send(fleet.groups["generator"], lambda actor: actor.generate.call_one(), key="k0")
    assert request.replica is replicas[0]
    generation = PendingGeneration([], [[1]] * 4, [ReplicaRequest(request, 0)], {"position": 48}, 6, [(0, 1)])
    state.pending.append(generation)
    fleet.hosts.fail("a")  # the trainer's host: its mesh goes to the next host
    fleet.supervisor.scan()
    return fleet, recovery, generation


def test_a_trainer_that_fails_again_while_its_restore_drops_the_generations_in_flight_is_recovered_once_more():
    """The restore after a trainer failure drops the generations in flight; a request retried there has its dead
    replica replaced with the weights of the trainer's new mesh, which fails as it stages them. That TrainerLost is one
    more trainer failure, recovered the same way (a third mesh, the same checkpoint), not a raw TrainerLost out of the
    step loop's handler that ended the run with recoveries left. Every failure gets its `recovered`; the steps lost
    count once."""
    fleet, recovery, generation = _retried_during_the_restore(recovery_failures=2)
    meshes = _relaunches(fleet, False, True)
    recovery.recover_trainer(CallFailed("host a of the trainer was lost", hung=False))
    state, replicas = fleet.state, fleet.groups["generator"].replicas
    assert len(meshes) == 2 and fleet.trainer.actors is meshes[1] and fleet.trainer.pids == [101]
    assert not meshes[1].stage_weights.calls, "replica 0's replacement is left to the next sync"
    assert (state.totals.trainer_recoveries, state.totals.steps_lost) == (2, 2)
    assert (state.step, state.policy_version, state.generator_version) == (4, 4, -1)
    assert not state.pending and state.totals.samples_dropped == 4, "the interrupted generation is dropped too"
    assert [r.outstanding for r in replicas] == [0, 0] and fleet.groups["generator"].service.in_flight[1] == 0, \
        "the retry still out when the new mesh failed is received at the next restore"
    detected = [(e["role"], e["reason"]) for e in fleet.events("failure_detected") if e["role"] == "trainer"]
    assert detected == [("trainer", "host a of the trainer was lost"),
                        ("trainer", f"RuntimeError: {UNREACHABLE}")]
    recovered = [(e["role"], e["action"], e["steps_lost"]) for e in fleet.events("recovered") if e["role"] == "trainer"]
    assert recovered == [("trainer", "restored_checkpoint", 2), ("trainer", "restored_checkpoint", 0)]
    [replaced] = [e for e in fleet.events("replica_replaced") if e["role"] == "trainer"]
    assert replaced["pids"] == [101] and replaced["path"] == "ckpt/step_000004"


def test_a_trainer_that_fails_again_during_its_restore_with_no_recovery_left_ends_the_run_as_a_trainer_failure():
    fleet, recovery, _ = _retried_during_the_restore(recovery_failures=1)
    meshes = _relaunches(fleet, False, True)
    with pytest.raises(ProcFailure, match=r"trainer failed at step 5 \(1 recoveries allowed, trainer.recover_failures\): "
                                          r"RuntimeError: rank 0 of the new trainer mesh is unreachable"):
        recovery.recover_trainer(CallFailed("host a of the trainer was lost", hung=False))
    assert len(meshes) == 1 and fleet.state.totals.trainer_recoveries == 2


@pytest.mark.parametrize(("fate", "reason"), [
    ("elastic", f"the trainer did not start: RuntimeError: {UNREACHABLE}"),
    ("start", f"the trainer did not start: RuntimeError: {UNREACHABLE}"),
    ("dies", "a trainer process failed: namespace(mesh_name='trainer-0', detail='rank 0: Killed(sig=9)')"),  # reported
    ("load", f"the trainer did not load checkpoint ckpt/step_000004: RuntimeError: {UNREACHABLE}"),
    ("load_hangs", "the trainer did not load checkpoint ckpt/step_000004: no answer within 0.5 s")])
def test_a_new_trainer_mesh_that_fails_as_it_starts_or_loads_the_checkpoint_is_one_more_failure(
        fate: str, reason: str, monkeypatch: pytest.MonkeyPatch):
    """The trainer's new mesh fails as torch elastic's environment is set, as its ranks start (Monarch reports one
    dead: its setup never answers), or as they load the checkpoint (or hangs: failover.call_timeout_s): one more
    trainer failure, recovered the same way (a third mesh, the same checkpoint). Before, the new mesh's raw Monarch
    error came out of the recovery and ended the run with recoveries left, or the controller waited without end."""
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)  # the failed meshes' host is up: no port to see closed
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 0.5, poll_seconds: 0.05}",
                                trainer="{recover_failures: 2}")
    state = fleet.state
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    meshes = _relaunches(fleet, fate, True)
    started = time.monotonic()
    recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert time.monotonic() - started < 3
    assert len(meshes) == 2 and fleet.trainer.actors is meshes[1] and fleet.trainer.pids == [101]
    assert meshes[1].load.calls == [("ckpt/step_000004",)]
    assert (state.step, state.policy_version, state.generator_version) == (4, 4, -1)
    assert (state.totals.trainer_recoveries, state.totals.steps_lost) == (2, 2)
    detected = [(e["role"], e["reason"], e["hung"]) for e in fleet.events("failure_detected")]
    assert detected == [("trainer", "trainer process 7 exited", False), ("trainer", reason, fate == "load_hangs")]
    assert [(e["role"], e["steps_lost"]) for e in fleet.events("recovered")] == [("trainer", 2), ("trainer", 0)]
    assert fleet.hosts.killed == ([("a", [100])] if fate == "load_hangs" else []), "a hung mesh's own procs"


def test_a_new_trainer_mesh_that_fails_as_it_loads_with_no_recovery_left_ends_the_run_as_a_trainer_failure():
    fleet, recovery = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}", trainer="{recover_failures: 1}")
    fleet.state.step, fleet.state.last_checkpoint = 6, "ckpt/step_000004"
    meshes = _relaunches(fleet, "load", True)
    fleet.hosts.fail("a")
    with pytest.raises(ProcFailure, match=r"trainer failed at step 7 \(1 recoveries allowed, trainer.recover_failures\): "
                                          r"the trainer did not load checkpoint ckpt/step_000004: RuntimeError: "):
        recovery.recover_trainer(CallFailed("host a of the trainer was lost", hung=False))
    assert len(meshes) == 1 and fleet.state.totals.trainer_recoveries == 2


SFT_SAVED = {"step": 4, "policy_version": 4, "data": {"epoch": 0, "index": 8}}


def _sft_drained(monkeypatch: pytest.MonkeyPatch, *fates: bool | str, recover_failures: int = 2
                 ) -> tuple[Fleet, SftRecovery, list[FakeActor]]:
    """An SFT run at step 4 whose two trainer ranks are on host a (of a, b, c), which the operator has drained: the
    trainer moves at its next checkpoint. Its relaunches as `_relaunches` (ranks that load SFT_SAVED); the meshes."""
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)  # the failed meshes' host is up: no port to see closed
    config = load_config("recipe: sft\nmodel: {path: /m}\nplacement: {backend: monarch}\n"
                         f"trainer: {{ranks: 2, steps: 10, recover_failures: {recover_failures}}}\n"
                         "failover: {call_timeout_s: 0.5, poll_seconds: 0.05}\ncheckpoint: {every_steps: 2}\n")
    fleet = controller_parts(config, FakeHosts(["a", "b", "c"]), {}, trainer_hosts=["a"], trainer_pids=(7, 8))
    fleet.trainer.actors.shutdown, fleet.trainer.actors.save = FakeEndpoint(None), FakeEndpoint(_saved_at)
    stream = ProblemStream([Problem(messages=[{"role": "user", "content": "q"}], response="r")] * 16, seed=0)
    recovery = SftRecovery(config=config, trainer=fleet.trainer, stream=stream, supervisor=fleet.supervisor,
                           failover=fleet.failover, log=fleet.log, recorder=fleet.recorder, state=fleet.state)
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=fleet.hosts,
                          groups={}, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    operator = Operator(config=config, placer=fleet.placer, hosts=fleet.hosts, groups={}, supervisor=fleet.supervisor,
                        drills=drills, recorder=fleet.recorder, state=fleet.state, moves_trainer=True)
    fleet.state.step = fleet.state.policy_version = 4
    operator.operate("load_redirect", parse_operation("load_redirect", {"action": "drain", "host": "a"}))
    return fleet, recovery, _relaunches(fleet, *fates, saved=SFT_SAVED)


def _sft_step_end(recovery: SftRecovery, control: Any = None) -> StepEnd:
    """The end of a step as `MonarchSftRun` wires it: a drained trainer moves after the checkpoint and the commands."""
    return StepEnd(config=recovery.config, recorder=recovery.recorder, evaluate=lambda step: None,
                   checkpoint=recovery.checkpoint, control=control, after_checkpoint=recovery.move_drained_trainer)


def _checkpoint_in_the_step_loop(recovery: SftRecovery, step: int, end: StepEnd | None = None) -> bool:
    """The step loop's end of a step (`end`, else one without operator commands): a checkpoint, where a drained
    trainer moves; a TrainerLost meanwhile, as `MonarchSftRun.train` handles it. Whether the run goes on."""
    recovery.state.step = recovery.state.policy_version = step
    try:
        return (end or _sft_step_end(recovery)).after(step, metrics={UPDATE_SKIPPED: 0.0})
    except TrainerLost as lost:
        recovery.recover_trainer(lost.failure)
        return True


def test_a_drain_whose_move_fails_half_way_is_finished_by_the_recovery_that_leaves_the_drained_host(monkeypatch):
    """The trainer's new mesh (on host b) fails as it starts during the drain's move at the checkpoint; the step loop's
    recovery relaunches it on an undrained host and loads that checkpoint. That recovery finishes the drain: counted
    once, its redirect_finished recorded with the move's facts, and the next checkpoint moves nothing. Before, the
    drain stayed pending, and the next checkpoint stopped the healthy mesh to move it again."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, "start", True)
    state = fleet.state
    _checkpoint_in_the_step_loop(recovery, 4)
    assert len(meshes) == 2 and fleet.trainer.actors is meshes[1] and fleet.placer.trainer_hosts == ["b"]
    assert meshes[1].load.calls == [("ckpt/step_000004",)] and state.step == 4
    assert state.trainer_drain is None and state.totals.migrations == 1 and state.totals.steps_lost == 0
    assert [(e["role"], e["host"]) for e in fleet.events("failure_detected")] == [("trainer", "b")]
    [finished] = fleet.events("redirect_finished")
    assert {k: finished[k] for k in ("step", "action", "host", "moved", "plan", "moved_roles", "from_hosts", "pids",
                                     "path", "in_recovery")} == \
        {"step": 4, "action": "drain", "host": "a", "moved": {}, "plan": {}, "moved_roles": {"trainer": {"0": "b", "1": "b"}},
         "from_hosts": ["a"], "pids": [101], "path": "ckpt/step_000004", "in_recovery": True}
    assert finished["seconds"] >= 0
    _checkpoint_in_the_step_loop(recovery, 6)
    assert len(meshes) == 2 and meshes[1].shutdown.calls == [], "the trainer stays where the recovery put it"
    assert len(fleet.events("redirect_finished")) == 1 and state.totals.migrations == 1


def test_a_trainer_failure_before_a_drains_move_finishes_the_drain_when_its_recovery_leaves_the_host(monkeypatch):
    """A rank dies between the drain and its checkpoint: the recovery places the new mesh on an undrained host, so the
    drain is done there (its checkpoint is the last one); no move at the next checkpoint."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, True)
    fleet.state.last_checkpoint = "ckpt/step_000004"
    fleet.state.step = 5
    recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert fleet.placer.trainer_hosts == ["b"] and fleet.state.trainer_drain is None
    [finished] = fleet.events("redirect_finished")
    assert (finished["host"], finished["from_hosts"], finished["path"], finished["in_recovery"]) == \
        ("a", ["a"], "ckpt/step_000004", True)
    _checkpoint_in_the_step_loop(recovery, 6)
    assert len(meshes) == 1 and fleet.state.totals.migrations == 1


def _dies_as_the_trainer_spawns_there(fleet: Fleet, host: str) -> None:
    """`host` stops accepting connections as the trainer's procs are spawned there."""
    relaunch = fleet.hosts.spawn_across

    def spawn_across(*, hosts: list[str], **kwargs: Any) -> Any:
        if hosts == [host]:
            fleet.hosts.fail(host)
            raise HostsUnreachable(f"host {host} stopped accepting connections while a proc was spawned there")
        return relaunch(hosts=hosts, **kwargs)

    fleet.hosts.spawn_across = spawn_across


def test_a_drain_whose_move_finds_its_new_host_dead_moves_the_trainer_to_the_next_one(monkeypatch):
    """Host b dies as the move spawns the trainer's new procs there: the move goes on to host c, as a recovery's
    relaunch does, and host b's loss is no failure of the trainer (no mesh ran there). Before, the HostsUnreachable
    came out of the checkpoint and ended the run."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, True)
    _dies_as_the_trainer_spawns_there(fleet, "b")
    _checkpoint_in_the_step_loop(recovery, 4)
    assert len(meshes) == 1 and fleet.trainer.actors is meshes[0] and fleet.placer.trainer_hosts == ["c"]
    assert fleet.events("failure_detected") == [] and fleet.trainer.noticed is None
    assert fleet.state.totals.trainer_recoveries == 0 and fleet.state.trainer_drain is None
    [finished] = fleet.events("redirect_finished")
    assert (finished["moved_roles"], finished["in_recovery"]) == ({"trainer": {"0": "c", "1": "c"}}, False)


def test_a_drain_whose_recovery_stays_on_the_drained_host_is_not_finished(monkeypatch):
    """Hosts b and c are lost: the recovery's only host is the drained one. The drain is not done."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, True)
    fleet.state.last_checkpoint = "ckpt/step_000004"
    fleet.hosts.lost.update({"b", "c"})
    recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert fleet.placer.trainer_hosts == ["a"] and fleet.state.trainer_drain is not None
    assert fleet.events("redirect_finished") == [] and fleet.state.totals.migrations == 0


class Commands:
    """The operator's commands as the step loop sees them: `cancel_at` a step's end, the run is cancelled (after a final
    checkpoint)."""

    def __init__(self, *, cancel_at: int | None = None):
        self.cancel_at, self.seen = cancel_at, []

    def between_steps(self, *, step: int, checkpoint: Callable[[], Path]) -> bool:
        self.seen.append(step)
        if step == self.cancel_at:
            checkpoint()
            return False
        return True


def test_a_drains_move_that_fails_at_a_checkpoint_keeps_the_checkpoint_saved_and_runs_the_operators_commands(monkeypatch):
    """The move's new mesh fails as it starts: the checkpoint it was to load is recorded as the run's newest
    (StepEnd.saved), and the step's operator commands still ran (before the move). Before, the TrainerLost out of the
    checkpoint left the previous checkpoint as the newest and skipped the step's commands."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, "start", True)
    commands = Commands()
    end = _sft_step_end(recovery, commands)
    assert _checkpoint_in_the_step_loop(recovery, 4, end)
    assert end.saved == Path("ckpt/step_000004") and commands.seen == [4]
    assert len(meshes) == 2 and fleet.placer.trainer_hosts == ["b"] and fleet.state.trainer_drain is None


def test_a_cancel_at_a_drains_checkpoint_ends_the_run_without_moving_the_trainer(monkeypatch):
    """The operator cancelled as the step that moves a drained trainer ended: the run ends there (its final checkpoint
    saved), with no move to fail first. Before, the move ran inside the checkpoint, before the commands: had it failed,
    the cancel waited for the end of the step after the recovery."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, "start", True)
    commands = Commands(cancel_at=4)
    end = _sft_step_end(recovery, commands)
    assert not _checkpoint_in_the_step_loop(recovery, 4, end)
    assert commands.seen == [4] and end.saved == Path("ckpt/step_000004") and meshes == []
    assert [e["step"] for e in fleet.events("checkpoint_saved")] == [4, 4], "the step's, then the cancel's"
    assert fleet.events("failure_detected") == [] and fleet.state.trainer_drain is not None


NOWHERE = ("the drain of host a waits: no undrained host can take the trainer: it needs 1 host(s) (2 ranks, 2 per "
           "host), undrained: none; the trainer stays there until one can take it")


def test_a_drain_whose_other_hosts_were_lost_leaves_the_healthy_mesh_in_place_and_waits_saying_so_once(monkeypatch):
    """Hosts b and c are lost after host a was drained: no host can take the trainer. The checkpoint does not stop the
    healthy mesh; the drain waits, and the run page is told why once, not at every checkpoint. Before, the move
    relaunched the trainer onto the drained host and recorded the drain finished (in_recovery: false)."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, True)
    first = fleet.trainer.actors
    fleet.hosts.lost.update({"b", "c"})
    for step in (4, 6):
        _checkpoint_in_the_step_loop(recovery, step)
    assert meshes == [] and fleet.trainer.actors is first and first.shutdown.calls == [], "the mesh was not stopped"
    assert fleet.state.trainer_drain is not None and fleet.state.totals.migrations == 0
    assert fleet.events("redirect_finished") == [] and fleet.events("failure_detected") == []
    assert [e["text"] for e in fleet.events("message")] == [NOWHERE]
    assert [e["step"] for e in fleet.events("checkpoint_saved")] == [4, 6]


def test_a_drains_move_whose_only_undrained_host_dies_as_it_spawns_there_waits_on_the_drained_host(monkeypatch):
    """Host c was lost; host b dies as the move spawns the trainer there: the relaunch can only go back to the drained
    host. The drain is not finished there: it waits, saying why. Before, redirect_finished said the trainer had left."""
    fleet, recovery, meshes = _sft_drained(monkeypatch, True)
    fleet.hosts.lost.add("c")
    _dies_as_the_trainer_spawns_there(fleet, "b")
    _checkpoint_in_the_step_loop(recovery, 4)
    assert len(meshes) == 1 and fleet.placer.trainer_hosts == ["a"] and meshes[0].load.calls == [("ckpt/step_000004",)]
    assert fleet.state.trainer_drain is not None and fleet.state.totals.migrations == 0
    assert fleet.events("redirect_finished") == [] and [e["text"] for e in fleet.events("message")] == [
        "host b is unreachable: its procs are lost", NOWHERE]
    _checkpoint_in_the_step_loop(recovery, 6)
    assert len(meshes) == 1 and len(fleet.events("message")) == 2, "no second move, no second message"


def test_a_drain_whose_move_fails_with_no_recovery_left_fails_the_run_without_saying_the_drain_finished(monkeypatch):
    fleet, recovery, meshes = _sft_drained(monkeypatch, "start", recover_failures=0)
    with pytest.raises(ProcFailure, match=r"trainer failed at step 5 \(0 recoveries allowed, trainer.recover_failures\): "
                                          r"the trainer did not start: RuntimeError: "):
        _checkpoint_in_the_step_loop(recovery, 4)
    assert fleet.events("redirect_finished") == [] and fleet.state.totals.migrations == 0
    assert [e["host"] for e in fleet.events("redirect_started")] == ["a"]


@pytest.mark.parametrize("fate", ["elastic", "start", "dies"])
def test_a_trainer_that_fails_as_the_run_starts_ends_the_run_saying_so(fate: str):
    """At the run's start no recovery is possible: the trainer's failure ends the run with what failed (before: a raw
    Monarch error, or a wait without end for a rank Monarch reported dead)."""
    fleet, _ = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}")
    _relaunches(fleet, fate)
    trainer = fleet.trainer
    with pytest.raises(TrainerLost, match=r"^the trainer did not start: (RuntimeError: rank 0|a trainer process failed)"):
        trainer.launch()
        trainer.await_started()


SETUP_OVERDUE = r"the trainer did not start within 0.5 s \(failover.setup_timeout_s\)"


@pytest.mark.parametrize("polled", [False, True])
def test_a_trainer_whose_setup_never_ends_ends_the_run_at_failover_setup_timeout_s(polled: bool):
    """A set-up that hangs (a stuck shared filesystem, a deadlocked rendezvous: no rank fails, nothing is reported)
    ends the run at failover.setup_timeout_s, waited for at once (SFT's start) or polled beside the other roles
    (GRPO's), not at the shorter call timeout; its procs' pids are known, for the run's stop. Before, a trainer's
    set-up had no bound: the run waited, holding its GPUs, without end."""
    fleet, _ = _recovery(failover="{call_timeout_s: 0.2, poll_seconds: 0.05, setup_timeout_s: 0.5}")
    _relaunches(fleet, "setup_hangs")
    trainer = fleet.trainer
    started = time.monotonic()
    with pytest.raises(TrainerLost, match=f"^{SETUP_OVERDUE}$") as lost:
        trainer.launch()
        while not trainer.await_started(wait_s=0.02 if polled else None):
            pass
    assert 0.5 <= time.monotonic() - started < 2
    assert lost.value.failure.hung and trainer.pids == [100]


def test_a_new_trainer_mesh_whose_setup_never_ends_is_one_more_failure_at_failover_setup_timeout_s(monkeypatch):
    """During a recovery, a new mesh whose set-up hangs is one more trainer failure at failover.setup_timeout_s: its
    own procs are killed (not the failed mesh's before it) and a third mesh restores the checkpoint. Before, the
    recovery waited without end."""
    from workers.engine.controller import supervision

    monkeypatch.setattr(supervision, "HOST_SETTLE_S", 0.0)  # the failed meshes' host is up: no port to see closed
    fleet, recovery = _recovery(replicas_host="b", trainer="{recover_failures: 2}",
                                failover="{call_timeout_s: 0.2, poll_seconds: 0.05, setup_timeout_s: 0.5}")
    state = fleet.state
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    meshes = _relaunches(fleet, "setup_hangs", True)
    started = time.monotonic()
    recovery.recover_trainer(CallFailed("trainer process 7 exited", hung=False))
    assert 0.5 <= time.monotonic() - started < 3
    assert len(meshes) == 2 and fleet.trainer.actors is meshes[1] and fleet.trainer.pids == [101]
    assert meshes[1].load.calls == [("ckpt/step_000004",)] and state.totals.trainer_recoveries == 2
    detected = [(e["reason"], e["hung"]) for e in fleet.events("failure_detected")]
    assert detected == [("trainer process 7 exited", False),
                        ("the trainer did not start within 0.5 s (failover.setup_timeout_s)", True)]
    assert fleet.hosts.killed == [("a", [100])], "the hung mesh's own procs, not the first mesh's (pid 7)"
    assert [(e["role"], e["steps_lost"]) for e in fleet.events("recovered")] == [("trainer", 2), ("trainer", 0)]


def test_a_trainer_that_fails_as_a_grpo_run_starts_ends_the_run_saying_so():
    """GRPO's start polls the trainer's setup beside the other roles' (`await_started(wait_s=...)`)."""
    fleet, _ = _recovery()
    _relaunches(fleet, "start")
    trainer = fleet.trainer
    trainer.launch()
    with pytest.raises(TrainerLost, match=f"^the trainer did not start: RuntimeError: {UNREACHABLE}"):
        trainer.await_started(wait_s=0.01)


def test_a_trainer_that_fails_as_it_loads_the_checkpoint_a_run_resumes_from_ends_the_run_saying_so():
    fleet, _ = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}")
    fleet.trainer.actors.load.call = lambda path: Done(error=RuntimeError(UNREACHABLE))
    with pytest.raises(TrainerLost, match=f"^the trainer did not load checkpoint ckpt/step_000004: RuntimeError: "
                                          f"{UNREACHABLE}"):
        fleet.trainer.load("ckpt/step_000004")
    fleet.trainer.actors.load.call = lambda path: _NeverAnswers()
    with pytest.raises(TrainerLost, match="did not load checkpoint ckpt/step_000004: no answer within 0.5 s"):
        fleet.trainer.load("ckpt/step_000004")


def test_a_trainer_that_fails_as_it_shuts_down_after_the_last_step_does_not_fail_the_run():
    """The run is over and its last checkpoint saved: the failure is recorded, not recovered (before: the raw Monarch
    error failed the finished run, and hung ranks made it wait without end). Before a drain's move it is TrainerLost,
    for the step loop to recover."""
    fleet, _ = _recovery(failover="{call_timeout_s: 0.5, poll_seconds: 0.05}")
    fleet.state.step = 6
    trainer = fleet.trainer
    trainer.actors.shutdown = type(trainer.actors.pid)(None)
    trainer.actors.shutdown.call = lambda: Done(error=RuntimeError("rank 1 is unreachable"))
    with pytest.raises(TrainerLost, match="rank 1 is unreachable"):
        trainer.leave_group()
    trainer.actors.shutdown.call = lambda: _NeverAnswers()
    trainer.shutdown()
    assert [(e["role"], e["reason"], e["hung"]) for e in fleet.events("failure_detected")] == \
        [("trainer", "no answer within 0.5 s", True)]
    [said] = [e["text"] for e in fleet.events("message")]
    assert said == ("the trainer failed as it shut down after the run's last step (6): no answer within 0.5 s; not "
                    "recovered: the run is over")


def test_a_control_proc_lost_during_a_trainer_recoverys_restore_is_replaced_and_the_recovery_goes_on():
    """The trainer's new mesh has loaded the checkpoint when the control proc dies as the dataset loads its part.
    Before, that ControlLost came out of the step loop's TrainerLost handler and ended the run; now the restore
    replaces the control proc (within failover.max_replacements) and the trainer's recovery ends as usual. The steps
    were lost to the trainer's failure: the control proc's loses none more."""
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}",
                                trainer="{recover_failures: 1}")
    state, control = fleet.state, fleet.control
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    meshes = _relaunches(fleet, True)
    first = control.dataset
    first.load_state_dict.call_one = lambda data: Done(error=RuntimeError("actor mesh dataset failed: it exited"))
    fleet.hosts.fail("a")
    fleet.supervisor.scan()
    recovery.recover_trainer(CallFailed("host a of the trainer was lost", hung=False))
    assert fleet.trainer.actors is meshes[0] and meshes[0].load.calls == [("ckpt/step_000004",)]
    assert control.dataset is not first and control.dataset.load_state_dict.calls == [({"position": 40},)]
    assert control.buffer.load_state_dict.calls == [({"records": []},)]
    assert (state.step, state.totals.trainer_recoveries, state.totals.control_recoveries, state.totals.steps_lost) == \
        (4, 1, 1, 2)
    assert [(e["role"], e["reason"]) for e in fleet.events("failure_detected")] == \
        [("trainer", "host a of the trainer was lost"),
         ("replay_buffer", "RuntimeError: actor mesh dataset failed: it exited")]
    assert [(e["role"], e["steps_lost"]) for e in fleet.events("recovered")] == [("replay_buffer", 0), ("trainer", 2)]


def test_a_control_proc_that_fails_again_as_its_restore_loads_it_is_replaced_once_more():
    """The control proc's host is lost; its replacement dies as the replay buffer loads its part: replaced once more
    (failover.max_replacements), not a ControlLost out of the step loop's handler. Each failure is recovered; the
    steps lost count once."""
    fleet, recovery = _recovery()
    state, control = fleet.state, fleet.control
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    fleet.hosts.fail("c")
    fleet.supervisor.scan()

    def replace(real=control.replace) -> Any:
        noticed = real()
        if state.totals.control_recoveries == 1:
            control.buffer.load_state_dict.call_one = lambda records: Done(error=RuntimeError("replay buffer died"))
        return noticed

    control.replace = replace
    recovery.recover_control(ControlLost("host c of the dataset and replay buffer was lost"))
    assert control.host == "b" and control.buffer.load_state_dict.calls == [({"records": []},)]
    assert (state.step, state.totals.control_recoveries, state.totals.steps_lost) == (4, 2, 2)
    assert [e["role"] for e in fleet.events("failure_detected")] == ["replay_buffer", "replay_buffer"]
    assert [(e["role"], e["steps_lost"]) for e in fleet.events("recovered")] == [("replay_buffer", 2), ("replay_buffer", 0)]


def test_a_trainer_that_fails_while_a_lost_control_procs_restore_drops_the_generations_in_flight_is_recovered():
    """The control proc's host is lost; its restore drops the generations in flight, one of which waits for a
    generator's read of the trainer's weights when the trainer's host is lost too. Before, that TrainerLost came out of
    the step loop's ControlLost handler and ended the run; now the trainer is recovered (the same checkpoint) and the
    control proc's recovery is recorded as well."""
    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}",
                                trainer="{recover_failures: 1}")
    generation, calls, told = _waiting_for_weights(fleet, recovery, _WaitsForWeights)
    state = fleet.state
    state.pending.append(generation)
    state.step, state.policy_version, state.generations, state.last_checkpoint = 6, 6, 7, "ckpt/step_000004"
    meshes = _relaunches(fleet, True)
    fleet.hosts.fail("c")  # the control proc's
    fleet.supervisor.scan()
    fleet.control.replace = lambda real=fleet.control.replace: fleet.hosts.fail("a") or real()  # then the trainer's
    recovery.recover_control(ControlLost("host c of the dataset and replay buffer was lost"))
    assert fleet.control.host == "b" and len(meshes) == 1 and fleet.trainer.actors is meshes[0]
    assert told == [1], "the trainer's relaunch told the inbox its read will not end"
    assert (state.step, state.totals.steps_lost, state.totals.trainer_recoveries, state.totals.control_recoveries) == \
        (4, 2, 1, 1)
    assert not state.pending and state.totals.samples_dropped == 8
    assert [e["role"] for e in fleet.events("failure_detected")] == ["replay_buffer", "trainer"]
    assert [(e["role"], e["steps_lost"]) for e in fleet.events("recovered")] == [("replay_buffer", 2), ("trainer", 0)]


def test_a_trainer_lost_as_the_generations_launched_ahead_are_dropped_after_the_last_step_does_not_fail_the_run():
    """The last step is trained and checkpointed; a generation launched ahead waits for a generator's read of the
    trainer's weights when the trainer's host is lost. Nothing needs that generation: the run ends as trained, the
    failure on its page, its ranks stopped (not shut down: they are gone). Before, the TrainerLost failed the run."""
    from workers.engine.recipes.grpo_monarch import MonarchGrpoRun

    fleet, recovery = _recovery(replicas_host="b", failover="{call_timeout_s: 5, poll_seconds: 0.05}",
                                trainer="{steps: 6, recover_failures: 1}")
    generation, _, told = _waiting_for_weights(fleet, recovery, _WaitsForWeights)
    run = MonarchGrpoRun(fleet.config, fleet.recorder, hosts=fleet.hosts, plan=DrillPlan([]), control=None,
                         fault_reports=[])
    run.state, run.trainer, run.supervisor, run.injector = fleet.state, fleet.trainer, fleet.supervisor, fleet.injector
    run.control_procs, run.pipeline, run.recovery = fleet.control, recovery.pipeline, recovery
    run.step_end = StepEnd(config=fleet.config, recorder=fleet.recorder, evaluate=lambda step: None,
                           checkpoint=recovery.checkpoint, control=None)
    fleet.trainer.actors.shutdown = type(fleet.trainer.actors.pid)(None)
    fleet.state.step, fleet.state.last_checkpoint = 6, "ckpt/step_000006"  # the last step, saved
    fleet.state.pending.append(generation)
    fleet.hosts.fail("a")
    result = run.train()
    assert result.step == 6 and fleet.state.totals.trainer_recoveries == 0
    assert fleet.trainer.actors.shutdown.calls == [], "a lost mesh is stopped, not asked to shut down"
    assert [(e["role"], e["reason"]) for e in fleet.events("failure_detected")] == \
        [("trainer", "host a of the trainer was lost")]
    [said] = [e["text"] for e in fleet.events("message") if "trainer" in e["text"]]
    assert said == ("the trainer failed after the run's last step (6): host a of the trainer was lost; not recovered: "
                    "the run is over and nothing needs the generations launched ahead")
    assert fleet.events("staleness_histogram"), "the run's end is recorded as usual"


def test_the_inner_waits_for_weights_end_before_the_call_timeout_that_blames():
    failover = grpo_config(failover="{call_timeout_s: 40}").failover
    assert failover.weight_read_s < failover.weight_wait_s < failover.call_timeout_s == 40


def test_a_checkpoint_saves_the_position_before_the_generations_in_flight():
    fleet, recovery = _recovery()
    state = fleet.state
    state.step, state.policy_version, state.generations = 6, 6, 7
    state.staleness.update({0: 6})
    fleet.trainer.actors.save = type(fleet.trainer.actors.pid)(lambda step, progress: f"ckpt/step_{step:06d}")
    recovery.checkpoint(6)
    saved = fleet.trainer.actors.save.calls[-1][1]
    assert saved == {"step": 6, "policy_version": 6, "generations": 7, "data": {"position": 0},
                     "buffer": {"position": 0}, "staleness": {0: 6}}
    _in_flight(fleet, prompts=4)
    path = recovery.checkpoint(6)
    saved = fleet.trainer.actors.save.calls[-1][1]
    assert (saved["generations"], saved["data"]) == (5, {"position": 48}), "a restore generates them again"
    assert path == Path("ckpt/step_000006") and state.last_checkpoint == "ckpt/step_000006"
    assert fleet.events("checkpoint_saved")[-1]["policy_version"] == 6


def _scores_ahead(fleet: Fleet, recovery: Recovery) -> Callable[[], PendingGeneration]:
    """Fakes that answer a generation (one completion of 3 tokens a request) and score it; a function that puts one
    more generation in flight and scores it ahead, as the step loop does while the trainer trains."""
    for replica in fleet.groups["generator"].replicas:
        replica.actor.generate = FakeEndpoint(([SimpleNamespace(token_ids=[1, 2, 3])], [("generate", 0.0, 0.2)]))
    for replica in fleet.groups["reward"].replicas:
        replica.actor.score = FakeEndpoint("record")
    fleet.control.buffer.put = FakeEndpoint(None)
    fleet.trainer.actors.save = type(fleet.trainer.actors.pid)(lambda step, progress: f"ckpt/step_{step:06d}")

    def scored_ahead(timer: PhaseTimer | None = None) -> PendingGeneration:
        _in_flight(fleet, prompts=4)
        recovery.pipeline.score_ahead(timer or PhaseTimer())
        return fleet.state.pending[-1]
    return scored_ahead


def test_a_generation_scored_while_the_trainer_trains_stays_in_flight_until_the_next_step_buffers_it():
    """Async mode: the controller awaits and scores the oldest generation in flight while the trainer trains, and the
    next step only buffers it. Until then it is one in flight: a checkpoint saves the dataset's position before it."""
    fleet, recovery = _recovery()
    timer = PhaseTimer()
    generation = _scores_ahead(fleet, recovery)(timer)
    [reward] = fleet.groups["reward"].replicas
    assert set(timer.seconds) == {"score_ahead"}, "off the step's path: not its generate_wait or reward"
    assert {(lane, phase) for lane, phase, _, _ in timer.spans} == {
        ("controller", "score_ahead"), ("generator 0", "generate"), ("reward", "reward")}, "the procs keep their own"
    assert list(fleet.state.pending) == [generation] and generation.scored is not None
    assert (generation.scored.record, generation.scored.tokens) == ("record", 3)
    assert reward.actor.score.calls and fleet.control.buffer.put.calls == [], "scored, not buffered yet"
    recovery.pipeline.score_ahead(PhaseTimer())  # scored once
    assert len(reward.actor.score.calls) == 1
    recovery.checkpoint(6)
    assert fleet.trainer.actors.save.calls[-1][1]["data"] == {"position": 48}, "a restore generates it again"
    scored = recovery.pipeline.finish(fleet.state.pending.popleft(), PhaseTimer())
    assert scored is generation.scored and fleet.control.buffer.put.calls == [("record",)]
    assert len(reward.actor.score.calls) == 1 and fleet.groups["generator"].service.served == [1], "nothing asked again"


def test_a_restore_drops_a_generation_scored_ahead_without_asking_its_replica_again():
    fleet, recovery = _recovery()
    _scores_ahead(fleet, recovery)()
    recovery.restore(None)
    service = fleet.groups["generator"].service
    assert not fleet.state.pending and fleet.state.totals.samples_dropped == 4
    assert fleet.control.buffer.put.calls == [] and service.served == [1] and service.in_flight == [0]


def test_the_run_state_counts_policy_age_per_trained_batch():
    state = RunState(policy_version=5)
    assert state.trained(record_version=3) == 2
    assert state.trained(record_version=6) == 0
    assert (state.step, state.policy_version, dict(state.staleness)) == (2, 7, {2: 1, 0: 1})


class Rollouts:
    prompt_texts = ["p1", "p2", "p3"]
    response_texts = ["r1", "r2", "r3"]
    rewards = [1.0, 0.0, 0.5]
    advantages = [0.8, -0.8, 0.0]
    policy_version = 2

    def __len__(self) -> int:
        return 3


class Control:
    def __init__(self, stop_at: int):
        self.stop_at, self.seen = stop_at, []

    def between_steps(self, *, step: int, checkpoint) -> bool:
        self.seen.append(step)
        return step < self.stop_at


def test_every_recipe_ends_a_step_the_same_way():
    config = grpo_config(eval="{every_steps: 2, rollout_samples: 2}", checkpoint="{every_steps: 3}", trainer="{steps: 5}")
    sink = MemorySink()
    evals, saves = [], []
    end = StepEnd(config=config, recorder=Recorder([sink]), evaluate=lambda step: evals.append(step) or step,
                  checkpoint=lambda step: saves.append(step) or Path(f"ckpt/{step}"), control=Control(stop_at=9))
    end.before_first(0)
    assert [end.after(step, metrics={UPDATE_SKIPPED: 0.0}, rollouts=Rollouts()) for step in range(1, 6)] == [True] * 5
    assert evals == [0, 2, 4, 5] and saves == [3, 5], "eval and checkpoint at their cadence and at the last step"
    assert (end.first_eval, end.last_eval, end.saved) == (0, 5, Path("ckpt/5"))
    rollouts = [{k: v for k, v in r.items() if k not in ("seq", "time")} for r in sink.records if r["kind"] == "rollout"]
    assert len(rollouts) == 10 and rollouts[0] == {"kind": "rollout", "step": 1, "prompt": "p1", "completion": "r1",
                                                    "reward": 1.0, "advantage": 0.8, "policy_version": 2,
                                                    "split": "train"}
    stopping = StepEnd(config=config, recorder=Recorder([]), evaluate=lambda step: None,
                       checkpoint=lambda step: Path("x"), control=Control(stop_at=2))
    stopping.before_first(3)  # a resumed run: no eval before its first step
    assert [stopping.after(step, metrics={UPDATE_SKIPPED: 0.0}) for step in (1, 2)] == [True, False], \
        "the operator cancelled after step 2"
    assert stopping.first_eval is None


def test_a_cancels_final_checkpoint_is_the_runs_newest():
    config = grpo_config(checkpoint="{every_steps: 3}", trainer="{steps: 5}")
    end = StepEnd(config=config, recorder=Recorder([]), evaluate=lambda step: None,
                  checkpoint=lambda step: Path(f"ckpt/{step}"), control=Commands(cancel_at=2))
    assert end.after(2, metrics={UPDATE_SKIPPED: 0.0}) is False
    assert end.saved == Path("ckpt/2"), "the result names the checkpoint the cancel wrote, not none (or an older one)"
