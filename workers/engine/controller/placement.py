"""Where a Monarch run's roles go: pure decisions over the placement config, the hosts that are up, the hosts
an operator drained and where the run's procs are now. No Monarch here: the controller's parts spawn what this
decides."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.engine.actors.calls import ProcFailure
from workers.engine.config import PlacementConfig
from workers.engine.fields import ConfigError, FieldError


class HostView(Protocol):
    """What placement reads of the run's hosts (`actors.hosts.Hosts`)."""

    @property
    def names(self) -> list[str]: ...

    @property
    def lost(self) -> set[str]: ...

    def alive(self, names: Iterable[str]) -> list[str]: ...


class PlacedReplica(Protocol):
    host: str
    role: str
    index: int


class RoleGroup(Protocol):
    """What placement reads of a role's replicas (`actors.replica_group.ReplicaGroup`)."""

    def live(self) -> Sequence[PlacedReplica]: ...

    def room(self, host: str, *, replacing: Any = None) -> float: ...

    def has_room(self, host: str, *, replacing: Any = None) -> bool: ...


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
    drained: set[str] = field(default_factory=set)  # hosts an operator drained: no new replicas go there

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
        """The hosts the trainer's ranks go to: the first of its hosts still there, undrained ones first."""
        candidates = self.hosts.alive(self.role_hosts("trainer"))
        if len(candidates) < self.trainer_host_count or not candidates:
            raise ProcFailure(f"the trainer needs {self.trainer_host_count} host(s) ({self.trainer_ranks} ranks, "
                              f"{self.ranks_per_host} per host): {', '.join(candidates) or 'none'} of "
                              f"{', '.join(self.role_hosts('trainer'))} (placement.trainer.hosts) left")
        undrained = [h for h in candidates if h not in self.drained]
        return [*undrained, *(h for h in candidates if h in self.drained)][:self.trainer_host_count]

    def trainer_move_refusal(self, *, draining: str) -> str | None:
        """Why the trainer cannot leave its hosts once `draining` is drained too (None: enough undrained hosts are up)."""
        drained = {*self.drained, draining}
        undrained = [h for h in self.hosts.alive(self.role_hosts("trainer")) if h not in drained]
        if len(undrained) >= self.trainer_host_count:
            return None
        return (f"no undrained host can take the trainer: it needs {self.trainer_host_count} host(s) "
                f"({self.trainer_ranks} ranks, {self.ranks_per_host} per host), undrained: {', '.join(undrained) or 'none'}")

    def replacement_host(self, replica: PlacedReplica) -> str:
        """Where a failed or moved replica's replacement goes: its host if still up, undrained and with room, else the
        least used of its role's hosts that are (a drained host only when no other has room)."""
        role_hosts = self.role_hosts(replica.role)
        alive = self.hosts.alive(role_hosts)
        if not alive:
            raise ProcFailure(f"{replica.role} replica {replica.index} has no host left: "
                              f"{', '.join(role_hosts)} (placement.{replica.role}.hosts) are lost")
        group = self.groups[replica.role]
        roomy = [h for h in alive if group.has_room(h, replacing=replica)]
        if not roomy:
            raise ProcFailure(f"{replica.role} replica {replica.index} has no host with room left on "
                              f"{', '.join(alive)} (placement.{replica.role}.procs_per_host / gpus_per_proc)")
        candidates = [h for h in roomy if h not in self.drained] or roomy
        if replica.host in candidates:
            return replica.host
        live = group.live()
        return min(candidates, key=lambda h: sum(r.host == h for r in live))

    def spare_host(self, role: str) -> str | None:
        """Where a role's warm spares start: its first host that is up, not drained and has room for them."""
        alive = [h for h in self.hosts.alive(self.role_hosts(role)) if self.groups[role].has_room(h)]
        return next((h for h in alive if h not in self.drained), alive[0] if alive else None)

    def add_refusal(self, role: str, host: str) -> str | None:
        """Why a new or moved replica of `role` may not go to `host`, or None when it may."""
        rule = getattr(self.placement, role)
        if rule.colocate_with is not None:
            return f"the {role} follows the {rule.colocate_with}'s hosts (placement.{role}.colocate_with)"
        known = list(rule.hosts) or self.hosts.names
        if host not in known:
            return f"unknown host {host!r}; hosts: {', '.join(known)}"
        if host in self.hosts.lost:
            return f"host {host!r} is lost"
        if host in self.drained:
            return f"host {host!r} is drained; undrain it first"
        if not self.groups[role].has_room(host):
            return (f"host {host!r} has no room for another {role} replica "
                    f"(placement.{role}.procs_per_host / gpus_per_proc)")
        return None

    def drain_destinations(self, role: str, host: str, *, count: int | None = None) -> list[str]:
        """Where the role's `count` replicas on `host` (None: those serving there now) go when it is drained: its other
        undrained hosts, round, each while it has room; ValueError when they do not all fit."""
        group = self.groups[role]
        moving = count if count is not None else sum(r.host == host for r in group.live())
        targets = [h for h in self.hosts.alive(self.role_hosts(role)) if h != host and h not in self.drained]
        room = {t: group.room(t) for t in targets}
        destinations: list[str] = []
        for i in range(moving):
            open_targets = [t for t in targets if room[t] >= 1]
            if not open_targets:
                raise ValueError(f"no other undrained host has room for {host!r}'s {moving} {role} "
                                 f"replica(s) (hosts {', '.join(targets) or 'none'}; "
                                 f"placement.{role}.procs_per_host / gpus_per_proc)")
            destinations.append(open_targets[i % len(open_targets)])
            room[destinations[-1]] -= 1
        return destinations
