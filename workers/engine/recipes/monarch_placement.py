"""Where a Monarch GRPO run's roles go: pure decisions over the placement config, the hosts that are up and
where the run's procs are now. No Monarch here: the controller (`grpo_monarch.py`) spawns what this decides."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.actors.fleet import ProcFailure
from workers.engine.config import PlacementConfig
from workers.engine.fields import ConfigError, FieldError


class HostView(Protocol):
    """What placement reads of the run's hosts (`actors.hosts.Hosts`)."""

    @property
    def names(self) -> list[str]: ...

    def alive(self, names: Iterable[str]) -> list[str]: ...


class PlacedReplica(Protocol):
    host: str


class RoleGroup(Protocol):
    """What placement reads of a role's replicas (`actors.fleet.ReplicaGroup`)."""

    def live(self) -> Iterable[PlacedReplica]: ...


@dataclass
class Placer:
    """The placement decisions of one run. `trainer_hosts` is where the trainer's ranks are now (set by the
    controller from `place_trainer`); `groups` are the run's replica groups, filled in as they start."""

    placement: PlacementConfig
    hosts: HostView
    device: str  # the device of a role without GPUs of its own (trainer.device)
    trainer_ranks: int
    ranks_per_host: int
    groups: Mapping[str, RoleGroup] = field(default_factory=dict)
    trainer_hosts: list[str] = field(default_factory=list)

    @property
    def trainer_host_count(self) -> int:
        return self.trainer_ranks // self.ranks_per_host

    def role_hosts(self, role: str) -> list[str]:
        """Where a role's procs may go: the host of the role it follows (colocate_with) while that host is up, else
        placement.<role>.hosts, else every host."""
        rule = getattr(self.placement, role)
        if rule.colocate_with is not None and self.hosts.alive(followed := self.colocated_hosts(rule.colocate_with)):
            return followed
        return list(rule.hosts) or self.hosts.names

    def colocated_hosts(self, role: str) -> list[str]:
        if role == "trainer":
            return list(self.trainer_hosts)
        group = self.groups.get(role)
        return list(dict.fromkeys(replica.host for replica in group.live())) if group is not None else []

    def role_device(self, role: str) -> str:
        return "cuda" if getattr(self.placement, role).gpus_per_proc else self.device

    def layout(self, role: str, count: int) -> list[str]:
        """Hosts of a role's first `count` replicas: round its hosts, or with procs_per_host, each host filled in turn."""
        names, per_host = self.role_hosts(role), getattr(self.placement, role).procs_per_host
        if per_host is None:
            return [names[i % len(names)] for i in range(count)]
        if count > per_host * len(names):
            raise ConfigError([FieldError(f"placement.{role}.procs_per_host",
                                          f"{count} {role} replicas do not fit {len(names)} host(s) at {per_host} each")])
        return [names[i // per_host] for i in range(count)]

    def rank_host(self, rank: int) -> str:
        return self.trainer_hosts[rank // self.ranks_per_host]

    def place_trainer(self) -> list[str]:
        """The hosts the trainer's ranks go to: the first of its hosts still there."""
        candidates = self.hosts.alive(self.role_hosts("trainer"))
        if len(candidates) < self.trainer_host_count or not candidates:
            raise ProcFailure(f"the trainer needs {self.trainer_host_count} host(s) ({self.trainer_ranks} ranks, "
                              f"{self.ranks_per_host} per host): {', '.join(candidates) or 'none'} of "
                              f"{', '.join(self.role_hosts('trainer'))} (placement.trainer.hosts) left")
        return candidates[:self.trainer_host_count]
