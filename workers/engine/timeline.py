"""Where a step's time goes (#17 item 5): spans of work on every proc ("lane"), recorded once a step as a
`step_timeline` event (`telemetry_wire.StepTimeline`: stored per step, drawn on the run page), with each phase's share
of the step and each lane's idle share (also logged as `timeline/*` metrics).

  in a proc       `WorkSpans`: an actor times its work (`with spans.span("forward_backward"): ...`) by the wall clock
                  and returns the spans with its answer
  the controller  `PhaseTimer` (training.py) times what the step loop waits on (lane "controller") and collects
                  the procs' spans with `add_proc`; `record_step_timeline` turns them into the step's event

A proc on another host has its own clock: its spans are shifted into the window in which the controller waited for
the call (`on_call_clock`). A span is recorded with the step in which its answer arrived (the step its work was for),
so a generation that ran during the step before starts before the step does (a negative offset) and counts in this
step's shares: over a run every span counts once, and an async run's generator is not shown idle in the step it
generated ahead in.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from workers.engine.metrics import Recorder
from workers.engine.telemetry_wire import (MAX_TIMELINE_LANES, MAX_TIMELINE_NAME_CHARS, MAX_TIMELINE_PHASES,
                                           MAX_TIMELINE_SPANS, STEP_TIMELINE)

CONTROLLER = "controller"
MIN_SPAN_S = 1e-4  # shorter spans are not drawn or counted
LANE_ORDER = ("controller", "process", "trainer", "generator", "reward", "reference")

ProcSpan = tuple[str, float, float]  # (phase, start, end), Unix seconds by the proc's clock
Span = tuple[str, str, float, float]  # (lane, phase, start, end), Unix seconds by the controller's clock


class WorkSpans:
    """The spans of one call's work in a proc, by the proc's wall clock."""

    def __init__(self) -> None:
        self.items: list[ProcSpan] = []

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.items.append((phase, start, time.time()))


def phase_seconds(items: Iterable[ProcSpan], phase: str) -> float:
    """The seconds a proc's spans spent in `phase`."""
    return sum(end - start for name, start, end in items if name == phase)


def on_call_clock(items: Iterable[ProcSpan], *, sent: float, answered: float) -> list[ProcSpan]:
    """A proc's spans moved onto the controller's clock: when they stick out of [sent, answered] (the call's window
    as the controller saw it, Unix seconds) they are shifted in as a whole, then clipped to it."""
    items = list(items)
    if not items:
        return []
    first, last = min(s for _, s, _ in items), max(e for _, _, e in items)
    shift = 0.0
    if last > answered:
        shift = answered - last
    if first + shift < sent:
        shift = sent - first
    return [(phase, max(sent, start + shift), min(answered, max(sent, end + shift))) for phase, start, end in items]


def lane_key(lane: str) -> tuple[int, str, int]:
    """controller, process, trainer 0, trainer 1, ..., generator 0, ..., reward, reference, then others by name."""
    role, _, number = lane.partition(" ")
    rank = LANE_ORDER.index(role) if role in LANE_ORDER else len(LANE_ORDER)
    return rank, role, int(number) if number.isdigit() else -1


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _name(text: str) -> str:
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(text))[:MAX_TIMELINE_NAME_CHARS] or "?"


def step_timeline(*, step: int, start: float, end: float, spans: Iterable[Span]) -> dict[str, Any]:
    """The `StepTimeline` of one step from its spans (Unix seconds): offsets from the step's start, rounded to 0.1 ms;
    each phase's share of the step's seconds (the time some proc ran it, at most 1; the largest MAX_TIMELINE_PHASES) (the controller's lane is what the loop waited on, not work), and
    each proc lane's idle share."""
    kept = [(_name(lane), _name(phase), s, e) for lane, phase, s, e in spans
            if math.isfinite(s) and math.isfinite(e) and e - s >= MIN_SPAN_S]
    lanes = sorted({lane for lane, *_ in kept}, key=lane_key)[:MAX_TIMELINE_LANES]
    index = {lane: i for i, lane in enumerate(lanes)}
    kept = [span for span in kept if span[0] in index]
    truncated = max(0, len(kept) - MAX_TIMELINE_SPANS)
    if truncated:
        kept = sorted(kept, key=lambda s: s[3] - s[2], reverse=True)[:MAX_TIMELINE_SPANS]
    seconds = max(end - start, 1e-9)
    by_phase: dict[str, list[tuple[float, float]]] = {}
    by_lane: dict[str, list[tuple[float, float]]] = {lane: [] for lane in lanes if lane != CONTROLLER}
    for lane, phase, s, e in kept:
        if lane != CONTROLLER:
            by_phase.setdefault(phase, []).append((s, e))
            by_lane[lane].append((s, e))
    share = lambda intervals: round(min(1.0, _union_seconds(intervals) / seconds), 4)  # noqa: E731
    largest = sorted(((phase, share(intervals)) for phase, intervals in by_phase.items()),
                     key=lambda item: item[1], reverse=True)[:MAX_TIMELINE_PHASES]
    return {
        "step": step, "start": round(start, 4), "seconds": round(end - start, 4), "lanes": lanes,
        "spans": [[index[lane], phase, round(s - start, 4), round(e - start, 4)]
                  for lane, phase, s, e in sorted(kept, key=lambda s: (index[s[0]], s[2]))],
        "shares": dict(sorted(largest, key=lambda item: item[0])),
        "idle": {lane: round(1.0 - share(intervals), 4) for lane, intervals in by_lane.items()},
        "truncated": truncated,
    }


def record_step_timeline(recorder: Recorder, *, step: int, start: float, end: float,
                         spans: Iterable[Span]) -> dict[str, float]:
    """Record the step's `step_timeline` event (usually through `PhaseTimer.record_timeline`); its shares as metrics: `timeline/<phase>_share`, and
    `timeline/<role>_idle_share` (the mean over the role's procs)."""
    timeline = step_timeline(step=step, start=start, end=end, spans=spans)
    recorder.event(STEP_TIMELINE, **timeline)
    metrics = {f"timeline/{phase}_share": value for phase, value in timeline["shares"].items()}
    idle_by_role: dict[str, list[float]] = {}
    for lane, idle in timeline["idle"].items():
        idle_by_role.setdefault(lane.partition(" ")[0], []).append(idle)
    metrics.update({f"timeline/{role}_idle_share": sum(v) / len(v) for role, v in idle_by_role.items()})
    return metrics
