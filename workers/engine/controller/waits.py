"""Every wait of the Monarch controller: it polls each failover.poll_seconds, gives up after
failover.call_timeout_s, and runs the run's ticks (supervision, spares, timed drills) while it waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.engine.actors.calls import CallFailed, wait_all, wait_for
from workers.engine.config import FailoverConfig


def nothing_gone() -> str | None:
    return None


class Waits:
    def __init__(self, *, config: FailoverConfig):
        self.config = config
        self.ticks: list[Callable[[], None]] = []  # registered once every part of the run exists

    def tick(self) -> None:
        for tick in self.ticks:
            tick()

    def wait(self, future: Any, *, gone: Callable[[], str | None] = nothing_gone,
             tick: Callable[[], None] | None = None, timeout_s: float | None = None) -> Any:
        """The future's result; CallFailed when it fails, times out, or `gone` names why its proc is lost."""
        return wait_for(future, timeout_s=self.config.call_timeout_s if timeout_s is None else timeout_s,
                        poll_s=self.config.poll_seconds, tick=tick or self.tick, gone=gone)

    def wait_all(self, futures: list[Any], *, gone: list[Callable[[], str | None]]) -> list[Any | CallFailed]:
        return wait_all(futures, config=self.config, tick=self.tick, gone=gone)
