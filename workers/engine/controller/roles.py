"""Looking up a run's replica groups by role, with the reasons an operator's command names when one is missing."""

from __future__ import annotations

from collections.abc import Mapping

from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.config import IN_TRAINER

MOVABLE = ("generator", "reward", "reference")  # in this order: a role may follow the generators' hosts


def role_group(groups: Mapping[str, ReplicaGroup], role: str) -> ReplicaGroup:
    if not groups:
        raise ValueError(f"this run has no {role} replicas to place: an SFT run has only trainer ranks (drain a host to "
                         "move them; drills target them)")
    if role not in groups:
        raise ValueError(f"this run has no {role} (reference.enabled is false)" if role != "generator" else
                         f"{IN_TRAINER}: it has no replicas of its own; place, drain or drill the trainer")
    return groups[role]


def serving(groups: Mapping[str, ReplicaGroup], role: str, index: int) -> Replica:
    live = [r.index for r in role_group(groups, role).live()]
    if index not in live:
        raise ValueError(f"{role} replica {index} is not serving; serving replicas: {live}")
    return groups[role].replicas[index]


def role_plan(groups: Mapping[str, ReplicaGroup], role: str) -> dict[str, str]:
    """Replica index -> host of the role's serving replicas."""
    return {str(r.index): r.host for r in groups[role].live()}
