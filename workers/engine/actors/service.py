"""A service: several replicas of one actor, and a router that picks a replica per request.

Routing policies (GeneratorConfig.routing):
  round_robin   replicas in turn
  least_loaded  the replica with the fewest requests in flight (ties: lowest index)
  sticky        the same key always goes to the same replica (prefix caches stay warm)

The service does not import monarch: a replica is anything with the endpoint attributes
the caller uses (an actor mesh slice in production, a plain object in tests).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

Replica = TypeVar("Replica")
Routing = Literal["round_robin", "least_loaded", "sticky"]


class Service(Generic[Replica]):
    def __init__(self, replicas: list[Replica], *, routing: Routing):
        if not replicas:
            raise ValueError("a service needs at least one replica")
        self.replicas = replicas
        self.routing = routing
        self.in_flight = [0] * len(replicas)
        self.served = [0] * len(replicas)
        self._next = 0

    def pick(self, key: str | None = None) -> int:
        if self.routing == "round_robin":
            index = self._next % len(self.replicas)
            self._next += 1
        elif self.routing == "least_loaded":
            index = min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], i))
        else:
            if key is None:
                raise ValueError("sticky routing needs a key")
            index = zlib.crc32(key.encode()) % len(self.replicas)
        return index

    def submit(self, call: Callable[[Replica], Any], *, key: str | None = None) -> tuple[int, Any]:
        """Start `call(replica)` on the routed replica; return (replica index, its future/result)."""
        index = self.pick(key)
        self.in_flight[index] += 1
        self.served[index] += 1
        return index, call(self.replicas[index])

    def done(self, index: int) -> None:
        self.in_flight[index] -= 1
