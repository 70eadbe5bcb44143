"""Monarch GRPO over two hosts that are real Monarch worker processes on this machine.

One run (tiny SFT'd Qwen3, 6 steps) carries every check: the trainer starts on host1,
generator replica 0 on host0 and replica 1 on host1; after step 1 replica 0 moves to host1;
after step 3 host1 is killed whole (SIGKILL to the worker and its procs), which takes the
trainer, both generator replicas, the reward, the reference (colocated with the trainer) and the
control proc (dataset and replay buffer) with it. The trainer restores the step-2 checkpoint on host0, the control proc
starts there again from the same checkpoint, the replicas are replaced there, and the run
finishes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.results import GrpoResult
from workers.engine.run_control import RunControl

pytestmark = pytest.mark.slow


def ancestors(pid: int) -> list[int]:
    """pid's parent, grandparent, ... as this machine's /proc has them now."""
    chain = []
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


class HostScript:
    """Between steps: look at where replicas run, move one, kill a host; keeps what it saw."""

    def __init__(self, workers: list[Any], sink: MemorySink):
        self.workers = {w.name: w for w in workers}
        self.sink = sink
        self.control: RunControl | None = None
        self.seen: dict[str, dict[str, str | None]] = {}  # when -> replica -> the worker its proc descends from
        self.outcomes: list[tuple[int, str, Any]] = []
        self.killed_at: float | None = None
        self.done: set[int] = set()

    def worker_of(self, pid: int) -> str | None:
        chain = ancestors(pid)
        return next((name for name, w in self.workers.items() if w.pid in chain), None)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.sink.records if r["kind"] == "event" and r["name"] == name]

    def poll(self, handler) -> int:  # noqa: ANN001
        step = self.control._step
        if step in self.done:  # after the trainer's restore, steps 3.. end a second time
            return 0
        self.done.add(step)
        if step == 1:
            applied = self.events("placement_applied")[0]
            self.seen["start"] = {index: self.worker_of(pids[0]) for index, pids in applied["pids"].items()}
            self.seen["trainer"] = {"start": self.worker_of(self.events("meshes_ready")[0]["trainer_pids"][0])}
            self.outcomes.append((step, "move", handler("placement_change", {"action": "move", "replica": 0, "host": "host1"})))
            return 1
        if step == 2:
            moved = self.events("placement_changed")[-1]
            self.seen["moved"] = {str(moved["replica"]): self.worker_of(moved["pids"][0])}
        if step == 3:
            from workers.engine.actors.local_workers import kill_host

            self.killed_at = time.time()
            kill_host(self.workers["host1"])
        if step == 6:  # the last: host1's replicas come back on host0 while the run goes on, in the steps after the kill
            self.seen["replaced"] = {str(e["replica"]): self.worker_of(e["pids"][0])
                                     for e in self.events("replica_replaced") if e["role"] == "generator"}
            restored = next(e for e in self.events("replica_replaced") if e["role"] == "trainer")
            self.seen["trainer"]["restored"] = self.worker_of(restored["pids"][0])
        return 0


@pytest.fixture(scope="module")
def two_host_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[GrpoResult, list[dict[str, Any]], HostScript, list[int]]:
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.actors.local_workers import environment_value, local_workers

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-hosts")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.local_hosts=2",
        "placement.trainer.hosts=[host1, host0]", "placement.reward.hosts=[host1, host0]", "trainer.recover_failures=1",
        "reference.enabled=true", "grpo.kl_coef=0.05", "placement.reference.colocate_with=trainer",
        "placement.replay_buffer.hosts=[host1, host0]",
        "trainer.ranks=1", "generator.replicas=2", "generator.routing=round_robin", "trainer.steps=6",
        "trainer.batch_size=4", "trainer.micro_batch_size=8", "grpo.group_size=4", "eval.every_steps=0",
        f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=2", "failover.call_timeout_s=90",
        "failover.max_replacements=2", "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    with local_workers(count=2, log_dir=root / "workers") as workers:
        worker_pids = [w.pid for w in workers]
        script = HostScript(workers, sink)
        control = RunControl(script, poll_seconds=0.0)
        script.control = control
        result = train_grpo_monarch(config, Recorder([sink]), control=control,
                                    workers=parse_workers(environment_value(workers)))
    return result, [r for r in sink.records if r["kind"] == "event"], script, worker_pids


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"] == name]


def test_generator_replicas_live_in_different_worker_processes(two_host_run) -> None:
    _, events, script, _ = two_host_run
    assert script.seen["start"] == {"0": "host0", "1": "host1"}
    assert _named(events, "placement_applied")[0]["plan"] == {"0": "host0", "1": "host1"}


def test_a_moved_replica_runs_on_its_new_host_and_serves(two_host_run) -> None:
    result, events, script, _ = two_host_run
    changed = _named(events, "placement_changed")
    assert [(e["action"], e["replica"], e["host"]) for e in changed] == [("move", 0, "host1")]
    assert changed[0]["plan"] == {"0": "host1", "1": "host1"}
    assert script.seen["moved"] == {"0": "host1"}
    # replica 0 was replaced by the move (its count restarts at 0) and served on host1 at steps 2-3
    assert result.metrics[2]["generator/replica_0_requests"] > 0
    assert result.metrics[-1]["faults/migrations"] == 1


def test_a_killed_host_loses_each_replica_once_and_they_come_back_elsewhere(two_host_run) -> None:
    result, events, script, _ = two_host_run
    detected = _named(events, "failure_detected")
    assert Counter((e["role"], e["replica"], e["host"]) for e in detected) == Counter(
        {("generator", 0, "host1"): 1, ("generator", 1, "host1"): 1, ("trainer", None, "host1"): 1,
         ("reward", 0, "host1"): 1, ("reference", 0, "host1"): 1, ("replay_buffer", None, "host1"): 1})
    # noticed by the probe of host1's port (or /proc) within seconds, not after the 60 s call timeout
    after_kill = [(round(e["time"] - script.killed_at, 2), e["name"], e.get("replica"), e.get("reason") or e.get("text"))
                  for e in events if e["time"] > script.killed_at]
    assert all(0.0 < e["time"] - script.killed_at < 10.0 for e in detected), after_kill
    lost = [e for e in _named(events, "message") if "is unreachable" in e["text"]]
    assert len(lost) == 1 and lost[0]["text"].startswith("host host1 (tcp://127.0.0.1:")
    replaced = [e for e in _named(events, "replica_replaced") if e["role"] != "trainer"]
    assert sorted((e["role"], e["replica"], e["host"]) for e in replaced) == [
        ("generator", 0, "host0"), ("generator", 1, "host0"), ("reference", 0, "host0"), ("replay_buffer", None, "host0"),
        ("reward", 0, "host0")]
    assert script.seen["replaced"] == {"0": "host0", "1": "host0"}
    recovered = _named(events, "recovered")
    assert sorted((e["role"], e["replica"] or 0, e["action"]) for e in recovered) == [
        ("generator", 0, "replaced"), ("generator", 1, "replaced"), ("reference", 0, "replaced"),
        ("replay_buffer", 0, "restored_checkpoint"), ("reward", 0, "replaced"), ("trainer", 0, "restored_checkpoint")]
    print("host kill: detected after", [round(e["time"] - script.killed_at, 2) for e in detected], "s; recovered in",
          [e["time_to_recover_s"] for e in recovered], "s; attach:",
          [e["text"] for e in _named(events, "message") if e["text"].startswith("attached")])
    # replacements come up one after the other (~10 s each on 2 busy cores), before a call would have timed out (90 s)
    assert all(0.0 < e["time_to_recover_s"] < 90.0 for e in recovered), after_kill
    # training went on to the end; every sample trained once
    assert result.step == 6
    ids = [sample for step in sorted(result.trained_samples) for sample in result.trained_samples[step]]
    assert len(ids) == len(set(ids)) == 6 * 4
    assert result.metrics[-1]["faults/replacements"] == 4
    assert all("kl" in m for m in result.metrics)  # the replaced reference served the steps after the kill


def test_the_trainer_of_a_killed_host_restores_its_checkpoint_on_the_other_host(two_host_run) -> None:
    result, events, script, _ = two_host_run
    assert _named(events, "meshes_ready")[0]["trainer_host"] == "host1"
    assert script.seen["trainer"] == {"start": "host1", "restored": "host0"}
    trainer = next(e for e in _named(events, "recovered") if e["role"] == "trainer")
    assert trainer["path"].endswith("step_000002") and trainer["steps_lost"] == 1
    # step 3 was trained on host1, lost with it, and trained again on host0
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3, 3, 4, 5, 6]
    assert result.metrics[-1]["faults/steps_lost"] == 1


def test_no_worker_process_or_proc_is_left(two_host_run) -> None:
    from workers.engine.actors.local_workers import session_pids

    _, _, _, worker_pids = two_host_run
    assert all(not session_pids(pid) for pid in worker_pids)
    listed = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in listed.splitlines() if "run_worker_loop_forever" in line and f" {os.getpid()}" in line]


def test_workers_stop_when_the_run_fails_before_it_starts(tmp_path: Path) -> None:
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.config import ConfigError, load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.actors.local_workers import environment_value, local_workers, session_pids

    config = load_config("recipe: grpo\nmodel: {path: /nowhere}\n", overrides=[
        "placement.backend=monarch", "placement.generator.hosts=[host0, gpu7]"])
    with pytest.raises(ConfigError) as caught, local_workers(count=1, log_dir=tmp_path) as workers:
        assert session_pids(workers[0].pid) == [workers[0].pid]  # serving, nothing spawned yet
        train_grpo_monarch(config, Recorder(), workers=parse_workers(environment_value(workers)))
    assert str(caught.value) == "placement.generator.hosts: unknown host 'gpu7'; hosts: host0"
    assert workers[0].process.returncode is not None and not session_pids(workers[0].pid)


def test_the_engine_cli_starts_local_hosts_for_a_run_and_stops_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.actors.hosts import parse_workers, reachable, workers_from_env
    from workers.engine.cli import _local_hosts

    monkeypatch.delenv("FORGEBOARD_MONARCH_WORKERS", raising=False)
    with _local_hosts(2):
        workers = workers_from_env()
        assert [w.name for w in workers] == ["host0", "host1"] and all(reachable(w) for w in workers)
    assert "FORGEBOARD_MONARCH_WORKERS" not in os.environ and not any(reachable(w) for w in workers)
    monkeypatch.setenv("FORGEBOARD_MONARCH_WORKERS", "a=tcp://10.0.0.1:1")
    with _local_hosts(2):  # a launcher named the workers already: none are started
        assert workers_from_env() == parse_workers("a=tcp://10.0.0.1:1")
