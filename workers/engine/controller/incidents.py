"""A trainer or control-proc failure: noticed once (its host may be found lost before its recovery starts), and its
recovery recorded. Replica failures are `actors.failover.Failover`'s."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from workers.engine.actors.failover import Failover
from workers.engine.controller.state import FaultTotals, RunState
from workers.engine.drills import ActiveFault, FaultInjector
from workers.engine.metrics import Recorder


@dataclass(frozen=True)
class Noticed:
    """A failure seen and not yet recovered from."""

    detected_at: float  # time.monotonic()
    reason: str
    fault: ActiveFault | None = None  # the drill fault that explains it
    time_to_detect_s: float | None = None


class RecoveryLog:
    """Claims the drill fault behind a failure and writes the `recovered` event when the run is whole again."""

    def __init__(self, *, recorder: Recorder, injector: FaultInjector, failover: Failover, state: RunState):
        self.recorder, self.injector, self.failover, self.state = recorder, injector, failover, state

    def notice(self, role: str, reason: str) -> Noticed:
        detected = time.monotonic()
        fault = self.injector.claim(role)
        return Noticed(detected, reason, fault, round(detected - fault.injected_at, 3) if fault else None)

    def recovered(self, role: str, noticed: Noticed, *, at_step: int, action: str, **fields: Any) -> None:
        if noticed.fault is not None:
            self.injector.finish(noticed.fault)
        ttr = round(time.monotonic() - noticed.detected_at, 3)
        self.failover.recover_seconds.append(ttr)
        fault = noticed.fault
        self.recorder.event("recovered", step=at_step, role=role, replica=fault.replica if fault else None,
                            fault_id=fault.id if fault else None, caused_failure=True, action=action, **fields,
                            time_to_detect_s=noticed.time_to_detect_s, time_to_recover_s=ttr,
                            policy_version=self.state.policy_version)


def fault_metrics(failover: Failover, injector: FaultInjector, totals: FaultTotals) -> dict[str, float]:
    """Running totals of the run's faults, logged with every step."""
    metrics = {
        "faults/injected": len(injector.faults),
        "faults/failures": len(failover.incidents) + totals.trainer_recoveries + totals.control_recoveries,
        "faults/replacements": sum(failover.replacements.values()),
        "faults/migrations": totals.migrations,
        "faults/steps_lost": totals.steps_lost,
        "faults/samples_dropped": totals.samples_dropped,
    }
    if failover.detect_seconds:
        metrics["faults/time_to_detect_s"] = failover.detect_seconds[-1]
    if failover.recover_seconds:
        metrics["faults/time_to_recover_s"] = failover.recover_seconds[-1]
    return metrics
