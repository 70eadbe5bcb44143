"""Calls to a role's replicas: routed by the group's Service, and when the replica fails or hangs, reported to
failover and sent again to a healthy replica (while the failed one is replaced)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.actors.calls import CallFailed, request_deadline
from workers.engine.actors.failover import Failover, Incident
from workers.engine.actors.replica_group import Replica, ReplicaGroup
from workers.engine.controller.waits import Waits


class Repairs(Protocol):
    """What the router asks of supervision (`supervision.Supervisor`)."""

    def repair(self) -> None: ...

    def check_hosts(self, *, now: bool = False) -> None: ...


@dataclass
class Request:
    """One call routed to a replica of a group; retried elsewhere when it fails."""

    group: ReplicaGroup
    call: Callable[[Any], Any]  # actor -> future
    key: str | None
    replica: Replica
    index: int
    future: Any
    sent_at: float
    attempts: int = 0
    incident: Incident | None = None
    retry: Request | None = None  # the newest retry of it on another replica, once it failed
    answered_by: Request | None = None  # the attempt that answered it: itself, or a retry of it on another replica

    @property
    def attempt(self) -> Request:
        """The attempt sent last: itself, or its newest retry (the one still out when receiving it raised)."""
        return self.retry or self


class Router:
    def __init__(self, *, failover: Failover, waits: Waits, supervisor: Repairs):
        self.failover, self.waits, self.supervisor = failover, waits, supervisor

    def send(self, group: ReplicaGroup, call: Callable[[Any], Any], *, key: str | None = None, attempts: int = 0,
             incident: Incident | None = None) -> Request:
        if not group.service.routable():
            self.supervisor.repair()  # every replica of the role is down: nothing can serve until one is replaced
        index, future = group.service.submit(lambda replica: call(replica.actor), key=key)
        replica = group.replicas[index]
        replica.outstanding += 1
        return Request(group, call, key, replica, index, future, time.monotonic(), attempts, incident)

    def receive(self, request: Request, *, started: Callable[[Request], float] | None = None) -> Any:
        """The request's result; a failed or hung replica is reported and the request retried elsewhere.
        `started(attempt)`: when (time.monotonic()) the replica of the request, or of a retry of it, could start on it,
        waiting for it if need be (a generator's read of the weights it names); by default when it was sent. Its
        deadline, and the seconds it took (the role's typical time, that sets the next deadlines), count from then.
        When `started`, or a repair while a retry runs, raises, the attempt sent last (`request.attempt`) is still out:
        the caller's to drop or receive."""
        config = self.failover.config
        first = request
        while True:
            begun = request.sent_at if started is None else started(request)
            deadline = request_deadline(typical_s=request.group.service.typical_seconds(), config=config)
            try:
                result = self.waits.wait(request.future, gone=lambda replica=request.replica: replica.lost_with_host,
                                         timeout_s=max(0.01, deadline - (time.monotonic() - begun)))
            except CallFailed as failure:
                self._finish(request, None)
                self.supervisor.check_hosts(now=True)  # asking a replica on a lost host whether it answers would wait
                alive = not failure.hung and request.replica.lost_with_host is None and answers(request.replica)
                incident = self.failover.detect(request.group, request.replica, failure.reason, hung=failure.hung,
                                                alive=alive)
                attempts = request.attempts + 1
                self.failover.backoff(attempts, what=f"a {request.group.role} request")
                request = first.retry = self.send(request.group, request.call, key=request.key, attempts=attempts,
                                                  incident=incident)
                if self.failover.pending_repairs():
                    self.supervisor.repair()  # while the retry runs on a healthy replica
                continue
            self._finish(request, time.monotonic() - begun)
            self.failover.served(request.incident)
            first.answered_by = request
            return result

    def drop(self, request: Request) -> None:
        """Wait for an answer nothing needs, whatever it is, while its replica is not known to have failed: a failure
        is neither retried nor reported. A retry's: the failure that made it is over, nothing waits to be served."""
        replica = request.replica
        try:
            self.waits.wait(request.future, gone=lambda: replica.lost_with_host or (
                f"{replica.role} replica {replica.index} failed" if replica.failed else None))
        except CallFailed:
            pass
        self._finish(request, None)
        self.failover.served(request.incident)

    def call(self, group: ReplicaGroup, call: Callable[[Any], Any], *, key: str | None = None) -> Any:
        """Send and receive."""
        return self.receive(self.send(group, call, key=key))

    def _finish(self, request: Request, seconds: float | None) -> None:
        same = request.group.replicas[request.index] is request.replica
        request.group.service.done(request.index, seconds if same else None)
        request.replica.outstanding -= 1
        request.group.reap()


def answers(replica: Replica) -> bool:
    try:
        replica.actor.pid.call_one().get(timeout=10)
        return True
    except Exception:  # noqa: BLE001 - dead or hung
        return False
