"""Where a step's time goes (#17 item 5): spans moved onto the controller's clock, the step's timeline (lanes in a
stable order, offsets, each phase's share with overlaps counted once, each proc's idle share, the span limit), what
the wire takes, and the timelines the single-process and Monarch GRPO recipes record."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC, phases_on, recorded_timelines
from workers.engine.control_plane import record_to_wire
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.telemetry_wire import (MAX_TIMELINE_NAME_CHARS, MAX_TIMELINE_PHASES, MAX_TIMELINE_SPANS,
                                           StepTimeline, WireEvent)
from workers.engine.timeline import (WorkSpans, lane_key, on_call_clock, phase_seconds, record_step_timeline,
                                     step_timeline)
from workers.engine.training import PhaseTimer


def test_a_proc_span_inside_the_call_window_keeps_its_times() -> None:
    assert on_call_clock([("generate", 10.2, 10.8)], sent=10.0, answered=11.0) == [("generate", 10.2, 10.8)]
    assert on_call_clock([], sent=10.0, answered=11.0) == []


def test_a_proc_whose_clock_runs_ahead_or_behind_is_shifted_into_the_call_window_as_a_whole() -> None:
    ahead = on_call_clock([("load", 15.0, 15.2), ("generate", 15.2, 15.9)], sent=10.0, answered=11.0)
    assert ahead == [("load", pytest.approx(10.1), pytest.approx(10.3)), ("generate", pytest.approx(10.3), 11.0)]
    behind = on_call_clock([("generate", 4.0, 4.5)], sent=10.0, answered=11.0)
    assert behind == [("generate", 10.0, pytest.approx(10.5))]
    # work longer than the window (a clock that also runs fast): starts at the send, clipped at the answer
    assert on_call_clock([("generate", 0.0, 3.0)], sent=10.0, answered=11.0) == [("generate", 10.0, 11.0)]


def test_lanes_sort_controller_first_then_roles_then_ranks_numerically() -> None:
    lanes = ["reference", "generator 10", "trainer 1", "zeta", "generator 2", "controller", "reward", "trainer 0",
             "process"]
    assert sorted(lanes, key=lane_key) == ["controller", "process", "trainer 0", "trainer 1", "generator 2",
                                           "generator 10", "reward", "reference", "zeta"]


def test_work_spans_time_each_phase_by_the_wall_clock() -> None:
    spans = WorkSpans()
    with spans.span("forward_backward"):
        pass
    with pytest.raises(RuntimeError), spans.span("optimizer"):
        raise RuntimeError("the span still ends")
    assert [phase for phase, _, _ in spans.items] == ["forward_backward", "optimizer"]
    assert all(end >= start for _, start, end in spans.items)
    assert phase_seconds(spans.items, "forward_backward") >= 0.0 and phase_seconds(spans.items, "absent") == 0.0
    assert phase_seconds([("generate", 1.0, 1.5), ("weight_load", 0.0, 9.0), ("generate", 2.0, 2.25)],
                         "generate") == 0.75


def test_a_step_timeline_counts_overlapping_work_once_and_leaves_the_controller_out_of_the_shares() -> None:
    start = 1_000.0
    spans = [
        ("controller", "generate_wait", start, start + 0.6), ("controller", "train", start + 0.6, start + 1.0),
        ("generator 0", "generate", start - 0.3, start + 0.3),  # ran during the step before, for this one
        ("generator 1", "generate", start + 0.1, start + 0.5),
        ("trainer 0", "forward_backward", start + 0.6, start + 0.9), ("trainer 0", "optimizer", start + 0.9, start + 1.0),
        ("trainer 0", "blip", start + 0.2, start + 0.20005),  # shorter than MIN_SPAN_S
    ]
    timeline = step_timeline(step=3, start=start, end=start + 1.0, spans=spans)
    assert timeline["lanes"] == ["controller", "trainer 0", "generator 0", "generator 1"]
    assert timeline["step"] == 3 and timeline["seconds"] == 1.0 and timeline["truncated"] == 0
    assert [0, "generate_wait", 0.0, 0.6] in timeline["spans"]
    assert [2, "generate", -0.3, 0.3] in timeline["spans"], "a span from the step before starts below 0"
    assert not any(phase == "blip" for _, phase, _, _ in timeline["spans"])
    # generate: the union of [-0.3, 0.3] and [0.1, 0.5], counted once, the part before the step included
    assert timeline["shares"] == {"forward_backward": 0.3, "generate": 0.8, "optimizer": 0.1}
    assert timeline["idle"] == {"trainer 0": 0.6, "generator 0": 0.4, "generator 1": 0.6}
    longer = step_timeline(step=3, start=start, end=start + 1.0,
                           spans=[("generator 0", "generate", start - 1.0, start + 0.5)])
    assert longer["shares"] == {"generate": 1.0} and longer["idle"] == {"generator 0": 0.0}, "at most the whole step"
    StepTimeline.model_validate(timeline)


def test_a_step_timeline_keeps_the_longest_spans_under_the_limit_and_cleans_names() -> None:
    many = [("trainer 0", f"micro_{i}", 100.0 + i * 0.001, 100.0 + i * 0.001 + 0.0005 + (i % 7) * 1e-5)
            for i in range(MAX_TIMELINE_SPANS + 50)]
    long_name = "x\x00" + "y" * 200
    timeline = step_timeline(step=1, start=100.0, end=104.0, spans=[*many, (long_name, "phase\n", 100.0, 100.5)])
    assert len(timeline["spans"]) == MAX_TIMELINE_SPANS and timeline["truncated"] == 51
    assert [lane for lane in timeline["lanes"] if lane != "trainer 0"] == [("x?" + "y" * 200)[:MAX_TIMELINE_NAME_CHARS]]
    assert any(phase == "phase?" for _, phase, _, _ in timeline["spans"]), "the longest span is kept, its name cleaned"
    assert len(timeline["shares"]) == MAX_TIMELINE_PHASES and timeline["shares"]["phase?"] == 0.125, "the largest"
    StepTimeline.model_validate(timeline)


def test_the_recorded_timeline_goes_over_the_wire_with_its_metrics() -> None:
    sink = MemorySink()
    metrics = record_step_timeline(Recorder([sink]), step=2, start=50.0, end=52.0, spans=[
        ("trainer 0", "forward_backward", 50.0, 51.0), ("trainer 1", "forward_backward", 50.0, 50.5),
        ("generator 0", "generate", 50.0, 52.0)])
    assert metrics == {"timeline/forward_backward_share": 0.5, "timeline/generate_share": 1.0,
                       "timeline/trainer_idle_share": 0.625, "timeline/generator_idle_share": 0.0}
    [record] = sink.events("step_timeline")
    section, item = record_to_wire(record)
    assert section == "events" and item["kind"] == "step_timeline"
    event = WireEvent.model_validate(item)
    assert event.payload["step"] == 2 and event.payload["lanes"] == ["trainer 0", "trainer 1", "generator 0"]


def test_a_phase_timer_times_calls_on_a_procs_lane_and_records_its_timeline() -> None:
    timer, sink = PhaseTimer(), MemorySink()
    with timer.phase("reward"), timer.span_on("reward", "reward"):
        time.sleep(0.002)  # longer than the shortest span drawn
    with pytest.raises(RuntimeError), timer.span_on("reference", "reference"):
        time.sleep(0.002)
        raise RuntimeError("a failed call is still drawn")
    assert [(lane, phase) for lane, phase, _, _ in timer.spans] == [
        ("reward", "reward"), ("controller", "reward"), ("reference", "reference")]
    timer.add_ranks([{"spans": [("forward_backward", 0.0, 1.0)]}])  # no "train" phase: no trainer lane
    metrics = timer.record_timeline(Recorder([sink]), step=4)
    [record] = sink.events("step_timeline")
    assert record["step"] == 4 and record["lanes"] == ["controller", "reward", "reference"]
    assert set(metrics) <= {"timeline/reward_share", "timeline/reference_share", "timeline/reward_idle_share",
                            "timeline/reference_idle_share"}


def test_a_phase_timer_adds_a_procs_spans_on_its_clock() -> None:
    timer = PhaseTimer()
    with timer.phase("generate_wait"):
        pass
    timer.add_proc("generator 0", [("generate", 0.0, 0.001)], sent=timer.start, answered=timer.start + 1.0)
    timer.add_proc("generator 1", "not a list of spans", sent=timer.start, answered=timer.start + 1.0)
    lanes = [lane for lane, *_ in timer.spans]
    assert lanes == ["controller", "generator 0"]
    _, _, start, end = timer.spans[1]
    assert start == timer.start and end == pytest.approx(timer.start + 0.001)


@pytest.mark.parametrize("recipe, settings, phases", [
    ("grpo", ("trainer.batch_size=2", "grpo.group_size=2"), {"generate", "forward_backward", "optimizer"}),
    ("sft", ("trainer.batch_size=4", "trainer.micro_batch_size=2"), {"data", "forward_backward", "optimizer"}),
])
def test_a_single_process_recipe_records_a_timeline_a_step(tiny_trainable_qwen3: Path, make_config, recipe: str,
                                                           settings: tuple[str, ...], phases: set[str]) -> None:
    sink = MemorySink()
    config = make_config(recipe, tiny_trainable_qwen3, *ARITHMETIC, "data.eval_size=8", "trainer.steps=2", *settings,
                         "eval.every_steps=0")
    (train_grpo if recipe == "grpo" else train_sft)(config, Recorder([sink]))
    timelines = recorded_timelines(sink)
    assert [t["step"] for t in timelines] == [1, 2]
    for timeline in timelines:
        assert timeline["lanes"] == ["process"]
        drawn = phases_on(timeline, "process")
        assert phases <= drawn and "train" not in drawn, drawn
        assert 0.0 <= timeline["idle"]["process"] <= 0.5, "one process works most of its step"
        assert all(0.0 < share <= 1.0 for share in timeline["shares"].values())
        assert timeline["shares"]["forward_backward"] > timeline["shares"]["optimizer"]
    assert 0.0 < sink.last("timeline/forward_backward_share") <= 1.0


def test_every_monarch_mode_records_the_roles_lanes_a_step(monarch_mode_runs: dict[str, tuple[Any, MemorySink]]) -> None:
    for mode, (_, sink) in monarch_mode_runs.items():
        timelines = recorded_timelines(sink)
        assert [t["step"] for t in timelines] == list(range(1, 7)), mode
        for timeline in timelines:
            lanes = timeline["lanes"]
            assert lanes[0] == "controller" and {"trainer 0", "generator 0", "reward"} <= set(lanes), (mode, lanes)
            assert {"forward_backward", "optimizer"} <= phases_on(timeline, "trainer 0"), mode
            trainer = timeline["lanes"].index("trainer 0")
            work = {phase: (start, end) for at, phase, start, end in timeline["spans"] if at == trainer}
            assert work["optimizer"][0] >= work["forward_backward"][1] - 1e-3, f"{mode}: the update follows the backward"
            assert work["optimizer"][1] > work["optimizer"][0], mode
            assert "generate" in phases_on(timeline, "generator 0"), mode
            assert all(0.0 <= v <= 1.0 for v in [*timeline["shares"].values(), *timeline["idle"].values()]), mode
            assert "controller" not in timeline["idle"]
            for _, _, start, end in timeline["spans"]:
                assert end >= start and end <= timeline["seconds"] + 1e-3, (mode, start, end)
        # only async has a generation in flight while the trainer trains: the controller scores it then, every step
        scored_ahead = ["score_ahead" in phases_on(t, "controller") for t in timelines]
        assert scored_ahead == [mode == "async"] * len(timelines), (mode, scored_ahead)
        if mode != "sync":  # generation overlaps training: the generator works in every step it is not waited on
            assert all(t["idle"]["generator 0"] < 0.95 for t in timelines), (mode, [t["idle"] for t in timelines])
        assert any("weight_load" in phases_on(t, "generator 0") for t in timelines[1:]), \
            f"{mode}: the replica loads the trainer's weights between steps"
        assert 0.0 <= sink.last("timeline/trainer_idle_share") <= 1.0
