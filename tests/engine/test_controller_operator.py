"""An operator's placement changes and load redirects over fake hosts: what moves where, what is refused and why,
and the events the run page draws from. The replica groups, their services and failover are the real ones."""

from __future__ import annotations

import re

import pytest

from tests.engine.fake_fleet import (Done, FakeHosts, Fleet, controller_parts, fails_to_spawn, fails_to_start,
                                     fake_group, fetched, grpo_config)
from tests.engine.test_refused_files import REFUSED_MODEL, _from_a_rank
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.operator import Operator
from workers.engine.controller.state import TrainerDrain
from workers.engine.controller.trainer import TrainerLost
from workers.engine.drills import DrillPlan
from workers.engine.config import load_config
from workers.engine.operations import parse_operation

GENERATOR = {"take_weights": 5}


def _operator(placement: str = "", *, generators=("a", "b"), per_host: int | None = None, spares: int = 0,
              workers: bool = True) -> tuple[Fleet, Operator]:
    config = grpo_config(placement)
    hosts = FakeHosts(["a", "b", "c"], workers=workers)
    groups = {"generator": fake_group("generator", hosts, list(generators), per_host=per_host, spares=spares, **GENERATOR),
              "reward": fake_group("reward", hosts, ["b"], spares=spares)}
    fleet = controller_parts(config, hosts, groups, trainer_hosts=["a"])
    fleet.state.policy_version = 5
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                          groups=groups, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    return fleet, Operator(config=config, placer=fleet.placer, hosts=hosts, groups=groups, supervisor=fleet.supervisor,
                           drills=drills, recorder=fleet.recorder, state=fleet.state, moves_trainer=False)


def command(kind: str, **payload) -> object:
    return parse_operation(kind, payload)


def test_an_added_replica_serves_at_the_current_weights_and_the_plan_shows_it():
    fleet, operator = _operator()
    result = operator.operate("placement_change", command("placement_change", action="add", role="generator", host="c"))
    assert result == {"action": "add", "role": "generator", "replica": 2, "host": "c",
                      "plan": {"0": "a", "1": "b", "2": "c"}}
    with pytest.raises(ValueError, match="generator replica 1 is already on host 'b'"):
        operator.change_placement(command("placement_change", action="move", role="generator", replica=1, host="b"))
    added = fleet.groups["generator"].replicas[2]
    assert added.version == 5 and fetched(added.inbox) == [(1, 5)]
    assert added.actor.take_weights.calls == [(1,)]
    event = fleet.events("placement_changed")[0]
    assert event["pids"] == added.pids and event["plan"] == result["plan"]


def test_a_moved_replica_starts_on_its_new_host_before_the_old_one_retires():
    fleet, operator = _operator()
    generators = fleet.groups["generator"]
    old = generators.replicas[1]
    old.outstanding = 1  # a request still in flight on it
    result = operator.change_placement(command("placement_change", action="move", role="generator", replica=1, host="c"))
    assert result["plan"] == {"0": "a", "1": "c"} and generators.replicas[1] is not old
    assert generators.retiring == [old] and not old.procs.stopped, "it finishes its request first"
    old.outstanding = 0
    generators.reap()
    assert old.procs.stopped and fleet.state.totals.migrations == 1


def test_placement_changes_are_refused_with_their_reason_and_nothing_moves():
    fleet, operator = _operator("generator: {procs_per_host: 1}", per_host=1)
    refusals = {
        "host 'a' has no room for another generator replica": dict(action="add", role="generator", host="a"),
        "this run has no reference (reference.enabled is false)": dict(action="add", role="reference", host="c"),
        "cannot remove the last serving reward replica": dict(action="remove", role="reward", replica=0),
        "generator replica 7 is not serving": dict(action="remove", role="generator", replica=7),
    }
    for reason, payload in refusals.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            operator.change_placement(command("placement_change", **payload))
    assert {str(r.index): r.host for r in fleet.groups["generator"].live()} == {"0": "a", "1": "b"}
    assert fleet.events("placement_changed") == []
    operator.change_placement(command("placement_change", action="remove", role="generator", replica=0))
    assert [r.index for r in fleet.groups["generator"].live()] == [1]


def test_draining_a_host_moves_every_movable_role_off_it_and_undrain_lets_replicas_back():
    fleet, operator = _operator(generators=("a", "b", "b"), spares=1)
    fleet.supervisor.warm_spares()
    assert [s.host for s in fleet.groups["generator"].spare_replicas()] == ["a"]
    result = operator.operate("load_redirect", command("load_redirect", action="drain", host="a"))
    assert result["moved"] == {"0": "b"} and result["plan"] == {"0": "b", "1": "b", "2": "b"}, "the first of b, c"
    assert fleet.placer.drained == {"a"}
    started, finished = fleet.events("redirect_started")[0], fleet.events("redirect_finished")[0]
    assert started["replicas"] == [0] and started["reward_replicas"] == []
    assert finished["moved"] == {"0": "b"} and finished["seconds"] >= 0
    assert [s.host for s in fleet.groups["generator"].spare_replicas()] == ["b"], "the drained host's spare went too"
    with pytest.raises(ValueError, match="host 'a' is drained; undrain it first"):
        operator.change_placement(command("placement_change", action="add", role="generator", host="a"))
    operator.redirect(command("load_redirect", action="undrain", host="a"))
    assert fleet.placer.drained == set() and fleet.events("redirect_finished")[-1]["action"] == "undrain"
    operator.change_placement(command("placement_change", action="add", role="generator", host="a"))


NOT_STARTED = {"dies": (RuntimeError("CUDA error: out of memory"), "did not start: RuntimeError: CUDA error: out of memory"),
               "refuses": (_from_a_rank(REFUSED_MODEL, "pid").error, f"did not start: {REFUSED_MODEL}")}


@pytest.mark.parametrize("fate", ["dies", "refuses"])
@pytest.mark.parametrize("action", ["add", "move"])
def test_a_replica_that_does_not_start_on_its_new_host_is_a_refusal_with_why_and_nothing_changes(action, fate):
    """Before, the replica's CallFailed escaped the operator ("did not start: ActorError: ..." with the actor's
    traceback); its model folder's refusal now names the field, as at the run's start."""
    fleet, operator = _operator()
    generators = fleet.groups["generator"]
    error, why = NOT_STARTED[fate]
    failed = fails_to_start(generators, error, on="c")
    before = list(generators.replicas)
    replica = {"add": 2, "move": 1}[action]
    payload = {"add": {}, "move": {"replica": 1}}[action]
    with pytest.raises(ValueError) as refused:
        operator.operate("placement_change", command("placement_change", action=action, role="generator", host="c",
                                                     **payload))
    assert str(refused.value) == f"generator replica {replica} on host 'c' {why}"
    assert generators.replicas == before and generators.service.routable() == [0, 1], "the old one still serves"
    assert generators.retiring == [] and fleet.state.totals.migrations == 0
    assert [procs.stopped for procs in failed] == [True], "the new replica's procs are stopped"
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1] == f"generator_{replica}_{generators.incarnations}"
    assert fleet.events("placement_changed") == []


@pytest.mark.parametrize("part", ["actor", "inbox"])
@pytest.mark.parametrize("action", ["add", "move"])
def test_a_replica_whose_actor_does_not_spawn_on_its_new_procs_is_a_refusal_its_procs_stopped_and_released(action,
                                                                                                            part):
    """The new replica's procs spawned on host c, then its actor (or weight inbox) did not. Before, that error was the
    command's (a raw "RuntimeError: ...") and the procs stayed up, their GPUs counted as taken for the rest of the
    run."""
    fleet, operator = _operator()
    generators = fleet.groups["generator"]
    failed = fails_to_spawn(generators, RuntimeError("the proc mesh failed as the actor was spawned on it"), part=part,
                            on="c")
    before = list(generators.replicas)
    replica = {"add": 2, "move": 1}[action]
    payload = {"add": {}, "move": {"replica": 1}}[action]
    with pytest.raises(ValueError) as refused:
        operator.operate("placement_change", command("placement_change", action=action, role="generator", host="c",
                                                     **payload))
    assert str(refused.value) == (f"generator replica {replica} on host 'c' did not start: RuntimeError: the proc mesh "
                                  "failed as the actor was spawned on it")
    assert generators.replicas == before and generators.service.routable() == [0, 1], "the old one still serves"
    assert [procs.stopped for procs in failed] == [True], "the new replica's procs are stopped"
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1] == f"generator_{replica}_{generators.incarnations}"
    assert fleet.events("placement_changed") == [] and fleet.state.totals.migrations == 0


def test_an_added_replica_whose_host_is_lost_as_it_spawns_there_is_a_refusal_with_why():
    """Before, the HostsUnreachable escaped the operator."""
    fleet, operator = _operator()

    def lost_as_it_spawns(**spawned):
        fleet.hosts.lost.add(spawned["host"])
        raise HostsUnreachable(f"host {spawned['host']} is lost")

    fleet.hosts.spawn_procs = lost_as_it_spawns
    with pytest.raises(ValueError, match=re.escape("generator replica 2 on host 'c' did not start: host c is lost")):
        operator.change_placement(command("placement_change", action="add", role="generator", host="c"))
    assert len(fleet.groups["generator"].replicas) == 2 and fleet.events("placement_changed") == []


def test_an_added_replica_that_fails_as_it_takes_the_weights_is_stopped_and_the_add_refused():
    """Before, the new replica's CallFailed escaped the operator and its procs were left running, out of routing."""
    fleet, operator = _operator()
    generators = fleet.groups["generator"]
    spawn_actor, spawned = generators.spawn_actor, []

    def failing_take_weights(procs, name):
        actor = spawn_actor(procs, name)
        spawned.append(procs)
        actor.take_weights.call_one = lambda publication: Done(error=RuntimeError("the proc died"))
        return actor

    generators.spawn_actor = failing_take_weights
    with pytest.raises(ValueError, match=re.escape("generator replica 2 on host 'c' did not take the current "
                                                   "weights: RuntimeError: the proc died")):
        operator.change_placement(command("placement_change", action="add", role="generator", host="c"))
    assert len(generators.replicas) == 2 and fleet.events("placement_changed") == []
    assert [procs.stopped for procs in spawned] == [True]
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1] == "generator_2_3"


RANKS_LOST = "RuntimeError: rank 0 is unreachable"
LOST_REFUSAL = ("the trainer was lost while {doing}: " + RANKS_LOST + "; the run recovers, and the command can be sent "
                "again then")


def _ranks_lost(fleet: Fleet, endpoint: str) -> None:
    """The trainer's ranks fail when `endpoint` is called (a rank that died, or whose host went, as the command ran)."""
    getattr(fleet.trainer.actors, endpoint).call = lambda *args: Done(error=RuntimeError("rank 0 is unreachable"))


def _lost_once_and_recovered_next(fleet: Fleet) -> None:
    """The trainer's loss is noticed once, as the trainer's, and the step loop's next check recovers it at once."""
    assert [(e["role"], e["reason"]) for e in fleet.events("failure_detected")] == [("trainer", RANKS_LOST)]
    with pytest.raises(TrainerLost, match=RANKS_LOST):
        fleet.trainer.check()


@pytest.mark.parametrize("action", ["add", "move"])
def test_a_trainer_lost_while_a_new_replica_takes_its_weights_refuses_the_command_saying_so_and_the_run_recovers(
        action):
    """The trainer's ranks fail as they stage the weights for the new generator replica. Before, the TrainerLost was
    the command's failure (the operator read the trainer's error as the command's), and the step loop found the loss
    only at its next trainer call (a hung rank: after failover.call_timeout_s). Now the command is refused saying the
    trainer was lost and the run recovers; the new replica's procs are stopped."""
    fleet, operator = _operator()
    generators = fleet.groups["generator"]
    before = list(generators.replicas)
    _ranks_lost(fleet, "stage_weights")
    replica = {"add": 2, "move": 1}[action]
    payload = {"add": {}, "move": {"replica": 1}}[action]
    with pytest.raises(ValueError) as refused:
        operator.operate("placement_change", command("placement_change", action=action, role="generator", host="c",
                                                     **payload))
    assert str(refused.value) == LOST_REFUSAL.format(doing=f"generator replica {replica} on host 'c' took the current "
                                                           "weights")
    assert generators.replicas == before and generators.service.routable() == [0, 1]
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1], "the new replica's procs are stopped"
    assert fleet.events("placement_changed") == []
    _lost_once_and_recovered_next(fleet)


def test_a_trainer_lost_while_a_drain_moves_a_replica_stops_the_drain_saying_so_and_the_run_recovers():
    fleet, operator = _operator(generators=("a", "b"))
    _ranks_lost(fleet, "stage_weights")
    with pytest.raises(ValueError) as refused:
        operator.operate("load_redirect", command("load_redirect", action="drain", host="b"))
    doing = "generator replica 1 on host 'a' took the current weights"
    refusal = (f"the drain of host 'b' stopped: {LOST_REFUSAL.format(doing=doing)}; nothing moved; host 'b' is not "
               "drained")
    assert str(refused.value) == refusal and [e["text"] for e in fleet.events("message")] == [refusal]
    assert fleet.placer.drained == set() and fleet.groups["generator"].service.routable() == [0, 1]
    _lost_once_and_recovered_next(fleet)


def test_a_trainer_lost_while_a_trainer_drill_is_aimed_refuses_the_drill_saying_so_and_the_run_recovers():
    fleet, operator = _operator()
    _ranks_lost(fleet, "pids")
    with pytest.raises(ValueError) as refused:
        operator.operate("fault_drill", parse_operation("fault_drill", {"kind": "raise", "role": "trainer",
                                                                        "replica": 0}))
    assert str(refused.value) == LOST_REFUSAL.format(doing="the fault drill ran")
    assert fleet.events("fault_injected") == []
    _lost_once_and_recovered_next(fleet)


def test_a_drain_whose_move_does_not_start_puts_the_rest_back_in_routing_and_leaves_the_host_undrained():
    """Host b's generator 1 moves to a; generator 2's new proc on c fails as it starts: the drain stops there. Before,
    its CallFailed escaped with generator 2 and the reward on b out of routing for good and b drained."""
    fleet, operator = _operator(generators=("a", "b", "b"))
    generators, rewards = fleet.groups["generator"], fleet.groups["reward"]
    failed = fails_to_start(generators, RuntimeError("CUDA error: out of memory"), on="c")
    staying = generators.replicas[2]
    with pytest.raises(ValueError) as refused:
        operator.operate("load_redirect", command("load_redirect", action="drain", host="b"))
    refusal = ("the drain of host 'b' stopped: generator replica 2 on host 'c' did not start: RuntimeError: CUDA error: "
               "out of memory; moved already: generator replica 1 to a; host 'b' is not drained")
    assert str(refused.value) == refusal
    assert [(r.index, r.host) for r in generators.live()] == [(0, "a"), (1, "a"), (2, "b")], "what moved stays moved"
    assert generators.replicas[2] is staying and [(r.index, r.host) for r in rewards.live()] == [(0, "b")]
    assert fleet.placer.drained == set() and fleet.state.totals.migrations == 1
    assert [procs.stopped for procs in failed] == [True] and fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1]
    assert [e["replicas"] for e in fleet.events("redirect_started")] == [[1, 2]]
    assert fleet.events("redirect_finished") == [], "the drain did not finish"
    assert [e["text"] for e in fleet.events("message")] == [refusal]
    result = operator.redirect(command("load_redirect", action="drain", host="b"))  # a drain again moves the rest
    assert result["moved"] == {"2": "a"} and result["moved_roles"] == {"reward": {"0": "a"}}
    assert fleet.placer.drained == {"b"}


def test_a_role_that_follows_the_generators_moves_with_them_and_one_that_follows_the_trainer_stays():
    fleet, operator = _operator("reward: {colocate_with: generator}", generators=("b", "c"))
    result = operator.redirect(command("load_redirect", action="drain", host="b"))
    assert result["moved"] == {"0": "a"}, "the generator's one undrained host with room, round"
    assert result["moved_roles"] == {"reward": {"0": "a"}}, "the reward follows the generators to their hosts now"
    assert [(r.index, r.host) for r in fleet.groups["reward"].live()] == [(0, "a")], "and serves there"
    fleet2, operator2 = _operator("reward: {colocate_with: trainer}", generators=("b", "c"))
    result2 = operator2.redirect(command("load_redirect", action="drain", host="b"))
    assert "moved_roles" not in result2 and fleet2.groups["reward"].replicas[0].host == "b"


def test_a_drain_that_does_not_fit_is_refused_before_anything_moves():
    fleet, operator = _operator("generator: {procs_per_host: 1}", per_host=1, generators=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"no other undrained host has room for 'a'\'s 1 generator replica"):
        operator.redirect(command("load_redirect", action="drain", host="a"))
    assert fleet.placer.drained == set() and fleet.events("redirect_started") == []
    with pytest.raises(ValueError, match="unknown host 'z'; hosts: a, b, c"):
        operator.redirect(command("load_redirect", action="drain", host="z"))


def test_without_workers_only_the_generators_host_labels_can_be_drained():
    fleet, operator = _operator("generator: {hosts: [a, b]}", workers=False)
    with pytest.raises(ValueError, match="unknown host 'c'; hosts: a, b"):
        operator.redirect(command("load_redirect", action="drain", host="c"))


def _sft_operator(host_names=("a", "b", "c")) -> tuple[Fleet, Operator]:
    """An SFT run's operator: two trainer ranks on host a, no replica groups."""
    config = load_config("recipe: sft\nmodel: {path: /m}\nplacement: {backend: monarch}\ntrainer: {ranks: 2}\n")
    hosts = FakeHosts(list(host_names), workers=True)
    fleet = controller_parts(config, hosts, {}, trainer_hosts=["a"], trainer_pids=(7, 8))
    drills = DrillTargets(plan=DrillPlan([]), injector=fleet.injector, recorder=fleet.recorder, hosts=hosts,
                          groups={}, placer=fleet.placer, trainer=fleet.trainer, state=fleet.state)
    return fleet, Operator(config=config, placer=fleet.placer, hosts=hosts, groups={}, supervisor=fleet.supervisor,
                           drills=drills, recorder=fleet.recorder, state=fleet.state, moves_trainer=True)


def test_an_sft_drain_of_the_trainers_host_moves_it_at_the_next_checkpoint_and_placement_changes_are_refused():
    fleet, operator = _sft_operator()
    with pytest.raises(ValueError, match="no generator replicas to place: an SFT run has only trainer ranks"):
        operator.operate("placement_change", command("placement_change", action="add", role="generator", host="b"))
    with pytest.raises(ValueError, match="host 'b' holds none of the trainer's ranks"):
        operator.operate("load_redirect", command("load_redirect", action="drain", host="b"))
    result = operator.operate("load_redirect", command("load_redirect", action="drain", host="a"))
    assert result["trainer_ranks"] == [0, 1] and result["moves_at"] == "the next checkpoint"
    assert fleet.state.trainer_drain == TrainerDrain(host="a", from_hosts=["a"]) and fleet.placer.drained == {"a"}
    assert fleet.placer.place_trainer() == ["b"], "the trainer's next hosts are undrained ones"
    assert fleet.events("redirect_started")[-1]["trainer_ranks"] == [0, 1]
    operator.operate("load_redirect", command("load_redirect", action="undrain", host="a"))
    assert fleet.state.trainer_drain is None and fleet.placer.drained == set()


def test_an_sft_drain_with_nowhere_to_go_is_refused():
    fleet, operator = _sft_operator(("a",))
    with pytest.raises(ValueError, match="no undrained host can take the trainer: it needs 1 host"):
        operator.operate("load_redirect", command("load_redirect", action="drain", host="a"))
    assert fleet.placer.drained == set() and fleet.state.trainer_drain is None


@pytest.mark.parametrize("ending", ["refused", "out_of_replacements"])
def test_an_error_the_run_cannot_go_on_from_fails_the_command_and_ends_the_run_after_the_steps_commands(
        ending, monkeypatch):
    """A warm spare refusing the model folder while a command waits (poll_spares, in the waits' tick), or a role out
    of its replacements: the page says the run ends. Before, the command channel took the error for the command's own
    failure and the run went on (until the next refusal). Now the command fails with it, the next command still runs
    (the channel reports every one), and the step loop's check after the commands ends the run with the error."""
    from workers.engine.actors.calls import ProcFailure
    from workers.engine.fields import ConfigError

    fleet, operator = _operator()
    error = {"refused": ConfigError.on("model.path", "config.json is not JSON"),
             "out_of_replacements": ProcFailure("reward replica 0 failed and the run has used its 3 replacements for "
                                                "reward (failover.max_replacements)")}[ending]

    def prepare(replica):  # noqa: ANN001, ANN202
        raise error

    monkeypatch.setattr(fleet.supervisor, "prepare", prepare)
    operator.raise_run_ending()  # nothing met yet
    with pytest.raises(ValueError) as failed:
        operator.operate("placement_change", command("placement_change", action="add", role="generator", host="c"))
    assert str(failed.value) == f"the run ends: {error}"
    assert fleet.hosts.released[-1] == fleet.hosts.spawned[-1][1], "the new replica's procs are stopped"
    moved = operator.operate("placement_change", command("placement_change", action="remove", role="generator",
                                                         replica=1))
    assert moved["plan"] == {"0": "a"}
    with pytest.raises(type(error)) as ended:
        operator.raise_run_ending()
    assert ended.value is error
