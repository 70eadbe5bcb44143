"""The Monarch controller's placement decisions, without Monarch: a fake set of hosts and replica groups."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tests.engine.fake_fleet import FakeHosts, fake_group
from workers.engine.actors.calls import ProcFailure
from workers.engine.config import load_config
from workers.engine.controller.placement import Placer
from workers.engine.fields import ConfigError


@dataclass
class FakeGroup:
    hosts: list[str]

    def live(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(host=host) for host in self.hosts]


def _placer(placement: str, *, hosts: list[str], ranks: int = 1, per_host: int | None = None, **kw) -> Placer:
    config = load_config(f"recipe: grpo\nmodel: {{path: /m}}\ntrainer: {{ranks: {ranks}}}\n"
                         f"placement: {{backend: monarch, {placement}}}\n")
    return Placer(placement=config.placement, hosts=FakeHosts(hosts), device="cpu", trainer_ranks=ranks,
                  ranks_per_host=per_host or ranks, **kw)


def test_a_role_goes_to_its_hosts_else_every_host():
    placer = _placer("generator: {hosts: [b, c]}", hosts=["a", "b", "c"])
    assert placer.role_hosts("generator") == ["b", "c"]
    assert placer.role_hosts("reward") == ["a", "b", "c"]


def test_replicas_go_round_their_hosts_or_fill_each_host_in_turn():
    assert _placer("generator: {hosts: [a, b]}", hosts=["a", "b"]).layout("generator", 3) == ["a", "b", "a"]
    packed = _placer("generator: {hosts: [a, b], procs_per_host: 2}", hosts=["a", "b"])
    assert packed.layout("generator", 3) == ["a", "a", "b"]
    with pytest.raises(ConfigError) as refused:
        packed.layout("generator", 5)
    assert refused.value.errors[0].field == "placement.generator.procs_per_host"
    assert "5 generator replicas do not fit 2 host(s) at 2 each" in refused.value.errors[0].message


def test_a_colocated_role_follows_the_role_while_its_host_is_up():
    groups = {"generator": FakeGroup(["b", "b", "c"])}
    placer = _placer("reward: {colocate_with: generator}", hosts=["a", "b", "c"], groups=groups)
    assert placer.role_hosts("reward") == ["b", "c"], "the generators' hosts, once each"
    placer.hosts.lost.update({"b", "c"})
    assert placer.role_hosts("reward") == ["a", "b", "c"], "any host once the followed ones are gone"
    follows_trainer = _placer("reference: {colocate_with: trainer}", hosts=["a", "b"])
    follows_trainer.trainer_hosts = ["b"]
    assert follows_trainer.role_hosts("reference") == ["b"]


def test_the_trainer_takes_the_first_hosts_still_up_and_ranks_fill_them_in_turn():
    placer = _placer("trainer: {hosts: [a, b, c], procs_per_host: 2}", hosts=["a", "b", "c"], ranks=4, per_host=2)
    assert placer.trainer_host_count == 2
    placer.hosts.lost.add("a")
    placer.trainer_hosts = placer.place_trainer()
    assert placer.trainer_hosts == ["b", "c"]
    assert [placer.rank_host(rank) for rank in range(4)] == ["b", "b", "c", "c"]
    placer.hosts.lost.add("b")
    with pytest.raises(ProcFailure, match=r"needs 2 host\(s\) \(4 ranks, 2 per host\): c of a, b, c"):
        placer.place_trainer()


def test_a_role_with_gpus_of_its_own_runs_on_cuda_the_rest_on_the_trainer_device():
    placer = _placer("generator: {gpus_per_proc: 1}", hosts=["a"])
    assert (placer.role_device("generator"), placer.role_device("reward")) == ("cuda", "cpu")


# --- replacements, spares, moves and drains over the real replica groups on fake hosts ------------------------


def _fleet_placer(placement: str, hosts: FakeHosts, groups: dict) -> Placer:
    config = load_config(f"recipe: grpo\nmodel: {{path: /m}}\nplacement: {{backend: monarch, {placement}}}\n")
    return Placer(placement=config.placement, hosts=hosts, device="cpu", trainer_ranks=1, ranks_per_host=1,
                  groups=groups, trainer_hosts=["a"])


def test_a_replacement_stays_on_its_host_while_it_is_up_undrained_and_has_room():
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b", "b"])}
    placer = _fleet_placer("", hosts, groups)
    first = groups["generator"].replicas[0]
    assert placer.replacement_host(first) == "a"
    hosts.lost.add("a")
    assert placer.replacement_host(first) == "c", "the least used of the hosts still up"
    placer.drained.add("c")
    assert placer.replacement_host(first) == "b", "a drained host takes no replacement while another can"
    hosts.lost.add("b")
    assert placer.replacement_host(first) == "c", "...but one on a drained host is better than none"
    hosts.lost.add("c")
    with pytest.raises(ProcFailure, match=r"generator replica 0 has no host left: a, b, c"):
        placer.replacement_host(first)


def test_a_replacement_needs_room_under_procs_per_host():
    hosts = FakeHosts(["a", "b"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b"], per_host=1)}
    placer = _fleet_placer("generator: {procs_per_host: 1}", hosts, groups)
    second = groups["generator"].replicas[1]
    hosts.lost.add("b")
    with pytest.raises(ProcFailure, match=r"generator replica 1 has no host with room left on a"):
        placer.replacement_host(second)
    first = groups["generator"].replicas[0]
    assert placer.replacement_host(first) == "a", "its own place counts as free"


def test_spares_start_on_the_first_undrained_host_with_room():
    hosts = FakeHosts(["a", "b"])
    groups = {"reward": fake_group("reward", hosts, ["a"], per_host=1)}
    placer = _fleet_placer("reward: {procs_per_host: 1}", hosts, groups)
    assert placer.spare_host("reward") == "b", "a is full"
    placer.drained.add("b")
    assert placer.spare_host("reward") == "b", "a drained host when it is the only one with room"
    hosts.lost.add("b")
    assert placer.spare_host("reward") is None


def test_an_added_or_moved_replica_is_refused_with_its_reason():
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "b"], per_host=1),
              "reward": fake_group("reward", hosts, ["a"])}
    placer = _fleet_placer("generator: {hosts: [a, b, c], procs_per_host: 1}, reward: {colocate_with: generator}",
                           hosts, groups)
    assert placer.add_refusal("generator", "c") is None
    assert placer.add_refusal("generator", "z") == "unknown host 'z'; hosts: a, b, c"
    assert placer.add_refusal("generator", "a") == ("host 'a' has no room for another generator replica "
                                                    "(placement.generator.procs_per_host / gpus_per_proc)")
    assert placer.add_refusal("reward", "c") == "the reward follows the generator's hosts (placement.reward.colocate_with)"
    placer.drained.add("c")
    assert placer.add_refusal("generator", "c") == "host 'c' is drained; undrain it first"
    hosts.lost.add("c")
    assert placer.add_refusal("generator", "c") == "host 'c' is lost"


def test_a_drained_hosts_replicas_go_round_the_other_hosts_while_they_have_room():
    hosts = FakeHosts(["a", "b", "c"])
    groups = {"generator": fake_group("generator", hosts, ["a", "a", "a", "b"], per_host=3)}
    placer = _fleet_placer("generator: {procs_per_host: 3}", hosts, groups)
    assert placer.drain_destinations("generator", "a") == ["b", "c", "b"]
    hosts.lost.add("c")
    with pytest.raises(ValueError, match=r"no other undrained host has room for 'a'\'s 3 generator replica\(s\) \(hosts b;"):
        placer.drain_destinations("generator", "a")
    assert placer.drain_destinations("generator", "c") == [], "nothing of the role there"


def test_device_auto_means_the_same_device_for_every_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer rank resolves trainer.device in its proc (`resolve_device`); the generator and reference procs the
    device the placer hands them, the same way."""
    import torch

    from workers.engine.drills import DrillPlan
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.grpo_monarch import MonarchGrpoRun
    from workers.engine.training import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = load_config("recipe: grpo\nmodel: {path: /m}\nreference: {enabled: true}\nplacement: {backend: monarch}\n")
    run = MonarchGrpoRun(config, Recorder(), hosts=FakeHosts(["a"]), plan=DrillPlan([]), control=None, fault_reports=[])
    trainer = resolve_device(config.trainer.device)
    assert trainer.type == "cuda"
    assert [resolve_device(run.placer.role_device(role)) for role in ("generator", "reference")] == [trainer, trainer]
