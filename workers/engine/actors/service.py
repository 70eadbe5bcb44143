"""A service: several replicas of one actor, and a router that picks a replica per request.

Routing policies (GeneratorConfig.routing):
  round_robin   replicas in turn
  least_loaded  the replica with the lowest (requests in flight + 1) x its recent seconds per
                request: a slow replica gets less work (ties: lowest index). A replica passed
                over `probe_after` times in a row gets the next request, so one that has
                recovered from a slowdown is measured again.
  sticky        the same key always goes to the same replica (prefix caches stay warm)

Replicas keep their index for the whole run. A replica can be taken out of routing (dead,
being replaced, drained, removed) and put back; `replace` swaps in a new replica at the
same index.

The service does not import monarch: a replica is anything with the endpoint attributes
the caller uses (an actor mesh slice in production, a plain object in tests).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

Replica = TypeVar("Replica")
Routing = Literal["round_robin", "least_loaded", "sticky"]


class NoReplica(RuntimeError):
    """Every replica is out of routing."""


class Service(Generic[Replica]):
    def __init__(self, replicas: list[Replica], *, routing: Routing, latency_smoothing: float = 0.5, probe_after: int = 8):
        if not replicas:
            raise ValueError("a service needs at least one replica")
        self.replicas: list[Replica] = list(replicas)
        self.routing = routing
        self.in_flight = [0] * len(replicas)
        self.served = [0] * len(replicas)
        self.available = [True] * len(replicas)
        self.seconds_per_request: list[float | None] = [None] * len(replicas)
        self.latency_smoothing = latency_smoothing
        self.probe_after = probe_after
        self._passed_over = [0] * len(replicas)
        self._next = 0

    def routable(self) -> list[int]:
        return [i for i, ok in enumerate(self.available) if ok]

    def pick(self, key: str | None = None) -> int:
        candidates = self.routable()
        if not candidates:
            raise NoReplica("no replica is available")
        if self.routing == "round_robin":
            index = candidates[self._next % len(candidates)]
            self._next += 1
        elif self.routing == "least_loaded":
            index = self._least_loaded(candidates)
        else:
            if key is None:
                raise ValueError("sticky routing needs a key")
            index = candidates[zlib.crc32(key.encode()) % len(candidates)]
        return index

    def _least_loaded(self, candidates: list[int]) -> int:
        starved = [i for i in candidates if self._passed_over[i] >= self.probe_after]
        if starved:
            index = starved[0]
        else:
            known = [s for i in candidates if (s := self.seconds_per_request[i]) is not None]
            unknown = min(known) if known else 1.0  # an unmeasured replica is assumed as fast as the fastest
            index = min(candidates, key=lambda i: ((self.in_flight[i] + 1) * (self.seconds_per_request[i] or unknown), i))
        for i in candidates:
            self._passed_over[i] = 0 if i == index else self._passed_over[i] + 1
        return index

    def submit(self, call: Callable[[Replica], Any], *, key: str | None = None) -> tuple[int, Any]:
        """Start `call(replica)` on the routed replica; return (replica index, its future/result)."""
        index = self.pick(key)
        self.in_flight[index] += 1
        self.served[index] += 1
        return index, call(self.replicas[index])

    def done(self, index: int, seconds: float | None = None) -> None:
        """A request finished (or failed); `seconds`: how long it took, for latency-aware routing."""
        self.in_flight[index] -= 1
        if seconds is not None:
            previous = self.seconds_per_request[index]
            a = self.latency_smoothing
            self.seconds_per_request[index] = seconds if previous is None else a * seconds + (1 - a) * previous

    def typical_seconds(self) -> float | None:
        """The median of the routable replicas' recent seconds per request (None before any was measured)."""
        known = sorted(s for i in self.routable() if (s := self.seconds_per_request[i]) is not None)
        return known[len(known) // 2] if known else None

    def set_available(self, index: int, available: bool) -> None:
        self.available[index] = available

    def replace(self, index: int, replica: Replica) -> None:
        """A new replica at `index` (its latency is measured afresh); routable again."""
        self.replicas[index] = replica
        self.seconds_per_request[index] = None
        self._passed_over[index] = 0
        self.available[index] = True

    def add(self, replica: Replica) -> int:
        self.replicas.append(replica)
        for column, value in ((self.in_flight, 0), (self.served, 0), (self.available, True),
                              (self.seconds_per_request, None), (self._passed_over, 0)):
            column.append(value)
        return len(self.replicas) - 1
