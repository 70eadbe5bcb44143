"""The actor side of fault drills: faults that act inside a role's endpoints.

`FaultInjectableActor` is the base of every actor a drill can target. Its `inject_fault`
endpoint arms (`arm_fault`) one of:
  raise          the next work call raises InjectedFault (the actor itself survives)
  latency        each work call first waits latency_ms, for duration_s
  bandwidth      each work call first waits (bytes of its arguments) / bandwidth, for duration_s
  nan_gradients  a trainer rank's only (`trainer_rank.py`): its gradients of the next update are NaN
A work endpoint calls `self.before_work(args...)` first. Faults that act on the process
(kill, hang, slow_host) are signals sent by the controller: see `workers/engine/drills.py`.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

from monarch.actor import Actor, endpoint

from workers.engine.fields import ConfigError

T = TypeVar("T")


class InjectedFault(RuntimeError):
    """Raised by a work endpoint because a `raise` fault drill armed it."""


def message_bytes(value: Any) -> int:
    """Bytes a value takes on the wire, roughly: tensors by size, containers by their items."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if isinstance(value, dict):
        return sum(message_bytes(k) + message_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(message_bytes(v) for v in value)
    if isinstance(value, (int, float, bool)) or value is None:
        return 8
    if isinstance(value, (str, bytes)):
        return len(value)
    return len(pickle.dumps(value))


class FaultInjectableActor(Actor):
    _raise_next = False
    _delay_until = 0.0
    _latency_s = 0.0
    _bits_per_s: float | None = None
    refused: ConfigError | None = None  # a file a field named, which the constructor could not load (`pid` raises it)

    @endpoint
    def pid(self) -> int:
        """This proc's pid, which the controller asks for once the actor is built. The constructor's refusal of a file
        a field named is raised here: from an endpoint the ConfigError itself reaches the controller (in its
        ActorError), where a constructor's exception fails the actor, a supervision error of its text only."""
        if self.refused is not None:
            raise self.refused
        return os.getpid()

    def unless_refused(self, load: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """`load(*args, **kwargs)` in the constructor; None when it refuses a file a field named, its ConfigError kept
        for `pid` to raise (the constructor then returns)."""
        try:
            return load(*args, **kwargs)
        except ConfigError as refused:
            self.refused = refused
            return None

    @endpoint
    def inject_fault(self, kind: str, duration_s: float = 0.0, latency_ms: float | None = None,
                     bandwidth_mbps: float | None = None) -> None:
        self.arm_fault(kind, duration_s=duration_s, latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps)

    def arm_fault(self, kind: str, *, duration_s: float, latency_ms: float | None, bandwidth_mbps: float | None) -> None:
        """The fault of `inject_fault`; an actor that takes more kinds adds them (ValueError: a kind it does not take)."""
        if kind == "raise":
            self._raise_next = True
        elif kind in ("latency", "bandwidth"):
            self._delay_until = time.monotonic() + duration_s
            self._latency_s = (latency_ms or 0.0) / 1000.0
            self._bits_per_s = bandwidth_mbps * 1e6 if bandwidth_mbps else None
        else:
            raise ValueError(f"{kind} is not a fault that {type(self).__name__} injects into itself")

    def before_work(self, *args: Any, may_raise: bool = True) -> None:
        """Called first by a work endpoint with the arguments it received."""
        if self._raise_next and may_raise:
            self._raise_next = False
            raise InjectedFault("a fault drill made this call fail")
        if time.monotonic() < self._delay_until:
            delay = self._latency_s
            if self._bits_per_s:
                delay += 8 * message_bytes(args) / self._bits_per_s
            time.sleep(delay)
