"""The Monarch controller's placement decisions, without Monarch: a fake set of hosts and replica groups."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from workers.engine.actors.fleet import ProcFailure
from workers.engine.config import load_config
from workers.engine.fields import ConfigError
from workers.engine.recipes.monarch_placement import Placer


@dataclass
class FakeHosts:
    names: list[str]
    lost: set[str] = field(default_factory=set)

    def alive(self, names: Iterable[str]) -> list[str]:
        return [name for name in names if name not in self.lost]


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
