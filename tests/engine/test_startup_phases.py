"""What a run does before its first step: `startup_phase` events in order, with their timings, ending with
"ready" before the first step's metrics, from the SFT, single-process GRPO and Monarch GRPO recipes."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.startup import StartupPhases


def _phases(sink: MemorySink) -> list[dict[str, Any]]:
    return [r for r in sink.records if r["kind"] == "event" and r["name"] == "startup_phase"]


def _check_phases(sink: MemorySink, expected: list[str]) -> list[dict[str, Any]]:
    """The phases in order, each timed from the run's start and the previous phase; all before step 1's metrics."""
    phases = _phases(sink)
    assert [p["phase"] for p in phases] == expected
    assert all(p["step"] == 0 and isinstance(p["label"], str) and p["label"] for p in phases)
    assert phases[0]["previous_s"] is None and phases[0]["elapsed_s"] >= 0.0
    for before, after in pairwise(phases):
        assert after["elapsed_s"] >= before["elapsed_s"] and after["previous_s"] >= 0.0
        assert after["previous_s"] == pytest.approx(after["elapsed_s"] - before["elapsed_s"], abs=2e-3)
    assert phases[-1]["label"] == "ready"
    first_step_metric = next(r["seq"] for r in sink.records if r["kind"] == "metric" and r["step"] == 1)
    assert phases[-1]["seq"] < first_step_metric
    return phases


def test_startup_phases_time_each_phase_from_the_previous_one() -> None:
    now = [10.0]
    sink = MemorySink()
    phases = StartupPhases(Recorder([sink]), clock=lambda: now[0])
    now[0] = 10.5
    phases.enter("placing", "placing roles on hosts")
    now[0] = 12.0
    phases.enter("loading_model", "loading the model")
    now[0] = 15.25
    phases.ready()
    assert [{k: r[k] for k in ("name", "step", "phase", "label", "elapsed_s", "previous_s")} for r in sink.records] == [
        {"name": "startup_phase", "step": 0, "phase": "placing", "label": "placing roles on hosts", "elapsed_s": 0.5,
         "previous_s": None},
        {"name": "startup_phase", "step": 0, "phase": "loading_model", "label": "loading the model", "elapsed_s": 2.0,
         "previous_s": 1.5},
        {"name": "startup_phase", "step": 0, "phase": "ready", "label": "ready", "elapsed_s": 5.25, "previous_s": 3.25},
    ]
    assert phases.seconds == {"placing": 1.5, "loading_model": 3.25}


def test_parts_of_a_phase_are_timed_as_each_is_done_and_reported_with_the_next_phase() -> None:
    now = [0.0]
    sink = MemorySink()
    phases = StartupPhases(Recorder([sink]), clock=lambda: now[0])
    phases.enter("loading_model", "loading the model")
    asked: list[tuple[str, float]] = []

    def part(name: str, done_at: float):
        def done(wait_s: float) -> bool:
            asked.append((name, wait_s))
            now[0] += wait_s  # waiting takes the time given
            return now[0] >= done_at
        return done

    phases.await_parts({"trainer": part("trainer", 0.5), "data": part("data", 0.1)}, poll_s=0.05)
    # within one round of asks (poll_s for each part still waiting) of when each was done
    assert phases.parts == {"data": pytest.approx(0.1), "trainer": pytest.approx(0.5, abs=2 * 0.05)}
    assert {wait for _, wait in asked} == {0.05} and asked.count(("data", 0.05)) == 1  # data done at its first ask
    phases.ready()
    ready = sink.records[-1]
    assert ready["phase"] == "ready" and phases.parts == {}  # the next phase starts with none
    assert set(ready["previous_parts"]) == {"trainer", "data"} and ready["previous_parts"]["trainer"] <= ready["previous_s"]
    assert sink.records[0]["previous_parts"] == {}

    def failed(wait_s: float) -> bool:
        raise RuntimeError("the trainer proc exited")

    phases = StartupPhases(Recorder())
    phases.enter("loading_model", "loading the model")
    with pytest.raises(RuntimeError, match="proc exited"):
        phases.await_parts({"trainer": failed})


def test_startup_phases_refuse_an_unknown_or_backward_phase() -> None:
    phases = StartupPhases(Recorder())
    phases.enter("loading_model", "loading the model")
    with pytest.raises(ValueError, match="cannot follow 'loading_model'"):
        phases.enter("spawning_procs", "spawning 1 procs on this machine")
    with pytest.raises(ValueError, match="unknown startup phase 'compiling'"):
        phases.enter("compiling", "compiling")


def test_sft_run_reports_its_startup_before_the_first_step(tiny_trainable_qwen3: Path, make_config) -> None:
    sink = MemorySink()
    config = make_config("sft", tiny_trainable_qwen3, *ARITHMETIC, "data.eval_size=8", "trainer.steps=2",
                         "trainer.batch_size=4", "eval.every_steps=2")
    train_sft(config, Recorder([sink]))
    phases = _check_phases(sink, ["loading_model", "ready"])
    assert phases[0]["label"] == "loading the model and data" and phases[1]["previous_s"] > 0.0
    # the step-0 held-out evaluation comes after "ready"
    first_eval = next(r["seq"] for r in sink.records if r["kind"] == "metric" and r["key"] == "eval/nll")
    assert phases[-1]["seq"] < first_eval


def test_grpo_run_reports_its_startup_before_the_first_step(tiny_trainable_qwen3: Path, make_config) -> None:
    sink = MemorySink()
    config = make_config("grpo", tiny_trainable_qwen3, *ARITHMETIC, "data.eval_size=8", "trainer.steps=2",
                         "trainer.batch_size=2", "grpo.group_size=2", "eval.every_steps=0", "reference.enabled=true")
    train_grpo(config, Recorder([sink]))
    _check_phases(sink, ["loading_model", "ready"])


@pytest.mark.slow
def test_monarch_run_reports_placing_spawning_and_loading(monarch_mode_runs: dict[str, tuple[Any, MemorySink]]) -> None:
    _, sink = monarch_mode_runs["sync"]
    phases = _check_phases(sink, ["placing", "spawning_procs", "loading_model", "ready"])
    # trainer rank, generator, reward and the dataset / replay buffer proc
    assert [p["label"] for p in phases] == ["placing roles on hosts", "spawning 4 procs on this machine",
                                            "loading the model", "ready"]
    # meshes_ready (kept: its seconds count from after placing) comes while loading, before "ready"
    meshes = next(r for r in sink.records if r["kind"] == "event" and r["name"] == "meshes_ready")
    assert phases[2]["seq"] < meshes["seq"] < phases[3]["seq"]
    assert 0.0 < meshes["seconds"] <= phases[3]["elapsed_s"] + 0.01
    # each role's procs ready so many seconds into loading the model, none after the phase ended
    parts = phases[3]["previous_parts"]
    assert set(parts) == {"trainer", "generator", "reward", "data"}
    assert all(0.0 < seconds <= phases[3]["previous_s"] for seconds in parts.values())
    assert max(parts.values()) == pytest.approx(phases[3]["previous_s"], abs=0.5)  # the phase ends with the last


@pytest.mark.slow
def test_a_monarch_run_ends_with_every_proc_it_started_gone(monarch_mode_runs: dict[str, tuple[Any, MemorySink]]) -> None:
    from workers.engine.actors.calls import exited

    for mode, (_, sink) in monarch_mode_runs.items():
        meshes = next(r for r in sink.records if r["kind"] == "event" and r["name"] == "meshes_ready")
        placed = next(r for r in sink.records if r["kind"] == "event" and r["name"] == "placement_applied")
        pids = [*meshes["trainer_pids"], *(pid for replica in placed["pids"].values() for pid in replica)]
        assert len(pids) == 2 and all(exited(pid) for pid in pids), (mode, pids)
