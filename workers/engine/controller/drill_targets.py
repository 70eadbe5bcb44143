"""Which process, host and replica of a Monarch GRPO run a fault drill hits, and when the planned ones are due."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from workers.engine.actors.replica_group import ReplicaGroup
from workers.engine.actors.hosts import Hosts, HostsUnreachable
from workers.engine.controller.placement import Placer
from workers.engine.controller.roles import serving
from workers.engine.controller.state import RunState
from workers.engine.controller.trainer import TrainerHandle
from workers.engine.drills import SIGNAL_KINDS, DrillPlan, FaultInjector, FaultTarget
from workers.engine.metrics import Recorder
from workers.engine.operations import FaultDrillRequest

ARM_TIMEOUT_S = 10.0  # arming a fault waits for the target's current call to end
TIMED_ROLES = ("generator", "reward", "reference")  # drilled while the controller waits (not the trainer)


class ReplicaBeingReplaced(ValueError):
    """A drill's replica failed and its replacement does not serve yet: a planned drill waits for it (`inject_due`), an
    operator's immediate one is refused with this reason."""

    def __init__(self, role: str, index: int, serving: list[int]):
        super().__init__(f"{role} replica {index} is being replaced (it failed and its replacement does not serve yet); "
                         f"the drill can be sent again once it serves; serving replicas: {serving}")
        self.role, self.index = role, index


class DrillTargets:
    def __init__(self, *, plan: DrillPlan, injector: FaultInjector, recorder: Recorder, hosts: Hosts,
                 groups: Mapping[str, ReplicaGroup], placer: Placer, trainer: TrainerHandle, state: RunState):
        self.plan, self.injector, self.recorder, self.hosts = plan, injector, recorder, hosts
        self.groups, self.placer, self.trainer, self.state = groups, placer, trainer, state
        self.told_deferred: list[FaultDrillRequest] = []  # deferred drills the run page was told of, until they run

    def target(self, request: FaultDrillRequest) -> FaultTarget:
        """What a drill acts on; ValueError (the command's reason) for a role or replica this run lacks, and
        ReplicaBeingReplaced (a ValueError) for a replica whose replacement does not serve yet."""
        target = self._in_actor_target(request)
        if request.kind in SIGNAL_KINDS:
            host = self.host_of(request.role, request.replica)
            try:
                target.signals = self.hosts.signals(host)  # an agent on the target's host, with workers
            except HostsUnreachable as error:
                raise ValueError(f"{request.role} replica {request.replica}'s host cannot be signalled: {error}") from None
            if request.kind == "slow_host":  # the whole host: every process of the run there
                target.pids = list(dict.fromkeys([*target.pids, *self.run_pids_on(host)]))
        return target

    def host_of(self, role: str, index: int) -> str:
        if role == "trainer":
            return self.placer.rank_host(index)
        return self.groups[role].replicas[index].host

    def run_pids_on(self, host: str) -> list[int]:
        """The run's trainer ranks and replicas (spares, retiring ones and replacements too) on `host`.

        A replacement's or a spare's pid is known once its model has loaded (its actor's pid call answers after the
        constructor; `ReplicaGroup.started` sets it): from then on, as a replacement takes the current weights, it is
        hit; one still loading has no pid yet, and is not."""
        pids = [pid for rank, pid in enumerate(self.trainer.pids) if self.placer.rank_host(rank) == host]
        for group in self.groups.values():
            for replica in [*group.replicas, *group.retiring, *group.spare_replicas(), *group.replacing]:
                if replica.host == host:
                    pids.extend(replica.pids)
        return pids

    def _in_actor_target(self, request: FaultDrillRequest) -> FaultTarget:
        if request.role == "trainer":
            ranks = self.placer.trainer_ranks
            if request.replica >= ranks:
                raise ValueError(f"trainer has ranks 0..{ranks - 1}, not {request.replica}")
            trainer = self.trainer
            pids = list(trainer.result(trainer.actors.pids.call()).values())
            rank = trainer.rank(request.replica)

            def arm_trainer(kind: str, **fields: Any) -> None:
                # a raise on one rank would leave the others blocked in the gradient all-reduce: raise on all
                (trainer.actors if kind == "raise" else rank).inject_fault.call(kind, **fields).get(timeout=ARM_TIMEOUT_S)

            return FaultTarget("trainer", request.replica, [pids[request.replica]], arm_trainer)
        self._check_not_replaced(request.role, request.replica)
        replica = serving(self.groups, request.role, request.replica)
        return FaultTarget(request.role, replica.index, replica.pids,
                           lambda kind, **fields: replica.actor.inject_fault.call_one(kind, **fields).get(timeout=ARM_TIMEOUT_S))

    def _check_not_replaced(self, role: str, index: int) -> None:
        group = self.groups.get(role)
        # a failed replica stays replica `index` until its replacement serves (Failover.repair)
        if group is not None and 0 <= index < len(group.replicas) and group.replicas[index].failed:
            raise ReplicaBeingReplaced(role, index, [r.index for r in group.live()])

    def run(self, request: FaultDrillRequest) -> dict[str, Any]:
        fault = self.injector.inject(request, self.target(request), step=self.state.step + 1)
        return {"fault_id": fault.id, "pids": fault.pids}

    def schedule(self, request: FaultDrillRequest) -> dict[str, Any]:
        """An operator's drill: run now, or planned for its schedule (refused now when its target does not exist; one
        being replaced exists)."""
        if request.schedule is None:
            return self.run(request)
        try:
            self.target(request)
        except ReplicaBeingReplaced:
            pass  # deferred when due, if it is still being replaced then
        self.plan.add(request, now=time.monotonic())
        return {"scheduled": request.schedule.model_dump(exclude_none=True)}

    def inject_due(self, *, timed_only: bool = False) -> None:
        """Inject the drills due now; `timed_only` (while waiting): every_s and random ones, not trainer drills. One whose
        replica is being replaced is deferred: due at each later check until the replica serves (the run page told
        once); one whose target the run lacks is not run."""
        roles = TIMED_ROLES if timed_only else None
        for request in self.plan.due(step=self.state.step + 1, now=time.monotonic(), roles=roles, timed_only=timed_only):
            try:
                self.run(request)
            except ReplicaBeingReplaced as replaced:
                self.plan.defer(request)
                if not any(told is request for told in self.told_deferred):
                    self.told_deferred.append(request)
                    self.recorder.event("message", step=self.state.step, text=(
                        f"fault drill deferred: {replaced.role} replica {replaced.index} is being replaced; it runs once "
                        "the replica serves"))
                continue
            except (ValueError, TimeoutError) as error:
                self.recorder.event("message", step=self.state.step, text=f"fault drill not run: {error}")
            self.told_deferred = [told for told in self.told_deferred if told is not request]


def measure_replica(groups: Mapping[str, ReplicaGroup], role: str, replica: int) -> dict[str, float]:
    """A replica's recent seconds per request and requests served: how a latency or slowdown fault shows."""
    group = groups.get(role)
    if group is None or group.service is None or replica >= len(group.replicas):
        return {}
    seconds = group.service.seconds_per_request[replica]
    return {"requests_served": group.service.served[replica],
            **({"seconds_per_request": round(seconds, 4)} if seconds is not None else {})}
