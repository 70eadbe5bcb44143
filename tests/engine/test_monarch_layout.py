"""Placement onto processes and devices, with real Monarch worker processes as hosts on this machine.

- Procs given GPUs (`gpus_per_proc`) each get their own indices of their host, a mesh over two hosts
  that are not neighbours in the worker list gets them on both, a full host is refused naming who
  holds its GPUs, and released GPUs are handed out again.
- A GRPO run whose trainer ranks go one to a host (`placement.trainer.procs_per_host: 1`) and whose
  generator replicas are capped at one per host trains over both hosts, refuses a replica on a full
  host, and restores the trainer after a rank on the second host is killed. The drills' signals are
  sent by an agent proc on the target's host, which also keeps a slowdown's stop/continue cycle.
- A role given a GPU on a host where CUDA shows none fails the run with that reason.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC
from tests.engine.test_monarch_hosts import ancestors
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.run_control import RunControl

pytestmark = pytest.mark.slow


def _assigned(procs: Any) -> dict[tuple[int, int], tuple[int, str | None]]:
    """(host coordinate, proc coordinate) -> (pid, GPU indices), read in every proc of the mesh."""
    from workers.engine.actors.proc_gpus import ProcGpus

    probe = procs.spawn("gpus_probe", ProcGpus)
    values = probe.assigned.call().get(timeout=60)
    return {(int(point.get("hosts", 0)) if hasattr(point, "get") else 0, int(point["procs"])): value
            for point, value in values.items()}


def test_procs_hold_their_own_gpus_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.actors.devices import NoRoomForGpus
    from workers.engine.actors.mesh_stops import stop_quietly
    from workers.engine.actors.hosts import Hosts, parse_workers
    from workers.engine.actors.local_workers import environment_value, local_workers

    monkeypatch.setenv("FORGEBOARD_GPUS_PER_HOST", "3")
    with local_workers(count=3, log_dir=tmp_path) as workers:
        hosts = Hosts.attach(workers=parse_workers(environment_value(workers)), timeout_s=60)
        worker_pid = {w.name: w.pid for w in workers}
        try:
            trainer = hosts.spawn_across(hosts=["host0", "host2"], per_host=2, threads=1, gpus_per_proc=1, owner="trainer")
            seen = _assigned(trainer)
            assert {point: gpus for point, (_, gpus) in seen.items()} == {(0, 0): "0", (0, 1): "1", (1, 0): "0", (1, 1): "1"}
            assert {point: worker_pid["host0" if point[0] == 0 else "host2"] in ancestors(pid)
                    for point, (pid, _) in seen.items()} == dict.fromkeys(seen, True)

            generator = hosts.spawn_procs(host="host0", count=1, threads=1, gpus_per_proc=1, owner="generator_0_1")
            assert [gpus for _, gpus in _assigned(generator).values()] == ["2"]
            with pytest.raises(NoRoomForGpus, match=r"generator_1_2 needs 1 GPU\(s\) on host host0, which has 3 and 0 "
                                                    r"free \(held by generator_0_1: 2; trainer: 0,1\)"):
                hosts.spawn_procs(host="host0", count=1, threads=1, gpus_per_proc=1, owner="generator_1_2")
            assert (hosts.gpus_free("host0"), hosts.gpus_free("host1"), hosts.gpus_free("host2")) == (0, 3, 1)

            stop_quietly(trainer)
            hosts.release("trainer")
            again = hosts.spawn_procs(host="host0", count=2, threads=1, gpus_per_proc=1, owner="reference_0_3")
            assert sorted(gpus for _, gpus in _assigned(again).values()) == ["0", "1"]
            plain = hosts.spawn_procs(host="host1", count=1, threads=1)  # no GPUs asked: none given
            assert [gpus for _, gpus in _assigned(plain).values()] == [None]
            assert hosts.gpus.holdings() == {"generator_0_1": {"host0": [2]}, "reference_0_3": {"host0": [0, 1]}}
        finally:
            hosts.stop()


class LayoutScript:
    """Between steps: ask for a replica on a full host (refused), then kill trainer rank 1 on host1."""

    def __init__(self, workers: list[Any], sink: MemorySink) -> None:
        self.workers, self.sink = workers, sink
        self.control: RunControl | None = None
        self.outcomes: list[tuple[int, str, Any]] = []
        self.done: set[int] = set()
        self.trainer_workers: list[str | None] = []  # the worker each rank's proc descends from
        self.slowed_states: set[str] = set()  # /proc states of the slowed replica's proc while the drill runs
        self.reward_worker: str | None = None  # the worker the moved reward's proc descends from

    def worker_of(self, pid: int) -> str | None:
        chain = ancestors(pid)
        return next((w.name for w in self.workers if w.pid in chain), None)

    def poll(self, handler) -> int:  # noqa: ANN001
        step = self.control._step
        if step in self.done:
            return 0
        self.done.add(step)
        if step == 1:
            ready = next(r for r in self.sink.records if r["kind"] == "event" and r["name"] == "meshes_ready")
            self.trainer_workers = [self.worker_of(pid) for pid in ready["trainer_pids"]]
            try:
                handler("placement_change", {"action": "add", "host": "host0"})
            except ValueError as refused:
                self.outcomes.append((step, "add", str(refused)))
            self.outcomes.append((step, "kill", handler("fault_drill", {"kind": "kill", "role": "trainer", "replica": 1})))
            return 2
        if step == 2:
            applied = next(r for r in self.sink.records if r["kind"] == "event" and r["name"] == "placement_applied")
            pid = applied["pids"]["1"][0]
            self.outcomes.append((step, "slow", handler("fault_drill", {"kind": "slow_host", "role": "generator",
                                                                        "replica": 1, "duration_s": 2.0, "duty_cycle": 0.9})))
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                self.slowed_states.add(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
                time.sleep(0.02)
            return 1
        if step == 3:
            for kind, payload in (("move_reward", {"action": "move", "role": "reward", "replica": 0, "host": "host1"}),
                                  ("move_reference", {"action": "move", "role": "reference", "replica": 0, "host": "host1"}),
                                  ("drain", None)):
                try:
                    if payload is None:
                        outcome = handler("load_redirect", {"action": "drain", "host": "host1"})
                    else:
                        outcome = handler("placement_change", payload)
                except ValueError as refused:
                    outcome = str(refused)
                self.outcomes.append((step, kind, outcome))
            changed = [r for r in self.sink.records if r["kind"] == "event" and r["name"] == "placement_changed"]
            self.reward_worker = self.worker_of(changed[-1]["pids"][0]) if changed else None
            return 3
        return 0


@pytest.fixture(scope="module")
def spread_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory):
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.actors.local_workers import environment_value, local_workers

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-layout")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.local_hosts=2",
        "trainer.ranks=2", "placement.trainer.procs_per_host=1", "trainer.recover_failures=1",
        "generator.replicas=2", "placement.generator.procs_per_host=1", "reference.enabled=true", "grpo.kl_coef=0.05",
        "placement.reference.colocate_with=trainer", "trainer.steps=4", "trainer.batch_size=4",
        "trainer.micro_batch_size=8", "grpo.group_size=4", "eval.every_steps=0", f"checkpoint.folder={root / 'ckpt'}",
        "checkpoint.every_steps=1", "failover.call_timeout_s=90", "telemetry.console=false",
        "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    with local_workers(count=2, log_dir=root / "workers") as workers:
        script = LayoutScript(workers, sink)
        control = RunControl(script, poll_seconds=0.0)
        script.control = control
        result = train_grpo_monarch(config, Recorder([sink]), control=control,
                                    workers=parse_workers(environment_value(workers)))
    return result, [r for r in sink.records if r["kind"] == "event"], script


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"] == name]


def test_trainer_ranks_go_one_to_a_host(spread_run) -> None:
    result, events, script = spread_run
    ready = _named(events, "meshes_ready")[0]
    assert ready["trainer_hosts"] == ["host0", "host1"]
    assert script.trainer_workers == ["host0", "host1"]  # rank 0's proc is host0's worker's child, rank 1's host1's
    assert ready["trainer_master_addr"] == "127.0.0.1", "the ranks meet at host0's worker address, not its hostname"
    assert _named(events, "placement_applied")[0]["plan"] == {"0": "host0", "1": "host1"}  # one replica per host
    assert result.step == 4


def test_a_replica_on_a_full_host_is_refused_and_the_run_goes_on(spread_run) -> None:
    _, events, script = spread_run
    assert (1, "add", "host 'host0' has no room for another generator replica "
                      "(placement.generator.procs_per_host / gpus_per_proc)") in script.outcomes
    assert not [e for e in _named(events, "placement_changed") if e["role"] == "generator"]


def test_a_killed_rank_on_the_second_host_restores_the_trainer_over_both(spread_run) -> None:
    _, events, script = spread_run
    kill = next(outcome for _, kind, outcome in script.outcomes if kind == "kill")
    detected = [e for e in _named(events, "failure_detected") if e["role"] == "trainer"]
    recovered = [e for e in _named(events, "recovered") if e["role"] == "trainer"]
    assert [e["fault_id"] for e in detected] == [kill["fault_id"]] == [e["fault_id"] for e in recovered]
    replaced = next(e for e in _named(events, "replica_replaced") if e["role"] == "trainer")
    assert replaced["hosts"] == ["host0", "host1"] and replaced["path"] is not None
    assert Counter(e["role"] for e in _named(events, "failure_detected")) == Counter({"trainer": 1})
    injected = next(e for e in _named(events, "fault_injected") if e["fault_id"] == kill["fault_id"])
    assert injected["signalled_by"] == "agent on host1"


def test_a_slowdown_is_kept_by_the_agent_on_the_replicas_host(spread_run) -> None:
    _, events, script = spread_run
    slow = next(outcome for _, kind, outcome in script.outcomes if kind == "slow")
    injected = next(e for e in _named(events, "fault_injected") if e["fault_id"] == slow["fault_id"])
    assert injected["signalled_by"] == "agent on host1" and injected["fault_kind"] == "slow_host"
    # the whole host slows down: generator 1 and trainer rank 1 (restarted after the kill), nothing of host0
    generator_1 = _named(events, "placement_applied")[0]["pids"]["1"][0]
    trainer = next(e for e in _named(events, "replica_replaced") if e["role"] == "trainer")["pids"]
    assert sorted(injected["pids"]) == sorted([generator_1, trainer[1]])
    assert "T" in script.slowed_states  # stopped by the agent's cycle; it ran in between (R or S)
    assert script.slowed_states - {"T"}
    recovered = [e for e in _named(events, "recovered") if e["fault_id"] == slow["fault_id"]]
    assert len(recovered) == 1 and recovered[0]["caused_failure"] is False


def test_a_gpu_where_cuda_shows_none_fails_the_run_with_the_reason(sft_warm_start: tuple[Path, float],
                                                                   tmp_path: Path) -> None:
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "placement.backend=monarch", "placement.generator.gpus_per_proc=1", "trainer.steps=1",
        "trainer.batch_size=2", "grpo.group_size=2", "eval.every_steps=0", f"checkpoint.folder={tmp_path}",
        "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    with pytest.raises(Exception, match="given GPU 0 of its host .* but CUDA shows it 0"):
        train_grpo_monarch(config, Recorder([MemorySink()]), workers=[])


def test_a_reward_replica_moves_host_and_a_colocated_role_stays_with_its_role(spread_run) -> None:
    result, events, script = spread_run
    outcomes = {kind: outcome for step, kind, outcome in script.outcomes if step == 3}
    assert outcomes["move_reward"]["plan"] == {"0": "host1"} and outcomes["move_reward"]["role"] == "reward"
    assert script.reward_worker == "host1"  # its new proc is host1's worker's child
    changed = [e for e in _named(events, "placement_changed") if e["role"] == "reward"]
    assert [(e["action"], e["replica"], e["host"]) for e in changed] == [("move", 0, "host1")]
    assert outcomes["move_reference"] == "the reference follows the trainer's hosts (placement.reference.colocate_with)"
    # host0 already holds a generator replica, and procs_per_host is 1: nothing moves, host1 is not drained
    assert outcomes["drain"] == ("no other undrained host has room for 'host1''s 1 generator replica(s) (hosts host0; "
                                 "placement.generator.procs_per_host / gpus_per_proc)")
    assert not _named(events, "redirect_started")
    assert result.metrics[-1]["faults/migrations"] == 1 and result.step == 4


class DrainScript:
    """After step 1: drain host1 (its generator and reward replicas move to host0); after step 2: undrain it."""

    def __init__(self) -> None:
        self.control: RunControl | None = None
        self.outcomes: dict[int, Any] = {}

    def poll(self, handler) -> int:  # noqa: ANN001
        step = self.control._step
        if step in self.outcomes or step not in (1, 2):
            return 0
        self.outcomes[step] = handler("load_redirect", {"action": "drain" if step == 1 else "undrain", "host": "host1"})
        return 1


def test_a_drain_moves_every_role_off_the_host(sft_warm_start: tuple[Path, float], tmp_path: Path) -> None:
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.actors.local_workers import environment_value, local_workers

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.local_hosts=2",
        "placement.trainer.hosts=[host0]", "placement.reward.hosts=[host1, host0]", "generator.replicas=2",
        "trainer.steps=3", "trainer.batch_size=4", "grpo.group_size=4", "eval.every_steps=0",
        f"checkpoint.folder={tmp_path / 'ckpt'}", "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    script = DrainScript()
    with local_workers(count=2, log_dir=tmp_path / "workers") as workers:
        control = RunControl(script, poll_seconds=0.0)
        script.control = control
        result = train_grpo_monarch(config, Recorder([sink]), control=control,
                                    workers=parse_workers(environment_value(workers)))
    events = [r for r in sink.records if r["kind"] == "event"]
    started = _named(events, "redirect_started")
    assert [(e["host"], e["replicas"], e["reward_replicas"]) for e in started] == [("host1", [1], [0])]
    drained = script.outcomes[1]
    assert drained["moved"] == {"1": "host0"} and drained["moved_roles"] == {"reward": {"0": "host0"}}
    assert drained["plan"] == {"0": "host0", "1": "host0"}
    assert script.outcomes[2]["plan"] == {"0": "host0", "1": "host0"}  # undrained: nothing moves back by itself
    assert result.step == 3 and result.metrics[-1]["faults/migrations"] == 2


class HostLossScript:
    """After step 1: host1 is lost whole (its worker and procs SIGKILLed)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = {w.name: w for w in workers}
        self.control: RunControl | None = None
        self.killed = False

    def poll(self, handler) -> int:  # noqa: ANN001
        if self.control._step == 1 and not self.killed:
            from workers.engine.actors.local_workers import kill_host

            self.killed = True
            kill_host(self.workers["host1"])
        return 0


def test_a_replica_with_no_host_that_has_room_fails_the_run_with_the_reason(sft_warm_start: tuple[Path, float],
                                                                          tmp_path: Path) -> None:
    """host1 takes generator replica 1 with it; host0 already holds its one generator (procs_per_host: 1)."""
    from workers.engine.actors.calls import ProcFailure
    from workers.engine.actors.hosts import parse_workers
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch
    from workers.engine.actors.local_workers import environment_value, local_workers

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "placement.local_hosts=2",
        "placement.trainer.hosts=[host0]", "placement.reward.hosts=[host0]", "placement.replay_buffer.hosts=[host0]",
        "generator.replicas=2", "placement.generator.procs_per_host=1", "trainer.steps=4", "trainer.batch_size=4",
        "grpo.group_size=4", "eval.every_steps=0", f"checkpoint.folder={tmp_path / 'ckpt'}", "telemetry.console=false",
        "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    with local_workers(count=2, log_dir=tmp_path / "workers") as workers:
        script = HostLossScript(workers)
        control = RunControl(script, poll_seconds=0.0)
        script.control = control
        with pytest.raises(ProcFailure) as caught:
            train_grpo_monarch(config, Recorder([sink]), control=control,
                               workers=parse_workers(environment_value(workers)))
    assert str(caught.value) == ("generator replica 1 has no host with room left on host0 "
                                 "(placement.generator.procs_per_host / gpus_per_proc)")
    events = [r for r in sink.records if r["kind"] == "event"]
    lost = [e for e in _named(events, "failure_detected") if e.get("role") == "generator"]
    assert [e["replica"] for e in lost] == [1], "the loss was detected once before the run gave up"
