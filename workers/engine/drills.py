"""Fault drills: when each fault is due, and where it is injected (`FaultInjector.inject`).

  kill       SIGKILL the target's processes
  hang       SIGSTOP them, SIGCONT after duration_s (past the call timeout, the controller
             declares them hung and replaces them)
  slow_host  SIGSTOP / SIGCONT every process of the run on the target's host in turn for
             duration_s, stopped `duty_cycle` of each second
  raise, latency, bandwidth, nan_gradients   armed inside the target actor (`actors/faults.py`)

Every injection emits `fault_injected` with a fault id. A fault that makes a call fail is
claimed by the failure handling (`claim`), which emits `failure_detected` and `recovered`
for it; a fault that wears off without a failure gets its `recovered` from `tick` when it
ends; a nan_gradients fault (its update skipped, no call fails) gets it from `trained` at the
first step from its own whose update was not skipped. So each fault yields exactly one
`recovered` (from `close` at the run's end, if it is still in effect then; none when the run
ends in an error, such as RunDiverged).

Schedules: at a step (before it trains), every T seconds, at random (a seeded Poisson
process), or now. A planned drill whose replica is being replaced when it is due is deferred
(`DrillPlan.defer`) until the replica serves. Signals are sent by the target's `Signals`: `LocalSignals` from this process
for procs on this machine, or an agent on the target's host (`actors/host_signals.py`) with
Monarch workers. Monarch- and torch-free.
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.metrics import Recorder
from workers.engine.operations import DURATION_KINDS, UPDATE_KINDS, FaultDrillRequest

SLOW_HOST_PERIOD_S = 1.0
SIGNAL_KINDS = ("kill", "hang", "slow_host")  # drills that signal the target's processes


def send_signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # already gone (replaced after a hang, or killed)
            pass


def continue_after(pids: list[int], seconds: float, stop: threading.Event) -> None:
    """The end of a hang: SIGCONT after `seconds`, or as soon as `stop` is set."""
    stop.wait(seconds)
    send_signal(pids, signal.SIGCONT)


def duty_cycle(pids: list[int], seconds: float, duty: float, stop: threading.Event) -> None:
    """A slow host: stopped `duty` of every SLOW_HOST_PERIOD_S for `seconds` (or until `stop`), running after."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop.is_set():
        send_signal(pids, signal.SIGSTOP)
        stop.wait(SLOW_HOST_PERIOD_S * duty)
        send_signal(pids, signal.SIGCONT)
        stop.wait(SLOW_HOST_PERIOD_S * (1.0 - duty))
    send_signal(pids, signal.SIGCONT)


class Signals(Protocol):
    """Who sends a drill's signals to its target's processes (and keeps a hang's or slowdown's time)."""

    where: str

    def kill(self, pids: list[int]) -> None: ...

    def hang(self, pids: list[int], seconds: float, stop: threading.Event) -> None: ...

    def slow(self, pids: list[int], seconds: float, duty: float, stop: threading.Event) -> None: ...

    def resume(self, pids: list[int]) -> None: ...


class LocalSignals:
    """From this process, with threads here keeping time: for processes on this machine."""

    where = "controller"

    def kill(self, pids: list[int]) -> None:
        send_signal(pids, signal.SIGKILL)

    def hang(self, pids: list[int], seconds: float, stop: threading.Event) -> None:
        send_signal(pids, signal.SIGSTOP)
        threading.Thread(target=continue_after, args=(pids, seconds, stop), daemon=True).start()

    def slow(self, pids: list[int], seconds: float, duty: float, stop: threading.Event) -> None:
        threading.Thread(target=duty_cycle, args=(pids, seconds, duty, stop), daemon=True).start()

    def resume(self, pids: list[int]) -> None:
        send_signal(pids, signal.SIGCONT)


@dataclass
class FaultTarget:
    """What a drill acts on: one replica's processes, and its in-actor injection endpoint."""

    role: str
    replica: int
    pids: list[int]
    arm: Callable[..., None]  # arm(kind, duration_s=..., latency_ms=..., bandwidth_mbps=...) inside the actor(s)
    signals: Signals = field(default_factory=LocalSignals)


@dataclass
class ActiveFault:
    id: int
    request: FaultDrillRequest
    role: str
    replica: int
    pids: list[int]
    injected_at: float  # time.monotonic()
    ends_at: float | None  # when the effect wears off (duration kinds)
    step: int
    claimed: bool = False  # a failure_detected was emitted for it
    finished: bool = False  # its recovered event was emitted
    stop_signals: threading.Event = field(default_factory=threading.Event)
    before: dict[str, float] = field(default_factory=dict)  # the target's measurements when it was injected
    skipped_updates: int = 0  # nan_gradients: steps from its own whose update was skipped
    signals: Signals = field(default_factory=LocalSignals)

    def end_signals(self) -> None:
        """No more stops for its processes: a hang or slowdown ends now (best effort: the host may be gone). Once:
        the run's end and a repair may both end the same fault, and an agent call to a lost host waits."""
        if self.stop_signals.is_set():
            return
        self.stop_signals.set()
        if self.request.kind in ("hang", "slow_host"):
            try:
                self.signals.resume(self.pids)
            except Exception:  # noqa: BLE001 - a lost host's agent is gone with the processes it would resume
                pass


class DrillPlan:
    """Drills waiting for their time: `due(step=..., now=...)` returns those to inject now."""

    def __init__(self, requests: list[FaultDrillRequest] = (), *, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self._waiting: list[tuple[FaultDrillRequest, float | None, random.Random | None]] = []
        self._deferred: list[FaultDrillRequest] = []  # were due, and wait for their target (`defer`)
        for request in requests:
            self.add(request, now=self.start)

    def add(self, request: FaultDrillRequest, *, now: float) -> None:
        schedule = request.schedule
        rng = None
        next_at: float | None = None
        if schedule is None:
            next_at = now
        elif schedule.every_s is not None:
            next_at = now + schedule.every_s
        elif schedule.random_seed is not None:
            rng = random.Random(schedule.random_seed)
            next_at = now + self._random_gap(rng, schedule.rate_per_min)
        self._waiting.append((request, next_at, rng))

    @staticmethod
    def _random_gap(rng: random.Random, rate_per_min: float) -> float:
        return -math.log(1.0 - rng.random()) * 60.0 / rate_per_min

    def defer(self, request: FaultDrillRequest) -> None:
        """A drill that was due and cannot run yet (its replica is being replaced): due again at every later `due` that
        its schedule's kind passes (a step drill between steps, a timed one also while waiting) until it is not deferred
        again. Once: a repeating drill that comes due again meanwhile is the same drill, not a second one."""
        if not any(waiting is request for waiting in self._deferred):
            self._deferred.append(request)

    @staticmethod
    def _selected(request: FaultDrillRequest, roles: tuple[str, ...] | None, timed_only: bool) -> bool:
        schedule = request.schedule
        timed = schedule is not None and schedule.at_step is None
        return (roles is None or request.role in roles) and (timed or not timed_only)

    def due(self, *, step: int, now: float, roles: tuple[str, ...] | None = None,
            timed_only: bool = False) -> list[FaultDrillRequest]:
        """Drills to inject now, deferred ones first; `step` is the step about to train. Repeating drills are
        rescheduled.

        `roles`: only drills on these roles; `timed_only`: only every_s and random drills.
        """
        deferred = [request for request in self._deferred if self._selected(request, roles, timed_only)]
        self._deferred = [request for request in self._deferred if not self._selected(request, roles, timed_only)]
        fired, waiting = [], []
        for request, next_at, rng in self._waiting:
            schedule = request.schedule
            if not self._selected(request, roles, timed_only):
                waiting.append((request, next_at, rng))
            elif schedule is not None and schedule.at_step is not None:
                if step >= schedule.at_step:
                    fired.append(request)
                else:
                    waiting.append((request, next_at, rng))
            elif next_at is not None and now >= next_at:
                fired.append(request)
                if schedule is not None and schedule.every_s is not None:
                    waiting.append((request, max(now, next_at + schedule.every_s), rng))
                elif rng is not None:
                    waiting.append((request, now + self._random_gap(rng, schedule.rate_per_min), rng))
            else:
                waiting.append((request, next_at, rng))
        self._waiting = waiting
        return [*deferred, *(request for request in fired if not any(request is d for d in deferred))]


class FaultInjector:
    """Injects faults, remembers the active ones, and emits their fault_injected / recovered events."""

    def __init__(self, recorder: Recorder, *, measure: Callable[[str, int], dict[str, float]] | None = None):
        self.recorder = recorder
        self.faults: list[ActiveFault] = []
        # measure(role, replica): what the fault's effect shows in, e.g. a replica's seconds per request;
        # taken at injection ("before") and when the effect ends ("during")
        self.measure = measure or (lambda role, replica: {})

    def inject(self, request: FaultDrillRequest, target: FaultTarget, *, step: int) -> ActiveFault:
        now = time.monotonic()
        duration = request.duration_s if request.kind in DURATION_KINDS else None
        fault = ActiveFault(id=len(self.faults) + 1, request=request, role=target.role, replica=target.replica,
                            pids=list(target.pids), injected_at=now, ends_at=now + duration if duration else None, step=step,
                            signals=target.signals)
        fault.before = self.measure(fault.role, fault.replica)
        self.faults.append(fault)
        kind = request.kind
        signalled = kind in SIGNAL_KINDS
        if kind == "kill":
            target.signals.kill(fault.pids)
        elif kind == "hang":
            target.signals.hang(fault.pids, duration, fault.stop_signals)
        elif kind == "slow_host":
            target.signals.slow(fault.pids, duration, request.duty_cycle, fault.stop_signals)
        else:
            target.arm(kind, duration_s=duration or 0.0, latency_ms=request.latency_ms, bandwidth_mbps=request.bandwidth_mbps)
        self.recorder.event("fault_injected", step=step, fault_id=fault.id, fault_kind=kind, role=fault.role,
                            replica=fault.replica, pids=fault.pids, duration_s=duration,
                            **({"signalled_by": target.signals.where} if signalled else {}),
                            **{k: v for k, v in request.model_dump(include={"latency_ms", "bandwidth_mbps", "duty_cycle"}).items()
                               if v is not None})
        return fault

    def claim(self, role: str, replica: int | None = None) -> ActiveFault | None:
        """The newest unclaimed fault on this role (and replica) whose effect can still explain a failure."""
        now = time.monotonic()
        for fault in reversed(self.faults):
            if fault.claimed or fault.finished or fault.role != role or fault.request.kind in UPDATE_KINDS:
                continue
            if replica is not None and fault.replica != replica:
                continue
            if fault.ends_at is not None and now > fault.ends_at + 1.0 and fault.request.kind != "hang":
                continue
            fault.claimed = True
            fault.end_signals()  # a replaced process needs no more signals
            return fault
        return None

    def finish(self, fault: ActiveFault) -> None:
        fault.finished = True

    def tick(self, *, step: int) -> None:
        """Emit `recovered` for faults that wore off without causing a failure."""
        now = time.monotonic()
        for fault in self.faults:
            if fault.claimed or fault.finished or fault.ends_at is None or now < fault.ends_at:
                continue
            fault.finished = True
            self.recorder.event("recovered", step=step, fault_id=fault.id, fault_kind=fault.request.kind, role=fault.role,
                                replica=fault.replica, caused_failure=False, time_to_detect_s=None,
                                time_to_recover_s=round(now - fault.injected_at, 3), before=fault.before,
                                during=self.measure(fault.role, fault.replica))

    def trained(self, *, step: int, skipped: int) -> None:
        """Step `step` trained, `skipped` of its updates skipped (NaN or infinite gradients): a nan_gradients fault
        injected for this step or before recovers at the first such step that skipped none (its `recovered` says how
        many steps were skipped until then)."""
        now = time.monotonic()
        for fault in self.faults:
            if fault.request.kind not in UPDATE_KINDS or fault.finished or step < fault.step:
                continue
            if skipped:
                fault.skipped_updates += 1
                continue
            fault.finished = True
            self.recorder.event("recovered", step=step, fault_id=fault.id, fault_kind=fault.request.kind, role=fault.role,
                                replica=fault.replica, caused_failure=False, time_to_detect_s=None,
                                time_to_recover_s=round(now - fault.injected_at, 3), skipped_updates=fault.skipped_updates)

    def close(self, *, step: int) -> None:
        """At the end of the run: every fault still in effect ends now and gets its `recovered`."""
        now = time.monotonic()
        for fault in self.faults:
            fault.end_signals()
            if fault.claimed or fault.finished:
                continue
            fault.finished = True
            self.recorder.event("recovered", step=step, fault_id=fault.id, fault_kind=fault.request.kind, role=fault.role,
                                replica=fault.replica, caused_failure=False, cut_short_by_run_end=True, time_to_detect_s=None,
                                time_to_recover_s=round(now - fault.injected_at, 3), before=fault.before,
                                during=self.measure(fault.role, fault.replica),
                                **({"skipped_updates": fault.skipped_updates} if fault.request.kind in UPDATE_KINDS else {}))
