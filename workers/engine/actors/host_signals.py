"""Drill signals on a worker host: an agent proc there sends them to the run's processes on that host.

A pid means something only on its own machine, so with Monarch workers the kill / hang / slow_host
drills do not signal from the controller: `Hosts.signals(host)` starts one `HostSignals` actor in a
proc of its own on that host (at its first drill) and `AgentSignals` asks it. The agent keeps the
timing itself (continue after a hang, the stop/continue duty cycle), so a slow network between the
controller and the host does not stretch a fault. Without workers, `drills.LocalSignals` signals
from the controller, as before.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from monarch.actor import Actor, endpoint

from workers.engine.drills import continue_after, duty_cycle, send_signal

AGENT_TIMEOUT_S = 30.0


class HostSignals(Actor):
    def __init__(self) -> None:
        self._stops: dict[tuple[int, ...], threading.Event] = {}

    def _stop_event(self, pids: list[int]) -> threading.Event:
        self._end(pids)
        stop = self._stops[tuple(pids)] = threading.Event()
        return stop

    def _end(self, pids: list[int]) -> None:
        previous = self._stops.pop(tuple(pids), None)
        if previous is not None:
            previous.set()

    @endpoint
    def kill(self, pids: list[int]) -> None:
        send_signal(pids, signal.SIGKILL)

    @endpoint
    def hang(self, pids: list[int], seconds: float) -> None:
        """SIGSTOP now, SIGCONT after `seconds` (or at `resume`)."""
        send_signal(pids, signal.SIGSTOP)
        threading.Thread(target=continue_after, args=(pids, seconds, self._stop_event(pids)), daemon=True).start()

    @endpoint
    def slow(self, pids: list[int], seconds: float, duty: float) -> None:
        """Stopped `duty` of every period for `seconds` (or until `resume`)."""
        threading.Thread(target=duty_cycle, args=(pids, seconds, duty, self._stop_event(pids)), daemon=True).start()

    @endpoint
    def resume(self, pids: list[int]) -> None:
        self._end(pids)
        send_signal(pids, signal.SIGCONT)


class AgentSignals:
    """`drills.Signals` through the agent on `host`."""

    def __init__(self, agent: Any, host: str):
        self.agent = agent
        self.where = f"agent on {host}"

    def kill(self, pids: list[int]) -> None:
        self.agent.kill.call_one(pids).get(timeout=AGENT_TIMEOUT_S)

    def hang(self, pids: list[int], seconds: float, stop: threading.Event) -> None:  # noqa: ARG002 - the agent keeps time
        self.agent.hang.call_one(pids, seconds).get(timeout=AGENT_TIMEOUT_S)

    def slow(self, pids: list[int], seconds: float, duty: float, stop: threading.Event) -> None:  # noqa: ARG002
        self.agent.slow.call_one(pids, seconds, duty).get(timeout=AGENT_TIMEOUT_S)

    def resume(self, pids: list[int]) -> None:
        self.agent.resume.call_one(pids).get(timeout=AGENT_TIMEOUT_S)
