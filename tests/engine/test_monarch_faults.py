"""Fault drills and failover on a running Monarch GRPO run (real procs, the tiny SFT'd Qwen3).

One run carries every drill and operator command, at different steps, so one set of process
meshes proves each of them:
  step 2  kill generator 1        step 3  raise in generator 0     step 4  hang generator 0
  step 5  kill reward             step 6  raise in reference and in the trainer
  step 7  latency on generator 1, bandwidth on generator 0, slow_host on generator 1
and, between steps, operator commands through RunControl: add a generator on host c (after
step 1), bad requests (after step 2), drain host a (after step 5), a raise by command (after
step 8), and a trainer kill by command between steps (after step 9: back to the step-8 checkpoint).

A second, shorter run keeps warm spares (`failover.warm_spares=1`): a killed generator is
replaced by its spare, and a hung trainer is killed and restored from its last checkpoint.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC
from workers.engine.actors.calls import exited
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.results import GrpoResult
from workers.engine.run_control import RunControl

pytestmark = pytest.mark.slow

DRILLS = """
drills:
  - {kind: kill, role: generator, replica: 1, schedule: {at_step: 2}}
  - {kind: raise, role: generator, replica: 0, schedule: {at_step: 3}}
  - {kind: hang, role: generator, replica: 0, duration_s: 60, schedule: {at_step: 4}}
  - {kind: kill, role: reward, schedule: {at_step: 5}}
  - {kind: raise, role: reference, schedule: {at_step: 6}}
  - {kind: raise, role: trainer, schedule: {at_step: 6}}
"""

COMMANDS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    1: [("placement_change", {"action": "add", "host": "c"})],
    2: [("fault_drill", {"kind": "kill", "role": "generator", "replica": 9}),
        ("fault_drill", {"kind": "kill", "role": "reference", "replica": 3}),
        ("placement_change", {"action": "move", "replica": 0, "host": "nowhere"}),
        ("placement_change", {"action": "remove", "replica": 7}),
        ("load_redirect", {"action": "drain", "host": "nowhere"}),
        ("fault_drill", {"kind": "latency", "role": "generator"})],
    # Replicas 0 and 1 are replaced in the background from steps 2 and 4 (their models load while the others serve),
    # so the timed drills and the drain after them aim at replica 2: added at step 1, it serves throughout.
    3: [("fault_drill", {"kind": "bandwidth", "role": "generator", "replica": 2, "bandwidth_mbps": 50,
                         "duration_s": 2})],
    5: [("load_redirect", {"action": "drain", "host": "c"})],
    6: [("fault_drill", {"kind": "latency", "role": "generator", "replica": 2, "latency_ms": 200, "duration_s": 2}),
        ("fault_drill", {"kind": "slow_host", "role": "generator", "replica": 2, "duty_cycle": 0.5, "duration_s": 2})],
    8: [("fault_drill", {"kind": "raise", "role": "generator", "replica": 2})],
    9: [("fault_drill", {"kind": "kill", "role": "trainer"})],
}


class ScriptedChannel:
    """Hands RunControl the commands scripted for the step that just ended; keeps each outcome."""

    def __init__(self, script: dict[int, list[tuple[str, dict[str, Any]]]]):
        self.script = script
        self.control: RunControl | None = None
        self.outcomes: list[tuple[int, str, dict | str]] = []
        self.lock = threading.Lock()

    def poll(self, handler) -> int:  # noqa: ANN001
        step = self.control._step
        commands = self.script.pop(step, [])
        for kind, payload in commands:
            try:
                self.outcomes.append((step, kind, handler(kind, payload)))
            except Exception as exc:  # noqa: BLE001 - a failed command is reported, the run goes on
                self.outcomes.append((step, kind, str(exc)))
        return len(commands)


@pytest.fixture(scope="module")
def fault_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[GrpoResult, list[dict[str, Any]], ScriptedChannel]:
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-faults")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n{DRILLS}", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.generator.hosts=[a, b, c]",
        # round robin: every serving replica gets one request per generation, so each armed fault fires
        "trainer.ranks=1", "generator.replicas=2", "generator.routing=round_robin", "trainer.steps=10",
        "trainer.batch_size=6", "trainer.micro_batch_size=8", "grpo.group_size=4", "reference.enabled=true",
        "grpo.kl_coef=0.05", "eval.every_steps=0", f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=4",
        "trainer.recover_failures=1",
        "failover.call_timeout_s=10", "failover.max_replacements=4", "telemetry.console=false",
        "trainer.threads_per_process=1",
    ])
    channel = ScriptedChannel(dict(COMMANDS))
    control = RunControl(channel, poll_seconds=0.0)
    channel.control = control
    sink = MemorySink()
    result = train_grpo_monarch(config, Recorder([sink]), control=control)
    return (result, [r for r in sink.records if r["kind"] == "event"], channel,
            [r for r in sink.records if r["kind"] == "metric"])


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"] == name]


def test_every_injected_fault_is_detected_once_and_recovered_once(fault_run) -> None:
    result, events, _, _ = fault_run
    injected = _named(events, "fault_injected")
    kinds = Counter((e["fault_kind"], e["role"]) for e in injected)
    assert kinds == Counter({("kill", "generator"): 1, ("raise", "generator"): 2, ("hang", "generator"): 1,
                             ("kill", "reward"): 1, ("raise", "reference"): 1, ("raise", "trainer"): 1,
                             ("latency", "generator"): 1, ("bandwidth", "generator"): 1, ("slow_host", "generator"): 1,
                             ("kill", "trainer"): 1})
    detected = Counter(e["fault_id"] for e in _named(events, "failure_detected"))
    recovered = Counter(e["fault_id"] for e in _named(events, "recovered"))
    failing = {e["fault_id"] for e in injected if e["fault_kind"] in ("kill", "raise", "hang")}
    assert detected == Counter({fault_id: 1 for fault_id in failing}), "one detection per failing fault, none otherwise"
    assert recovered == Counter({e["fault_id"]: 1 for e in injected}), "one recovery per fault"
    for event in _named(events, "recovered"):
        assert event["time_to_recover_s"] > 0.0
        if event["caused_failure"]:
            assert event["time_to_detect_s"] is not None and event["time_to_detect_s"] >= 0.0
    # a latency fault is measured on the replica it slowed: requests it served while slowed, seconds per request
    latency = next(e for e in _named(events, "recovered") if e.get("fault_kind") == "latency")
    assert latency["during"]["requests_served"] > latency["before"]["requests_served"]
    assert latency["during"]["seconds_per_request"] > 0.0
    # the hang was declared after the call timeout, and its proc replaced
    hang = next(e for e in injected if e["fault_kind"] == "hang")
    hang_detected = next(e for e in _named(events, "failure_detected") if e["fault_id"] == hang["fault_id"])
    assert hang_detected["hung"] and 10.0 <= hang_detected["time_to_detect_s"] < 60.0
    # the training finished every step, and no sample was trained twice
    assert result.step == 10 and len(result.losses) == 11
    ids = [sample for step in sorted(result.trained_samples) for sample in result.trained_samples[step]]
    assert len(ids) == 60 and len(set(ids)) == 60
    assert result.metrics[-1]["faults/injected"] == 11 and result.metrics[-1]["faults/replacements"] == 3
    # the trainer killed after step 9 went back to the step-8 checkpoint: step 9 was trained twice, counted once
    trainer = next(e for e in _named(events, "recovered") if e["role"] == "trainer" and e["action"] == "restored_checkpoint")
    assert trainer["path"].endswith("step_000008") and trainer["steps_lost"] == 1
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 10]
    assert result.metrics[-1]["faults/steps_lost"] == 1


def test_replaced_generators_serve_the_current_policy_version(fault_run) -> None:
    _, events, _, metrics = fault_run
    replaced = [e for e in _named(events, "replica_replaced") if e["role"] == "generator"]
    assert sorted(e["replica"] for e in replaced) == [0, 1]  # the kill at step 2, the hang at step 4
    for event in replaced:
        # sync GRPO: after step N the trainer's policy is version N; the new replica reports it
        assert event["policy_version"] == event["step"]
    # the run trained on while replica 1's replacement loaded: it serves from a later step than its failure's
    killed = next(e for e in _named(events, "failure_detected") if e["role"] == "generator" and e["replica"] == 1)
    assert next(e for e in replaced if e["replica"] == 1)["step"] > killed["step"]
    assert [e["role"] for e in _named(events, "replica_replaced")].count("reward") == 1
    retried = [e for e in _named(events, "recovered") if e.get("action") == "retried"]
    assert sorted(e["role"] for e in retried) == ["generator", "generator", "reference", "trainer"]
    # a replacement's catch-up read of the weights was a point of its own beside the step's sync, at the same step
    # (the control plane kept one and reported the other as telemetry dropped): a metric has one point a step, but at
    # step 9, which the trainer's restore trained again
    points = Counter((m["key"], m["step"]) for m in metrics)
    assert {step for (_, step), count in points.items() if count > 1} <= {9}
    assert len({step for key, step in points if key == "weights/read_s"}) >= 8, "the generators' reads, step by step"


def test_placement_change_and_drain_take_effect_mid_run(fault_run) -> None:
    result, events, channel, _ = fault_run
    changed = _named(events, "placement_changed")
    assert [(e["action"], e["replica"], e["host"]) for e in changed] == [("add", 2, "c")]
    assert changed[0]["plan"] == {"0": "a", "1": "b", "2": "c"}
    started, finished = _named(events, "redirect_started"), _named(events, "redirect_finished")
    assert [(e["host"], e["replicas"]) for e in started] == [("c", [2])]
    assert finished[0]["moved"] == {"2": "a"} and "c" not in finished[0]["plan"].values()
    # replica 2 (added after step 1) served requests; after the drain nothing was placed on host c
    assert result.metrics[-1]["generator/replica_2_requests"] > 0
    assert result.metrics[-1]["faults/migrations"] == 1
    assert [outcome for step, _, outcome in channel.outcomes if step in (1, 5, 8)][0]["plan"]["2"] == "c"


def test_bad_operator_requests_fail_with_a_reason_and_the_run_goes_on(fault_run) -> None:
    result, _, channel, _ = fault_run
    failures = [outcome for step, _, outcome in channel.outcomes if step == 2]
    assert len(failures) == 6 and all(isinstance(f, str) for f in failures)
    # which generators serve right after the kill at step 2 depends on when it was noticed
    assert failures[0].startswith("generator replica 9 is not serving; serving replicas: [0, ")
    assert failures[1] == "reference replica 3 is not serving; serving replicas: [0]"
    assert failures[2] == failures[4] == "unknown host 'nowhere'; hosts: a, b, c"
    assert failures[3].startswith("generator replica 7 is not serving")
    assert failures[5] == "latency_ms: required for kind 'latency'"
    assert result.step == 10


@pytest.fixture(scope="module")
def spare_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[GrpoResult, list[dict[str, Any]]]:
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-spares")
    drills = ("drills:\n  - {kind: kill, role: generator, replica: 1, schedule: {at_step: 2}}\n"
              "  - {kind: hang, role: trainer, duration_s: 120, schedule: {at_step: 4}}\n")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n{drills}", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.generator.hosts=[a, b]",
        "trainer.ranks=1", "generator.replicas=2", "generator.routing=round_robin", "trainer.steps=5",
        "trainer.batch_size=4", "trainer.micro_batch_size=8", "grpo.group_size=4", "eval.every_steps=0",
        f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=2", "trainer.recover_failures=1",
        "failover.warm_spares=1", "failover.call_timeout_s=10",
        "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    result = train_grpo_monarch(config, Recorder([sink]))
    return result, [r for r in sink.records if r["kind"] == "event"]


def test_a_killed_generator_is_replaced_by_a_warm_spare_at_the_current_version(spare_run) -> None:
    result, events = spare_run
    # the run started with one ready spare per role, before its first step
    started = [(e["role"], e["host"], e["count"]) for e in _named(events, "spares_started") if e["step"] == 0]
    assert sorted(started) == [("generator", "a", 1), ("reward", "local", 1)], "each role's spare on its own host"
    ready_at_start = [e for e in _named(events, "spare_ready") if e["step"] == 0]
    assert sorted(e["role"] for e in ready_at_start) == ["generator", "reward"]
    spare_pid = next(e["pids"] for e in ready_at_start if e["role"] == "generator")

    killed = next(e for e in _named(events, "fault_injected") if e["fault_kind"] == "kill")
    [replaced] = [e for e in _named(events, "replica_replaced") if e["role"] == "generator"]
    assert replaced["from_spare"] is True and replaced["pids"] == spare_pid and replaced["pids"] != killed["pids"]
    assert replaced["replica"] == 1 and replaced["host"] == "a"
    assert replaced["policy_version"] == replaced["step"], "the spare got the trainer's current weights before serving"
    [recovered] = [e for e in _named(events, "recovered") if e["role"] == "generator"]
    assert recovered["fault_id"] == killed["fault_id"] and recovered["action"] == "replaced"
    # the used spare is started again in the background; the run finished every step, the spare served
    assert [e["role"] for e in _named(events, "spares_started") if e["step"] > 0] == ["generator"]
    assert result.step == 5 and result.metrics[-1]["faults/replacements"] == 1
    at_kill = next(m for m in result.metrics if m["policy_version"] == replaced["step"])
    assert result.metrics[-1]["generator/replica_1_requests"] > at_kill["generator/replica_1_requests"]


def test_a_hung_trainer_is_killed_and_restored_from_its_last_checkpoint(spare_run) -> None:
    result, events = spare_run
    hang = next(e for e in _named(events, "fault_injected") if e["fault_kind"] == "hang")
    assert hang["role"] == "trainer" and hang["step"] == 4
    [detected] = [e for e in _named(events, "failure_detected") if e["role"] == "trainer"]
    assert detected["fault_id"] == hang["fault_id"] and detected["hung"] is True
    assert 10.0 <= detected["time_to_detect_s"] < 60.0, "declared hung after failover.call_timeout_s"
    [restored] = [e for e in _named(events, "recovered") if e["role"] == "trainer"]
    assert restored["fault_id"] == hang["fault_id"] and restored["action"] == "restored_checkpoint"
    assert restored["path"].endswith("step_000002") and restored["steps_lost"] == 1
    # step 3 was trained again from the step-2 checkpoint; the stopped rank was killed, not left behind
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3, 3, 4, 5]
    assert result.metrics[-1]["faults/steps_lost"] == 1
    for pid in hang["pids"]:
        assert exited(pid), f"the hung trainer proc {pid} is still there"
