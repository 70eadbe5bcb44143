"""An operator's placement changes and load redirects over fake hosts: what moves where, what is refused and why,
and the events the run page draws from. The replica groups, their services and failover are the real ones."""

from __future__ import annotations

import re

import pytest

from tests.engine.fake_fleet import FakeHosts, Fleet, controller_parts, fake_group, fetched, grpo_config
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.operator import Operator
from workers.engine.controller.state import TrainerDrain
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
