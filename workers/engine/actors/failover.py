"""What happens when a replica of a role (`replica_group.py`) fails: detection, replacement, recovery.

`Failover` turns failures into events and replacements:
  detect   a call failed (`calls.py`: Monarch supervision: the proc died; or no answer within
           `failover.call_timeout_s`: hung) or the supervision hook named a replica's mesh:
           emit `failure_detected`, take the replica out of routing, queue its replacement
           (a hung proc is killed first). Once per replica incarnation.
  repair   at a safe point of the controller loop: take a warm spare (`failover.warm_spares`)
           or else spawn the replacement on its host; once its model has loaded, bring it to the
           current policy version (`prepare`), put it back in routing, emit `replica_replaced`.
           While it loads the role's healthy replicas serve and the run goes on: it is looked at
           again at each repair, and waited for only when no replica of its role serves. Spares
           used up are started again in the background. A replica (first, replacement or spare)
           whose model is not loaded within `failover.setup_timeout_s` of its spawn did not start:
           at the run's start the run fails; a replacement that did not start (or failed as it
           started, or as it took the weights) is one more failure of its replica; a spare is
           dropped. One that loaded but could not take the weights because the trainer failed is
           kept, loaded, for the next repair. One that refuses the model folder (its actor's
           ConfigError: the folder changed since the start) ends the run with that field's error,
           as at the start: every other would read it too.
  recovered  emitted once the failed request has been served again (retried on a healthy
           replica) and the replacement, if one was needed, serves: `time_to_detect_s` (from
           the injected fault, when a drill caused it), `time_to_recover_s` (from detection).
Past `failover.max_replacements` replacements for a role, or `failover.max_retries` retries
of one request, the run fails with the reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.engine.actors.calls import CallFailed, ProcFailure, refusal_ends_run
from workers.engine.actors.hosts import HostsUnreachable
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.config import FailoverConfig
from workers.engine.drills import ActiveFault, FaultInjector
from workers.engine.metrics import Recorder


@dataclass
class Repair:
    """A failed replica waiting for its replacement: queued at its detection, done once a replacement serves."""

    group: ReplicaGroup
    replica: Replica  # the failed one
    incidents: list[Incident]  # its failure, then each replacement's that did not start
    began: float | None = None  # when the failed one was stopped for its first replacement (time.monotonic()):
    # set before any replacement is taken or spawned
    new: Replica | None = None  # the replacement loading now, if any
    pid: Any = None  # the new replica's pid call: it answers once the model has loaded
    loaded: Replica | None = None  # one that loaded but could not take the weights, for a reason not its own (the
    # trainer failed): it takes them at the next repair instead of loading another


@dataclass
class Incident:
    """One detected failure of one replica incarnation, until it is recovered."""

    role: str
    replica: int
    fault: ActiveFault | None
    detected_at: float
    time_to_detect_s: float | None
    needs_replacement: bool
    replaced: bool = False
    served_again: bool = False
    recovered: bool = False


class Failover:
    def __init__(self, *, recorder: Recorder, injector: FaultInjector, config: FailoverConfig,
                 step: Callable[[], int], policy_version: Callable[[], int]):
        self.recorder = recorder
        self.injector = injector
        self.config = config
        self.step = step
        self.policy_version = policy_version
        self.replacements: dict[str, int] = {}
        self.incidents: list[Incident] = []
        self._by_replica: dict[int, Incident] = {}  # id(replica) -> its incident
        self._queue: list[Repair] = []
        self.detect_seconds: list[float] = []
        self.recover_seconds: list[float] = []

    # --- detection ------------------------------------------------------------------
    def detect(self, group: ReplicaGroup, replica: Replica, reason: str, *, hung: bool, alive: bool = False,
               request_failed: bool = True) -> Incident:
        """Record a failure of `replica` (once per incarnation); queue its replacement unless it is alive.

        `request_failed`: a request saw the failure and will be retried (else nothing waits to be served again).
        """
        incident = self._by_replica.get(id(replica))
        if incident is not None and (incident.needs_replacement or alive):
            return incident  # the same failure, seen by another request
        now = time.monotonic()
        fault = self.injector.claim(group.role, replica.index)
        ttd = round(now - fault.injected_at, 3) if fault else None
        incident = Incident(group.role, replica.index, fault, now, ttd, needs_replacement=not alive,
                            served_again=not request_failed)
        self.incidents.append(incident)
        self._by_replica[id(replica)] = incident
        if ttd is not None:
            self.detect_seconds.append(ttd)
        self.recorder.event("failure_detected", step=self.step(), role=group.role, replica=replica.index, host=replica.host,
                            fault_id=fault.id if fault else None, reason=reason[:300], hung=hung, time_to_detect_s=ttd)
        if alive:
            return incident
        replica.failed = True
        if group.replicas[replica.index] is replica:
            group.service.set_available(replica.index, False)
            if hung:
                group.kill(replica)  # a hung proc may wake up later: make sure it does not
            self._queue.append(Repair(group, replica, [incident]))
        return incident

    def incident_of(self, replica: Replica) -> Incident | None:
        return self._by_replica.get(id(replica))

    # --- replacement ----------------------------------------------------------------
    def repair(self, prepare: dict[str, Callable[[Replica], int]], *, host: Callable[[Replica], str]) -> None:
        """Replace queued failed replicas: a ready spare at once; else a replacement spawned on `host(old)` that serves
        from the first repair after its model has loaded. Either is brought to the current version (`prepare`) and
        routed to again. While one loads, its role's healthy replicas serve; a repair waits for it only when none does.
        A replacement that does not start (it fails, or its set-up outlasts failover.setup_timeout_s) or whose own call
        fails as it takes the weights is one more failure of the replica, within the same failover.max_replacements:
        another is started. One that cannot take them for a reason not its own (the trainer failed: the error goes up)
        is kept, loaded, and takes them at the next repair. One that refuses the model folder ends the run with that
        field's ConfigError (as `await_started`): another would read the same folder."""
        for repair in list(self._queue):  # each starts loading (or serves, when it has loaded)
            self._advance(repair, prepare, host, wait=False)
        for repair in list(self._queue):  # then a role none of whose replicas serves waits for its replacements
            if repair in self._queue and not repair.group.service.routable():
                self._advance(repair, prepare, host, wait=True)

    def _advance(self, repair: Repair, prepare: dict[str, Callable[[Replica], int]], host: Callable[[Replica], str], *,
                 wait: bool) -> None:
        group, replica = repair.group, repair.replica
        while True:
            if repair.loaded is not None:
                loaded, repair.loaded = repair.loaded, None
                if self._still_there(group, loaded):
                    if self._replaced(repair, loaded, prepare, from_spare=False):
                        return
                    continue
                group.stop(loaded)
            if repair.new is not None and not self._still_there(group, repair.new):
                group.stop(repair.new)
                repair.new = None
            if repair.new is None:
                loading = sum(r.new is not None or r.loaded is not None for r in self._queue if r.group is group)
                if self.replacements.get(group.role, 0) + loading + 1 > self.config.max_replacements:
                    raise ProcFailure(f"{group.role} replica {replica.index} failed and the run has used its "
                                      f"{self.config.max_replacements} replacements for {group.role} "
                                      f"(failover.max_replacements)")
                target = host(replica)  # first: it finds out whether the old replica's host is lost (then not stopped)
                if repair.began is None:
                    group.stop(replica)
                    repair.began = time.monotonic()
                spare = group.take_spare(replica.index, target)
                if spare is not None:
                    if self._replaced(repair, spare, prepare, from_spare=True):
                        return
                    continue
            try:
                if repair.new is None:
                    repair.new, repair.pid = group.begin_replacement(replica.index, target)
                waits = wait and not group.service.routable()  # no replica of the role serves: nothing goes on
                while not group.started(repair.new, repair.pid, wait_s=math.inf if waits else 0.0):
                    if not waits:
                        return  # still loading: the healthy replicas serve meanwhile
            except HostsUnreachable:  # the host died meanwhile: `host` finds it lost next time and picks another
                continue
            except CallFailed as failure:  # it failed as it spawned or loaded, or its load outlasted the setup timeout
                where = repair.new.host if repair.new is not None else target
                if repair.new is not None:
                    group.stop(repair.new)
                    repair.new = None
                if failure.refused:
                    raise refusal_ends_run(failure.refused, recorder=self.recorder, step=self.step(), what=(
                        f"the replacement of {group.role} replica {replica.index} did not start on {where}")) from None
                self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
                repair.incidents.append(self._start_failed(group, replica, host=where, failure=failure))
                continue
            new, repair.new = repair.new, None
            if self._replaced(repair, new, prepare, from_spare=False):
                return

    @staticmethod
    def _still_there(group: ReplicaGroup, replacement: Replica) -> bool:
        """Whether a replacement spawned for a repair still stands: a drain stops one (it leaves `replacing`), a lost
        host takes it. One that does not is started again on another host, uncounted."""
        return replacement in group.replacing and replacement.host not in group.hosts.lost

    def _replaced(self, repair: Repair, new: Replica, prepare: dict[str, Callable[[Replica], int]], *,
                  from_spare: bool) -> bool:
        """A started replacement (a spare, or one spawned for the replica) takes the current weights and serves; whether
        it does. One whose own call fails meanwhile (`prepare` raises CallFailed: its proc died, or it hangs and is
        killed) is stopped and is one more failure of the replica, as one that did not start: another is tried."""
        group, replica = repair.group, repair.replica
        try:
            new.version = prepare[group.role](new) if group.role in prepare else 0
        except CallFailed as failure:
            if failure.hung:
                group.kill(new)  # it may wake up later: make sure it does not
            group.stop(new)
            self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
            repair.incidents.append(self._start_failed(group, replica, host=new.host, failure=CallFailed(
                f"did not take the current weights: {failure.reason}", hung=failure.hung)))
            return False
        except BaseException:  # e.g. the trainer holding the weights died: try again at the next repair, with it
            if from_spare:  # back among the ready ones
                new.index = -1
                group.ready_spares.append(new)
            else:  # kept loaded (its load takes minutes on GPUs); still among `replacing`, so stopped with the group
                repair.loaded = new
            raise
        self._queue.remove(repair)
        self.replacements[group.role] = self.replacements.get(group.role, 0) + 1
        group.replace(replica.index, new)
        self.recorder.event("replica_replaced", step=self.step(), role=group.role, replica=replica.index,
                            host=new.host, incarnation=new.incarnation, pids=new.pids, policy_version=new.version,
                            from_spare=from_spare,
                            seconds=round(time.monotonic() - repair.began, 3))
        for incident in repair.incidents:
            incident.replaced = True
            self._maybe_recovered(incident)
        return True

    def _start_failed(self, group: ReplicaGroup, replica: Replica, *, host: str, failure: CallFailed) -> Incident:
        """A replacement of `replica` that did not start on `host`: its failure_detected; recovered once a replacement
        serves (no request waits for this one)."""
        incident = Incident(group.role, replica.index, None, time.monotonic(), None, needs_replacement=True,
                            served_again=True)
        self.incidents.append(incident)
        self.recorder.event("failure_detected", step=self.step(), role=group.role, replica=replica.index, host=host,
                            fault_id=None, reason=f"the replacement {failure}"[:300], hung=failure.hung,
                            time_to_detect_s=None)
        return incident

    def pending_repairs(self) -> bool:
        return bool(self._queue)

    def served(self, incident: Incident | None) -> None:
        """A request that failed with this incident has now been served."""
        if incident is not None and not incident.served_again:
            incident.served_again = True
            self._maybe_recovered(incident)

    def _maybe_recovered(self, incident: Incident) -> None:
        if incident.recovered or not incident.served_again or (incident.needs_replacement and not incident.replaced):
            return
        incident.recovered = True
        if not incident.needs_replacement:  # the replica itself lives on: a later failure is a new incident
            self._by_replica = {k: v for k, v in self._by_replica.items() if v is not incident}
        ttr = round(time.monotonic() - incident.detected_at, 3)
        self.recover_seconds.append(ttr)
        if incident.fault is not None:
            self.injector.finish(incident.fault)
        self.recorder.event("recovered", step=self.step(), role=incident.role, replica=incident.replica,
                            fault_id=incident.fault.id if incident.fault else None, caused_failure=True,
                            action="replaced" if incident.needs_replacement else "retried",
                            time_to_detect_s=incident.time_to_detect_s, time_to_recover_s=ttr,
                            policy_version=self.policy_version())

    # --- requests -------------------------------------------------------------------
    def backoff(self, attempt: int, *, what: str) -> None:
        if attempt > self.config.max_retries:
            raise ProcFailure(f"{what} failed {attempt} times (failover.max_retries is {self.config.max_retries})")
        time.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
