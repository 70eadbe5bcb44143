"""The Monarch controller's supervision and failover decisions over fake hosts: what a lost host, a failure report
or a dead control proc means, and where replacements and spares go. The replica groups, their services, failover
and the fault injector are the real ones; no process is spawned."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engine.fake_fleet import (PIDS, Done, FakeActor, FakeHosts, FakeProcs, Fleet, controller_parts,
                                     fails_to_spawn, fake_group, fetched, grpo_config)
from workers.engine.actors.calls import CallFailed
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.actors.weight_inbox import UNREAD, Fetched, Unread
from workers.engine.controller.control_procs import ControlLost
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerLost

GENERATOR = {"take_weights": 3}


def _supervised(*, spares: int = 0) -> tuple[Fleet, Supervisor]:
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b"], spares=spares, **GENERATOR),
              "reward": fake_group("reward", hosts, ["c"], spares=spares)}
    fleet = controller_parts(grpo_config(), hosts, groups, trainer_hosts=["a"], control_host="c")
    return fleet, fleet.supervisor


def test_a_lost_host_takes_every_role_on_it_and_its_replicas_are_replaced_elsewhere_at_the_current_weights():
    fleet, supervisor = _supervised()
    fleet.state.step, fleet.state.policy_version = 4, 3
    generators = fleet.groups["generator"]
    lost = generators.replicas[0]
    fleet.hosts.fail("a")
    supervisor.scan()
    assert lost.lost_with_host == "host a is unreachable" and lost.failed
    assert generators.service.routable() == [1]
    detected = fleet.events("failure_detected")
    assert [(e["role"], e["replica"], e["host"]) for e in detected] == [("trainer", None, "a"), ("generator", 0, "a")]
    assert detected[0]["step"] == 5, "the trainer's failure counts against the step it was about to train"
    assert fleet.trainer.noticed is not None and fleet.control.noticed is None
    fleet.hosts.fail("a")
    supervisor.scan()
    assert len(fleet.events("failure_detected")) == 2, "a host is lost once"

    supervisor.repair()
    replaced = fleet.events("replica_replaced")
    assert [(e["role"], e["replica"], e["host"], e["policy_version"]) for e in replaced] == [("generator", 0, "c", 3)]
    new = generators.replicas[0]
    assert new is not lost and new.host == "c" and generators.service.routable() == [0, 1]
    assert fetched(new.inbox) == [(1, 3)], "the replacement reads the trainer's weights first"
    assert new.actor.take_weights.calls == [(1,)] and fleet.state.publications == 1


def test_losing_the_control_host_is_noticed_once_for_the_dataset_and_buffer():
    fleet, supervisor = _supervised()
    fleet.hosts.fail("c")
    supervisor.scan()
    detected = fleet.events("failure_detected")
    assert [(e["role"], e["host"]) for e in detected] == [("replay_buffer", "c"), ("reward", "c")]
    assert "the dataset and replay buffer ran there" in detected[0]["reason"]
    with pytest.raises(ControlLost, match="host c of the dataset and replay buffer was lost"):
        fleet.control.call(Done(error=TimeoutError()))  # a call that never answers, on a lost host
    assert len(fleet.events("failure_detected")) == 2


def test_failure_reports_name_the_replica_or_spare_they_are_about():
    fleet, supervisor = _supervised(spares=1)
    supervisor.warm_spares()
    supervisor.poll_spares()
    generators, rewards = fleet.groups["generator"], fleet.groups["reward"]
    spare = generators.ready_spares[0]
    assert [(e["role"], e["host"]) for e in fleet.events("spares_started")] == [("generator", "a"), ("reward", "a")], "the first host up with room"
    assert len(fleet.events("spare_ready")) == 2
    supervisor.reports.extend([SimpleNamespace(mesh_name=f"{spare.name}-0"),
                               SimpleNamespace(mesh_name=f"{rewards.replicas[0].name}-0"),
                               SimpleNamespace(mesh_name="trainer-Zq81xw"),  # a trainer mesh stopped earlier
                               SimpleNamespace(mesh_name="logger-3")])
    supervisor.scan()
    assert generators.ready_spares == [], "a failed spare is dropped"
    assert any("a generator spare failed" in e["text"] for e in fleet.events("message"))
    assert [(e["role"], e["replica"]) for e in fleet.events("failure_detected")] == [("reward", 0)]
    assert supervisor.unexplained == [], "an earlier trainer mesh's and the loggers' reports are no failure of the run's"
    assert fleet.trainer.noticed is None

    supervisor.repair()
    assert fleet.events("replica_replaced")[0]["from_spare"], "the reward's ready spare took the failed one's place"
    assert [e["role"] for e in fleet.events("spares_started")][2:] == ["generator", "reward"], \
        "the dropped spare and the one used up start again"


class NeverLoads:
    """A spare's pid call whose model load never ends."""

    def get(self, timeout: float | None = None) -> int:
        time.sleep(min(timeout or 0, 0.01))
        raise TimeoutError


def test_a_spare_that_does_not_start_within_setup_timeout_s_is_dropped_saying_so_and_started_again():
    """Before, a spare whose model load hung stayed loading for ever (and the run's start, which waits for its spares,
    with it)."""
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"reward": fake_group("reward", hosts, ["c"], spares=1, setup_timeout_s=0.3)}
    fleet = controller_parts(grpo_config(), hosts, groups, trainer_hosts=["a"], control_host="c")
    supervisor, rewards = fleet.supervisor, groups["reward"]
    supervisor.warm_spares()
    stuck = rewards.warming[0][0]
    rewards.warming = [(stuck, NeverLoads())]
    started = time.monotonic()
    while rewards.warming:
        supervisor.poll_spares(wait_s=0.02)
        assert time.monotonic() - started < 3, "waited past every bound"
    assert stuck.procs.stopped and rewards.spare_replicas() == []
    assert [e["text"] for e in fleet.events("message")] == [
        "a reward spare did not start within 0.3 s (failover.setup_timeout_s); another is started"]
    supervisor.warm_spares()
    assert len(rewards.warming) == 1 and rewards.warming[0][0] is not stuck


SPAWN_FAILED = RuntimeError("the proc mesh failed as the actor was spawned on it")


@pytest.mark.parametrize("part", ["actor", "inbox"])
def test_a_replacement_whose_actor_does_not_spawn_on_its_procs_is_one_more_failure_its_procs_stopped_and_released(
        part: str):
    """The replacement's procs spawned, then its actor (or weight inbox) did not. Before, that error escaped the repair
    (the run failed with it) and the new procs were never stopped nor their GPUs released; now it is a replacement
    that did not start, as one whose model load failed: one more failure of the replica, and another is started."""
    fleet, supervisor = _supervised()
    generators = fleet.groups["generator"]
    failed = fails_to_spawn(generators, SPAWN_FAILED, part=part, times=1)
    supervisor.reports.append(SimpleNamespace(mesh_name=f"{generators.replicas[0].name}-0"))
    supervisor.scan()
    supervisor.repair()
    assert [procs.stopped for procs in failed] == [True], "the procs it got are stopped"
    unstarted_owner = fleet.hosts.spawned[-2][1]
    assert unstarted_owner in fleet.hosts.released, "and their GPUs released"
    detected = fleet.events("failure_detected")
    assert [(e["replica"], e["reason"]) for e in detected][1:] == [
        (0, f"the replacement did not start: RuntimeError: {SPAWN_FAILED}")]
    new = generators.replicas[0]
    assert new.name == fleet.hosts.spawned[-1][1] and generators.service.routable() == [0, 1]
    assert [e["replica"] for e in fleet.events("replica_replaced")] == [0]
    assert fleet.failover.replacements == {"generator": 2} and not fleet.failover.pending_repairs()


@pytest.mark.parametrize(("role", "part"), [("reward", "actor"), ("generator", "inbox")])
def test_a_spare_whose_actor_does_not_spawn_on_its_procs_is_dropped_saying_so_its_procs_stopped_and_released(
        role: str, part: str):
    """Before, the error escaped `warm_spares` (at a repair: the run failed with it) and the spare's procs were left
    running with their GPUs taken; now it is a spare that did not start, told at the next poll, and the next warm
    starts another."""
    hosts = FakeHosts(["a", "b", "c"])
    groups = {role: fake_group(role, hosts, ["c"], spares=1, **(GENERATOR if role == "generator" else {}))}
    fleet = controller_parts(grpo_config(), hosts, groups, trainer_hosts=["a"], control_host="c")
    supervisor, group = fleet.supervisor, groups[role]
    failed = fails_to_spawn(group, SPAWN_FAILED, part=part, times=1)
    supervisor.warm_spares()
    assert [procs.stopped for procs in failed] == [True] and group.spare_replicas() == []
    assert fleet.hosts.spawned[-1][1] in fleet.hosts.released
    assert fleet.events("spares_started") == []
    supervisor.poll_spares()
    assert [e["text"] for e in fleet.events("message")] == [
        f"a {role} spare did not start: RuntimeError: {SPAWN_FAILED}; another is started"]
    supervisor.poll_spares()
    assert len(fleet.events("message")) == 1, "said once"
    supervisor.warm_spares()
    supervisor.poll_spares()
    assert len(group.ready_spares) == 1 and len(fleet.events("spare_ready")) == 1


def _dies_as_a_spare_spawns_there(hosts: FakeHosts, dying: str, *, at: int) -> None:
    """Host `dying` stops accepting connections as the `at`th spare is spawned there (`Hosts.spawn_procs` raises)."""
    spawn_procs, spares = hosts.spawn_procs, []

    def spawn(*, host: str, owner: str = "", **kwargs: Any) -> Any:
        if "_spare_" in owner and host == dying:
            spares.append(owner)
            if len(spares) == at:
                hosts.fail(host)
                raise HostsUnreachable(f"host {host} stopped accepting connections while a proc was spawned there")
        return spawn_procs(host=host, owner=owner, **kwargs)

    hosts.spawn_procs = spawn


@pytest.mark.parametrize("at", [1, 2])
def test_a_host_that_dies_as_a_spare_spawns_there_is_told_once_and_the_spares_start_on_the_next_host(at: int):
    """Host b, the reward spares' host, dies as the first (or the second) spare is spawned there. Before, the
    HostsUnreachable escaped `warm_spares` and ended the run (at a repair, an operator's drain, or the run's start);
    now it is told on the run page, b is found lost (its replica fails over) and the spares start on host c."""
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"reward": fake_group("reward", hosts, ["b"], spares=2)}
    fleet = controller_parts(grpo_config("reward: {hosts: [b, c]}"), hosts, groups, trainer_hosts=["a"],
                             control_host="a")
    supervisor, rewards = fleet.supervisor, groups["reward"]
    on_b = rewards.replicas[0]
    _dies_as_a_spare_spawns_there(hosts, "b", at=at)
    supervisor.warm_spares()
    assert hosts.lost == {"b"}
    assert [e["text"] for e in fleet.events("message")] == [
        "host b is unreachable: its procs are lost",
        "a reward spare did not start: host b stopped accepting connections while a proc was spawned there; another "
        "is started elsewhere"]
    assert [(e["role"], e["replica"], e["host"]) for e in fleet.events("failure_detected")] == [("reward", 0, "b")]
    assert on_b.failed and fleet.failover.pending_repairs(), "the replica on the lost host fails over"
    assert [(e["host"], e["count"]) for e in fleet.events("spares_started")] == [("c", 2)]
    assert [spare.host for spare in rewards.spare_replicas()] == ["c", "c"], "one started on b before it died is dropped"
    supervisor.poll_spares()
    assert len(rewards.ready_spares) == 2

    supervisor.repair()
    assert [(e["host"], e["from_spare"]) for e in fleet.events("replica_replaced")] == [("c", True)]
    assert len(fleet.events("message")) == 2, "told once: b is not tried again"
    assert [e["host"] for e in fleet.events("spares_started")] == ["c", "c"], "the spare used up starts again on c"


def test_a_replacement_whose_proc_dies_as_it_takes_the_weights_is_one_more_failure_and_another_serves():
    """The generator's replacement loaded its model, then its take_weights call failed (its proc died). Before, that
    CallFailed escaped the repair and ended the run; now it is one more failure of the replica, its procs are
    stopped, and the next replacement serves at the current weights."""
    fleet, supervisor = _supervised()
    fleet.state.step, fleet.state.policy_version = 4, 3
    generators = fleet.groups["generator"]
    spawn_actor, spawned = generators.spawn_actor, []

    def dies_as_the_first_takes_the_weights(procs: FakeProcs, name: str) -> FakeActor:
        actor = spawn_actor(procs, name)
        if not spawned:
            actor.take_weights.call_one = lambda publication: Done(error=RuntimeError("the proc died"))
        spawned.append(procs)
        return actor

    generators.spawn_actor = dies_as_the_first_takes_the_weights
    supervisor.reports.append(SimpleNamespace(mesh_name=f"{generators.replicas[0].name}-0"))
    supervisor.scan()
    supervisor.repair()
    assert [procs.stopped for procs in spawned] == [True, False]
    assert [e["reason"] for e in fleet.events("failure_detected")][1:] == [
        "the replacement did not take the current weights: RuntimeError: the proc died"]
    new = generators.replicas[0]
    assert new.procs is spawned[1] and new.version == 3 and generators.service.routable() == [0, 1]
    assert fleet.failover.replacements == {"generator": 2} and not fleet.failover.pending_repairs()


def test_a_report_no_replica_explains_fails_the_control_proc_only_when_it_stops_answering():
    fleet, supervisor = _supervised()
    supervisor.reports.append(SimpleNamespace(mesh_name="dataset_9-0"))
    supervisor.scan()
    supervisor.check_control_procs()  # dataset and buffer answer: the run goes on
    assert supervisor.unexplained == [] and fleet.events("failure_detected") == []
    supervisor.reports.append(SimpleNamespace(mesh_name="dataset_9-0", detail="killed"))
    supervisor.scan()
    fleet.control.buffer.stats.answer = None
    fleet.control.buffer.stats.call_one = lambda *a: Done(error=RuntimeError("actor is dead"))
    with pytest.raises(ControlLost, match="a process of the run failed"):
        supervisor.check_control_procs()
    assert [e["role"] for e in fleet.events("failure_detected")] == ["replay_buffer"]


def test_a_run_without_a_control_proc_drops_unexplained_reports_and_a_lost_host_fails_only_the_trainer():
    """An SFT run: no replicas, no control proc; only its trainer can be lost."""
    hosts = FakeHosts(["a", "b"])
    fleet = controller_parts(grpo_config(), hosts, {}, trainer_hosts=["a"])
    supervisor = Supervisor(recorder=fleet.recorder, hosts=hosts, groups={}, failover=fleet.failover,
                            placer=fleet.placer, trainer=fleet.trainer, control=None, waits=fleet.waits,
                            state=fleet.state, reports=[SimpleNamespace(mesh_name="dataset_9-0")])
    supervisor.scan()
    assert supervisor.unexplained != []
    supervisor.check_control_procs()  # nothing to ask: the report is dropped, the run goes on
    assert supervisor.unexplained == []
    supervisor.host_lost("a")
    assert [e["role"] for e in fleet.events("failure_detected")] == ["trainer"]
    assert fleet.trainer.noticed is not None and "host a of the trainer was lost" in fleet.trainer.noticed.reason


def test_the_next_staging_waits_for_the_last_ones_reads_and_takes_new_memory_after_one_that_failed():
    fleet, _ = _supervised()
    trainer, generators = fleet.trainer, fleet.groups["generator"]
    replicas = generators.replicas
    inboxes = [replica.inbox for replica in replicas]
    trainer.publish_weights(replicas, 1)
    trainer.publish_weights(replicas, 2)
    assert fetched(inboxes[0]) == fetched(inboxes[1]) == [(1, 0), (2, 0)]
    assert [read.publication for read in trainer.fetches.settled] == [1, 1], "publication 1's reads, settled before the 2nd"
    inboxes[1].fetch.call_one = lambda publication: Done(error=RuntimeError("the inbox's proc died"))
    trainer.publish_weights(replicas, 3)
    trainer.publish_weights(replicas, 4)
    trainer.publish_weights(replicas, 5)
    # publication 3's read by the dead inbox fails: 4 goes into new memory, and so does 5 (4's read failed too)
    assert trainer.actors.stage_weights.calls == [(True,), (True,), (True,), (False,), (False,)]
    assert [read.publication for read in trainer.fetches.settled] == [1, 1, 2, 2, 3, 4], \
        "the reads that ended are still counted"


def test_the_weight_reads_a_step_settles_are_one_metric_point_each_the_slowest_read() -> None:
    """A step settles reads more than once (its own publication's, then a replacement's catch-up, in the same publish):
    each went to the run as a point of its own at the same step, and the control plane kept the last and reported the
    others as telemetry dropped. The step's metrics take them once: the slowest read, one replica's bytes."""
    fleet, _ = _supervised()
    trainer, replicas = fleet.trainer, fleet.groups["generator"].replicas
    trainer.publish_weights(replicas, 1)
    trainer.publish_weights(replicas, 2)  # settles publication 1's two reads
    replicas[0].inbox.fetch.call_one = lambda publication: Done(Fetched(publication=publication, nbytes=4, seconds=2.5))
    trainer.publish_weights([replicas[0]], 3)  # a replacement's catch-up in the same step: settles 2's reads
    trainer.publish_weights(replicas, 4)  # settles 3's (2.5 s)
    assert trainer.fetches.figures() == {"weights/read_s": 2.5, "weights/read_bytes": 4.0}
    assert trainer.fetches.figures() == {}, "taken once"
    assert fleet.sink.series("weights/read_s") == [], "recorded with the step's metrics only"


def test_the_trainer_is_blamed_for_a_read_only_by_the_inbox_answering_unread_not_by_a_failures_text():
    """An inbox answers Unread when the ranks did not serve its read: the trainer's failure (hung). A fetch that raises
    is the replica's own failure, whatever its text says (before, the text was searched for the Unread message), and a
    read that ended is nobody's."""
    fleet, _ = _supervised()
    trainer, replicas = fleet.trainer, fleet.groups["generator"].replicas
    answers = {0: Done(Unread(publication=1, why=f"{UNREAD} within 2 s (TimeoutError)")),
               1: Done(error=RuntimeError(f"actor inbox failed: weight publication 1 {UNREAD}: its proc was killed"))}
    for replica in replicas:
        replica.inbox.fetch.call_one = lambda publication, i=replica.index: answers[i]
    trainer.publish_weights(replicas, 1)
    with pytest.raises(TrainerLost, match="the trainer ranks did not serve generator replica 0's read of weight "
                                          f"publication 1: {UNREAD} within 2 s") as lost:
        trainer.await_read(replicas[0], 1)
    assert lost.value.failure.hung
    trainer.await_read(replicas[1], 1)  # the request naming it fails on the replica: its failure to report
    replicas[0].failed = True
    trainer.await_read(replicas[0], 1)  # an Unread of a replica marked failed is the replica's too
    answers[1] = Done(Fetched(publication=2, nbytes=4, seconds=0.1))
    trainer.publish_weights(replicas, 2)
    assert trainer.actors.stage_weights.calls == [(True,), (False,)], "a read that gave up may still be reading"
    trainer.await_read(replicas[1], 2)
    assert fleet.events("failure_detected") == []


def test_a_read_that_hangs_is_waited_for_only_until_its_replica_is_marked_failed():
    fleet, _ = _supervised()
    trainer, replicas = fleet.trainer, fleet.groups["generator"].replicas
    hung = replicas[1]

    class Hangs:
        def get(self, timeout: float | None = None) -> None:
            hung.failed = True  # what the supervisor's tick does when the replica's failure is reported
            raise TimeoutError

    hung.inbox.fetch.call_one = lambda publication: Hangs()
    trainer.publish_weights(replicas, 1)
    start = time.monotonic()
    trainer.publish_weights(replicas, 2)
    assert time.monotonic() - start < 5, "not the call timeout (300 s)"
    assert trainer.actors.stage_weights.calls == [(True,), (False,)], "it may still be reading: new memory"


def test_a_report_of_the_current_trainer_mesh_fails_its_calls_at_once_where_pids_are_not_visible():
    """Remote workers (the fake hosts' pids are not this machine's): a trainer rank that dies on a host still up shows
    only in Monarch's report. It is the trainer's failure now, once; the next trainer call or check fails at once."""
    fleet, supervisor = _supervised()
    trainer = fleet.trainer
    fleet.state.step = 3
    trainer.check()  # nothing failed yet
    supervisor.reports.append(SimpleNamespace(mesh_name="trainer-0", text="rank 1: the process was killed"))
    supervisor.scan()
    detected = fleet.events("failure_detected")
    assert [(e["role"], e["step"], e["hung"]) for e in detected] == [("trainer", 4, False)]
    assert "a trainer process failed" in detected[0]["reason"] and supervisor.unexplained == []
    with pytest.raises(TrainerLost, match="a trainer process failed"):
        trainer.check()
    with pytest.raises(TrainerLost, match="a trainer process failed"):
        trainer.result(Done(error=TimeoutError()))  # a call that never answers
    supervisor.reports.append(SimpleNamespace(mesh_name="trainer-0", text="rank 0: the process was killed"))
    supervisor.scan()
    assert len(fleet.events("failure_detected")) == 1, "one failure, noticed once"
    trainer.stop()
    trainer.noticed = None  # recovered
    supervisor.reports.append(SimpleNamespace(mesh_name="trainer-0", text="rank 0: stopped"))
    supervisor.scan()
    assert len(fleet.events("failure_detected")) == 1, "a stopped mesh's late report is not a new failure"


def test_the_trainers_known_loss_is_one_failure_for_its_checks_and_one_reason_for_its_waits():
    """What the ranks are known lost with, in order: a lost host of theirs, a failure report, an operator's command's
    failed call (kept as it failed: hung). `failure()` (the checks between and during steps) gives it, `gone()` (the
    waits on the ranks) its reason."""
    fleet, supervisor = _supervised()
    trainer = fleet.trainer
    assert trainer.failure() is None and trainer.gone() is None
    in_command = CallFailed("no answer within 300 s\nrank 1 stopped answering", hung=True)
    trainer.lost(in_command)
    assert trainer.failure() is in_command and trainer.failure().hung
    assert trainer.gone() == "no answer within 300 s ... rank 1 stopped answering"
    supervisor.reports.append(SimpleNamespace(mesh_name="trainer-0", text="rank 0: the process was killed"))
    supervisor.scan()
    assert (trainer.failure().hung, str(trainer.failure())) == (False, trainer.reported)
    assert trainer.gone() == trainer.reported
    fleet.hosts.fail("a")
    supervisor.scan()
    assert (trainer.failure().hung, str(trainer.failure())) == (False, "host a of the trainer was lost")
    assert trainer.gone() == "host a of the trainer was lost"
    assert [e["role"] for e in fleet.events("failure_detected")] == ["trainer", "generator"], "noticed once"


def test_a_replacement_reading_the_weights_of_stopped_trainer_ranks_fails_as_the_trainers_and_is_tried_again():
    """A generator replica is replaced while the trainer's ranks are stopped: its inbox's read gives up
    (failover.weight_read_s). Before, the replacement's take_weights was awaited regardless (on real procs: failing at
    its own wait, blamed on the replacement); now it is the trainer's failure and the replacement waits for the
    trainer's restore."""
    fleet, supervisor = _supervised()
    fleet.state.step, fleet.state.policy_version = 4, 3
    generators = fleet.groups["generator"]
    unread = Done(Unread(publication=1, why=f"{UNREAD} within 150 s (TimeoutError)"))

    def inbox_of_stopped_ranks(procs: object, name: str) -> FakeActor:
        inbox = FakeActor(next(PIDS), name=name)
        inbox.fetch = type(inbox.pid)(None)
        inbox.fetch.call_one = lambda publication: unread
        return inbox

    generators.spawn_inbox = inbox_of_stopped_ranks
    supervisor.reports.append(SimpleNamespace(mesh_name=f"{generators.replicas[0].name}-0"))
    supervisor.scan()
    with pytest.raises(TrainerLost, match="the trainer ranks did not serve generator replica 0's read of weight "
                                          "publication 1") as lost:
        supervisor.repair()
    assert lost.value.failure.hung
    assert fleet.failover.pending_repairs() and fleet.events("replica_replaced") == []
    assert generators.replicas[0].failed, "still the failed one, replaced once the trainer is back"
