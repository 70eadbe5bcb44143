"""An operator's commands to a running Monarch GRPO run: fault drills, placement changes (add, remove or move a
replica) and load redirects (drain a host, undrain it). Each returns the command's result or raises ValueError
with the reason it was refused (`run_control.py` reports either back)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from workers.engine.actors.calls import CallFailed, ProcFailure
from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.config import RunConfig
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.placement import Placer
from workers.engine.controller.roles import MOVABLE, role_group, role_plan, serving
from workers.engine.controller.state import RunState, TrainerDrain
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerLost
from workers.engine.fields import ConfigError
from workers.engine.metrics import Recorder
from workers.engine.operations import FaultDrillRequest, LoadRedirectRequest, Operation, PlacementChangeRequest


class Operator:
    """`moves_trainer`: a drain of a host with trainer ranks sends the trainer to undrained hosts at the next
    checkpoint (SFT: the trainer is all it has); otherwise the trainer stays and its replicas move (GRPO)."""

    def __init__(self, *, config: RunConfig, placer: Placer, hosts: Hosts, groups: Mapping[str, ReplicaGroup],
                 supervisor: Supervisor, drills: DrillTargets, recorder: Recorder, state: RunState, moves_trainer: bool):
        self.config, self.placer, self.hosts, self.groups = config, placer, hosts, groups
        self.supervisor, self.drills, self.recorder, self.state = supervisor, drills, recorder, state
        self.moves_trainer = moves_trainer
        self.run_ending: ConfigError | ProcFailure | None = None  # met by a command; StepEnd ends the run with it

    def operate(self, kind: str, operation: Operation) -> dict[str, Any]:
        """`RunControl.operator`: run one command between (or during) steps. A trainer lost meanwhile refuses it
        (`trainer_lost`). An error the run cannot go on from, met while it ran (a model folder a warm spare refused as
        the command waited, a role out of its replacements), fails the command with it and is kept for the step's end
        to end the run with (`raise_run_ending`, StepEnd's `run_ending`): the command channel takes whatever a command
        raises as the command's failure, and the run would go on."""
        try:
            if isinstance(operation, FaultDrillRequest):
                return self.drills.schedule(operation)
            if isinstance(operation, PlacementChangeRequest):
                return self.change_placement(operation)
            return self.redirect(operation)
        except TrainerLost as lost:
            raise self.trainer_lost(lost, doing=f"the {kind.replace('_', ' ')} ran") from None
        except (ConfigError, ProcFailure) as ending:
            self.run_ending = self.run_ending or ending
            raise ValueError(f"the run ends: {ending}") from None

    def raise_run_ending(self) -> None:
        """After the step's commands (`StepEnd.after`): end the run with the error one of them met (`operate`), if
        any."""
        if self.run_ending is not None:
            raise self.run_ending

    def trainer_lost(self, lost: TrainerLost, *, doing: str) -> ValueError:
        """The refusal of a command whose call to the trainer found it lost (a trainer drill's, a new generator's
        weights): the trainer failed, not the command. Its loss is noticed now and the step loop recovers it at its next
        check (`TrainerHandle.lost`). Refused, not run again after the recovery: commands run at most once, and the run
        it was sent to is then back at its last checkpoint (or its start): the operator sends it again if it still
        fits."""
        self.supervisor.trainer.lost(lost.failure)
        return ValueError(f"the trainer was lost while {doing}: {lost.failure.reason}; the run recovers, and the "
                          "command can be sent again then")

    # --- placement changes --------------------------------------------------------------
    def change_placement(self, change: PlacementChangeRequest) -> dict[str, Any]:
        started = time.monotonic()
        group = role_group(self.groups, change.role)
        if change.action == "add":
            self._check_host(change.role, change.host)
            replica_index = group.service.add(self.start_replica(group, len(group.replicas), change.host))
        elif change.action == "remove":
            replica = serving(self.groups, change.role, change.replica)
            if len(group.live()) == 1:
                raise ValueError(f"cannot remove the last serving {change.role} replica")
            group.service.set_available(replica.index, False)
            group.retire(replica)
            replica_index = replica.index
        else:
            replica = serving(self.groups, change.role, change.replica)
            self._check_host(change.role, change.host)
            if replica.host == change.host:
                raise ValueError(f"{change.role} replica {replica.index} is already on host {change.host!r}")
            self.move(group, replica, change.host)
            replica_index = replica.index
        result = {"action": change.action, "role": change.role, "replica": replica_index, "host": change.host,
                  "plan": role_plan(self.groups, change.role)}
        self.recorder.event("placement_changed", step=self.state.step, seconds=round(time.monotonic() - started, 3),
                            pids=group.replicas[replica_index].pids, **result)
        return result

    def _check_host(self, role: str, host: str) -> None:
        refusal = self.placer.add_refusal(role, host)
        if refusal is not None:
            raise ValueError(refusal)

    def start_replica(self, group: ReplicaGroup, index: int, host: str) -> Replica:
        """A new replica of the group's role on `host`, ready to serve (a generator at the current weights). ValueError
        with why when it does not start (the model folder it refused: that field's error) or fails as it takes the
        weights, or the trainer is lost meanwhile (`trainer_lost`); its procs are stopped and its GPUs released either
        way."""
        try:
            new = group.spawn(index, host)  # stops its procs when it does not start
        except CallFailed as failure:
            why = f"did not start: {failure.refused}" if failure.refused else failure.reason
            raise ValueError(f"{group.role} replica {index} on host {host!r} {why}") from None
        except HostsUnreachable as lost:
            raise ValueError(f"{group.role} replica {index} on host {host!r} did not start: {lost}") from None
        try:
            new.version = self.supervisor.prepare(new)
        except BaseException as error:
            group.stop(new)
            if isinstance(error, CallFailed):
                raise ValueError(f"{group.role} replica {index} on host {host!r} did not take the current weights: "
                                 f"{error.reason}") from None
            if isinstance(error, TrainerLost):
                raise self.trainer_lost(error, doing=f"{group.role} replica {index} on host {host!r} took the current "
                                                     "weights") from None
            raise
        return new

    def move(self, group: ReplicaGroup, replica: Replica, host: str) -> None:
        """Start the replica again on `host`; the old one stops once its requests are done."""
        group.service.replace(replica.index, self.start_replica(group, replica.index, host))
        group.retire(replica)
        self.state.totals.migrations += 1

    # --- redirects ----------------------------------------------------------------------
    def redirect(self, command: LoadRedirectRequest) -> dict[str, Any]:
        host, placement, groups = command.host, self.config.placement, self.groups
        # without workers only generators have hosts
        known = self.hosts.names if self.hosts.workers else list(placement.generator.hosts) or self.hosts.names
        if host not in known:
            raise ValueError(f"unknown host {host!r}; hosts: {', '.join(known)}")
        plan = role_plan(groups, "generator") if "generator" in groups else {}
        if command.action == "undrain":
            self.placer.drained.discard(host)
            if self.state.trainer_drain is not None and self.state.trainer_drain.host == host:
                self.state.trainer_drain = None
            self.recorder.event("redirect_finished", step=self.state.step, action="undrain", host=host, moved={},
                                plan=plan)
            return {"host": host, "plan": plan}
        if self.moves_trainer:
            return self.drain_trainer(host)
        # roles that follow the trainer stay with it; a role that follows the generators goes where they went
        roles = [role for role in MOVABLE if role in groups
                 and getattr(placement, role).colocate_with in (None, "generator")]
        moving = {role: [r for r in groups[role].live() if r.host == host] for role in roles}
        first = {role: self.placer.drain_destinations(role, host) for role in roles
                 if getattr(placement, role).colocate_with is None}  # checked before anything moves
        started = time.monotonic()
        self.placer.drained.add(host)
        self.recorder.event("redirect_started", step=self.state.step, action="drain", host=host,
                            replicas=[r.index for r in moving.get("generator", [])],
                            **{f"{role}_replicas": [r.index for r in moving[role]] for role in roles if role != "generator"})
        for role in roles:  # stop routing to the host at once; replacements come up one by one
            for replica in moving[role]:
                groups[role].service.set_available(replica.index, False)
        spares_dropped = sum(group.drop_spares_on(host) for group in groups.values())
        moved: dict[str, dict[str, str]] = {}
        try:
            for role in roles:
                destinations = first[role] if role in first else \
                    self.placer.drain_destinations(role, host, count=len(moving[role]))  # where the generators went
                for replica, target in zip(moving[role], destinations):
                    self.move(groups[role], replica, target)
                    moved.setdefault(role, {})[str(replica.index)] = target
        except BaseException as error:  # a replica's new proc did not start (`start_replica`): nothing more moves
            refusal = self.drain_stopped(host, moving, moved, why=str(error))
            if isinstance(error, ValueError):
                raise ValueError(refusal) from None
            raise
        finally:
            if spares_dropped:
                self.supervisor.warm_spares()  # after the moves: a spare must not take a moving replica's room
        others = {role: plan for role, plan in moved.items() if role != "generator"}
        plan = role_plan(groups, "generator") if "generator" in groups else {}
        self.recorder.event("redirect_finished", step=self.state.step, action="drain", host=host,
                            moved=moved.get("generator", {}), plan=plan,
                            seconds=round(time.monotonic() - started, 3), **({"moved_roles": others} if others else {}))
        return {"host": host, "moved": moved.get("generator", {}), "plan": plan,
                **({"moved_roles": others} if others else {})}

    def drain_stopped(self, host: str, moving: Mapping[str, list[Replica]], moved: Mapping[str, Mapping[str, str]], *,
                      why: str) -> str:
        """A drain refused midway, as a move's new replica did not start: the replicas it took out of routing and did
        not move serve again on `host` (they are healthy there), and the host is not drained (a refused command leaves
        it as it was: a drain again moves the rest); those moved already stay where they went. No redirect_finished:
        the run page is told what moved and what did not. The refusal."""
        for role, replicas in moving.items():
            group = self.groups[role]
            for replica in replicas:
                if group.replicas[replica.index] is replica and not replica.failed:
                    group.service.set_available(replica.index, True)
        self.placer.drained.discard(host)
        done = [f"{role} replica {index} to {target}" for role, went in moved.items() for index, target in went.items()]
        refusal = (f"the drain of host {host!r} stopped: {why}; "
                   f"{'moved already: ' + ', '.join(done) if done else 'nothing moved'}; host {host!r} is not drained")
        self.recorder.event("message", step=self.state.step, text=refusal)
        return refusal

    def drain_trainer(self, host: str) -> dict[str, Any]:
        """A run whose only role is its trainer: refuse now if no undrained hosts could take it, else it moves at the
        next checkpoint (`recovery.TrainerRecovery.move_trainer`), where its state is saved anyway."""
        placer = self.placer
        ranks = [rank for rank in range(placer.trainer_ranks) if placer.rank_host(rank) == host]
        if not ranks:
            raise ValueError(f"host {host!r} holds none of the trainer's ranks (they are on "
                             f"{', '.join(placer.trainer_hosts)})")
        if (refusal := placer.trainer_move_refusal(draining=host)) is not None:
            raise ValueError(refusal)
        placer.drained.add(host)
        self.state.trainer_drain = TrainerDrain(host=host, from_hosts=list(placer.trainer_hosts))
        self.recorder.event("redirect_started", step=self.state.step, action="drain", host=host, replicas=[],
                            trainer_ranks=ranks, moves_at="the next checkpoint")
        return {"host": host, "moved": {}, "plan": {}, "trainer_ranks": ranks, "moves_at": "the next checkpoint"}
