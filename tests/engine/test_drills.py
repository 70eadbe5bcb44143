"""Drill schedules and signal faults on a plain local process (no monarch)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from workers.engine.drills import DrillPlan, FaultInjector, FaultTarget
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.operations import FaultDrillRequest, parse_operation


def _drill(**payload: object) -> FaultDrillRequest:
    return parse_operation("fault_drill", {"role": "generator", **payload})  # type: ignore[return-value]


def _state(pid: int) -> str:
    """The process state letter from /proc: S sleeping, T stopped."""
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


@pytest.fixture
def sleeper():
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def test_schedules_at_step_every_seconds_random_and_now() -> None:
    plan = DrillPlan([_drill(kind="kill", schedule={"at_step": 3}), _drill(kind="raise", schedule={"every_s": 10}),
                      _drill(kind="raise", replica=1)], start=0.0)
    assert [d.kind for d in plan.due(step=1, now=0.0)] == ["raise"]  # the unscheduled one: now
    assert plan.due(step=2, now=5.0) == []
    assert [d.kind for d in plan.due(step=3, now=5.0)] == ["kill"]
    assert [d.schedule.every_s for d in plan.due(step=4, now=10.0)] == [10]
    assert plan.due(step=5, now=19.0) == [] and len(plan.due(step=5, now=20.0)) == 1  # repeats

    def times(seed: int) -> list[float]:
        random_plan = DrillPlan([_drill(kind="kill", schedule={"random_seed": seed, "rate_per_min": 6})], start=0.0)
        return [t / 10 for t in range(0, 6000) if random_plan.due(step=1, now=t / 10)]

    first = times(7)
    assert first == times(7) and first != times(8)  # seeded
    assert 40 <= len(first) <= 85  # about 6 a minute over 10 minutes


def test_timed_only_leaves_step_drills_for_the_step() -> None:
    plan = DrillPlan([_drill(kind="kill", schedule={"at_step": 1}), _drill(kind="raise", role="trainer", schedule={"every_s": 1})],
                     start=0.0)
    assert plan.due(step=1, now=2.0, roles=("generator",), timed_only=True) == []
    assert {d.role for d in plan.due(step=1, now=2.0)} == {"generator", "trainer"}


def test_a_deferred_drill_is_due_at_each_check_until_it_is_not_deferred_again() -> None:
    step_drill = _drill(kind="kill", schedule={"at_step": 1})
    timed = _drill(kind="latency", replica=1, latency_ms=5, duration_s=1, schedule={"every_s": 1})
    plan = DrillPlan([step_drill, timed], start=0.0)
    assert plan.due(step=1, now=1.0) == [step_drill, timed]
    plan.defer(step_drill)
    plan.defer(timed)
    plan.defer(timed)
    assert plan.due(step=1, now=1.5, timed_only=True) == [timed], "a step drill waits for the step, a timed one not"
    plan.defer(timed)
    assert plan.due(step=2, now=2.0) == [step_drill, timed], "deferred once, though it came due again meanwhile"
    assert plan.due(step=3, now=2.5) == [], "not deferred again: ran"
    assert plan.due(step=3, now=3.0) == [timed], "and repeats on its schedule"


def test_hang_stops_the_process_until_its_duration_ends(sleeper) -> None:
    sink = MemorySink()
    served = iter([3, 5])
    injector = FaultInjector(Recorder([sink]), measure=lambda role, replica: {"requests_served": next(served)})
    target = FaultTarget("generator", 0, [sleeper.pid], arm=lambda kind, **_: None)
    injector.inject(_drill(kind="hang", duration_s=0.6), target, step=1)
    time.sleep(0.2)
    assert _state(sleeper.pid) == "T"
    time.sleep(0.8)
    assert _state(sleeper.pid) != "T"
    injector.tick(step=2)
    names = [(r["name"], r.get("fault_kind"), r.get("caused_failure")) for r in sink.records]
    assert names == [("fault_injected", "hang", None), ("recovered", "hang", False)]
    assert (sink.records[-1]["before"], sink.records[-1]["during"]) == ({"requests_served": 3}, {"requests_served": 5})


def test_slow_host_alternates_stop_and_continue(sleeper) -> None:
    injector = FaultInjector(Recorder())
    target = FaultTarget("generator", 0, [sleeper.pid], arm=lambda kind, **_: None)
    injector.inject(_drill(kind="slow_host", duty_cycle=0.5, duration_s=1.5), target, step=1)
    seen = set()
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        seen.add(_state(sleeper.pid))
        time.sleep(0.05)
    assert "T" in seen and seen - {"T"}, "stopped part of the time, running (or sleeping) the rest"
    time.sleep(0.6)
    assert _state(sleeper.pid) != "T"


def test_kill_and_in_actor_faults_and_claims(sleeper) -> None:
    sink = MemorySink()
    injector = FaultInjector(Recorder([sink]))
    armed: list[tuple[str, dict]] = []
    target = FaultTarget("reward", 0, [sleeper.pid], arm=lambda kind, **fields: armed.append((kind, fields)))
    kill = injector.inject(_drill(kind="kill", role="reward"), target, step=3)
    assert sleeper.wait(timeout=5) == -9
    injector.inject(_drill(kind="latency", role="reward", latency_ms=20, duration_s=60), target, step=3)
    assert armed == [("latency", {"duration_s": 60.0, "latency_ms": 20.0, "bandwidth_mbps": None})]
    # a failure on reward 0 is explained by the newest fault still in effect; each fault is claimed once
    assert injector.claim("reward", 0).request.kind == "latency"
    assert injector.claim("reward", 0) is kill and injector.claim("reward", 0) is None
    injector.close(step=4)
    assert [r["name"] for r in sink.records] == ["fault_injected", "fault_injected"]  # both claimed: no extra recovered


def test_a_nan_gradients_fault_recovers_once_at_the_first_step_from_its_own_whose_update_was_not_skipped() -> None:
    sink = MemorySink()
    injector = FaultInjector(Recorder([sink]))
    armed: list[str] = []
    target = FaultTarget("trainer", 1, [4242], arm=lambda kind, **fields: armed.append(kind))
    first = injector.inject(_drill(kind="nan_gradients", role="trainer", replica=1), target, step=3)
    assert armed == ["nan_gradients"] and first.ends_at is None
    injector.trained(step=2, skipped=0)  # trained before the fault's step: not its recovery
    injector.trained(step=3, skipped=1)
    second = injector.inject(_drill(kind="nan_gradients", role="trainer", replica=1), target, step=4)
    injector.trained(step=4, skipped=1)
    injector.tick(step=4)
    assert injector.claim("trainer") is None and injector.claim("trainer", 1) is None, "no call failed for it"
    assert [r["name"] for r in sink.records] == ["fault_injected", "fault_injected"]
    injector.trained(step=5, skipped=0)
    injector.trained(step=6, skipped=0)
    injector.trained(step=7, skipped=1)  # a later skip (not a drill's) is no fault's
    injector.close(step=7)
    recovered = [r for r in sink.records if r["name"] == "recovered"]
    assert [(r["fault_id"], r["step"], r["skipped_updates"], r["caused_failure"]) for r in recovered] == \
        [(first.id, 5, 2, False), (second.id, 5, 1, False)], "each once, at step 5"
    assert all(r["fault_kind"] == "nan_gradients" and (r["role"], r["replica"]) == ("trainer", 1) for r in recovered)


def test_a_nan_gradients_fault_still_skipping_at_the_runs_end_is_recovered_by_close_once() -> None:
    sink = MemorySink()
    injector = FaultInjector(Recorder([sink]))
    injector.inject(_drill(kind="nan_gradients", role="trainer"), FaultTarget("trainer", 0, [4242], arm=lambda kind, **_: None),
                    step=5)
    injector.trained(step=5, skipped=1)
    injector.close(step=5)
    injector.trained(step=6, skipped=0)
    injector.close(step=6)
    [recovered] = [r for r in sink.records if r["name"] == "recovered"]
    assert (recovered["step"], recovered["skipped_updates"], recovered["cut_short_by_run_end"]) == (5, 1, True)


def test_exited_sees_a_killed_process_before_it_is_reaped(sleeper) -> None:
    from workers.engine.actors.calls import exited

    assert not exited(sleeper.pid)
    sleeper.kill()
    time.sleep(0.2)
    assert exited(sleeper.pid), "a killed child not yet waited for is a zombie"
    sleeper.wait()
    assert exited(sleeper.pid)


class _GoneAgent:
    """The signals of a host whose agent went with it: every call fails as an unreachable actor's would."""

    where = "agent on host1"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def resume(self, pids: list[int]) -> None:
        self.calls.append("resume")
        raise RuntimeError("actor host_signals on host1 is unreachable")


@pytest.mark.parametrize(("drill", "resumed"), [({"kind": "hang", "duration_s": 5}, True),
                                               ({"kind": "slow_host", "duration_s": 5, "duty_cycle": 0.5}, True),
                                               ({"kind": "kill"}, False)])
def test_ending_a_fault_whose_host_agent_is_gone_stops_its_timers_and_raises_nothing(drill: dict, resumed: bool) -> None:
    from workers.engine.drills import ActiveFault

    agent = _GoneAgent()
    fault = ActiveFault(id=1, request=_drill(replica=0, **drill), role="generator", replica=0,
                        pids=[4242], injected_at=time.monotonic(), ends_at=None, step=3, signals=agent)
    fault.end_signals()
    assert fault.stop_signals.is_set(), "the hang's or slowdown's timer must not stop anything more"
    assert agent.calls == (["resume"] if resumed else [])
    fault.end_signals()  # the run's end after a repair ended it: no second call to a host that may be gone
    assert agent.calls == (["resume"] if resumed else [])
