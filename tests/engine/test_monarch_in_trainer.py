"""generator.in_trainer: a sync Monarch GRPO run whose trainer ranks generate from a copy of their own weights, with no
generator procs and no weight transfer. It trains exactly as the run with a generator proc does, its copy follows
every policy move (also after the trainer is restored from a checkpoint), and its ranks share the step's groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC, phases_on, recorded_timelines
from workers.engine.metrics import MemorySink

pytestmark = pytest.mark.slow

COMPARED = ("loss", "reward/mean", "grad_norm", "data/train_tokens", "response_length/mean", "reward/std")


def _events(sink: MemorySink, name: str) -> list[dict[str, Any]]:
    return [r for r in sink.records if r["kind"] == "event" and r["name"] == name]


@pytest.fixture(scope="module")
def paired_runs(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, MemorySink]]:
    """The same sync run twice, from a model whose rewards differ within groups (so every step moves the policy):
    with a generator proc, and with generator.in_trainer."""
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    runs = {}
    for name, where in {"generator_proc": "generator.replicas=1", "in_trainer": "generator.in_trainer=true"}.items():
        root = tmp_path_factory.mktemp(f"monarch-{name}")
        config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
            *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=1", where, "grpo.mode=sync",
            "trainer.steps=5", "trainer.batch_size=8", "trainer.micro_batch_size=16", "grpo.group_size=4",
            "trainer.optimizer.lr=5e-4", "eval.every_steps=0", f"checkpoint.folder={root / 'checkpoints'}",
            "telemetry.console=false", "trainer.threads_per_process=1",
        ])
        sink = MemorySink()
        runs[name] = (train_grpo_monarch(config, Recorder([sink])), sink)
    return runs


def test_generating_in_the_trainer_trains_exactly_as_a_generator_proc_does(
        paired_runs: dict[str, tuple[Any, MemorySink]]) -> None:
    (result, _), (separate, _) = paired_runs["in_trainer"], paired_runs["generator_proc"]
    assert result.step == separate.step == 5
    moved = [m["grad_norm"] for m in separate.metrics if m["grad_norm"] > 0.0]
    assert len(moved) >= 3, "the policy moves, so a copy left behind would sample differently"
    for step, (ours, theirs) in enumerate(zip(result.metrics, separate.metrics), start=1):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)
        assert ours["mismatch/abs_max"] < 1e-4, f"step {step}: sampled by the trainer's current weights"


def test_a_run_generating_in_the_trainer_starts_no_generator_proc_and_times_its_weight_copy(
        paired_runs: dict[str, tuple[Any, MemorySink]]) -> None:
    from workers.engine.actors.calls import exited

    result, sink = paired_runs["in_trainer"]
    meshes = _events(sink, "meshes_ready")[0]
    assert meshes["generator_replicas"] == 0 and not _events(sink, "placement_applied")
    assert all(exited(pid) for pid in meshes["trainer_pids"])
    assert not [key for m in result.metrics for key in m if key.startswith("generator/replica_")]
    syncs = [m["time/weight_sync_s"] for m in result.metrics]
    assert syncs[0] == 0.0, "the first step samples the weights the copy was made from"
    assert all(s > 0.0 for s in syncs[1:]), f"each later step copies the moved policy first: {syncs}"
    timelines = recorded_timelines(sink)
    assert [t["step"] for t in timelines] == list(range(1, 6))
    for timeline in timelines:
        assert not [lane for lane in timeline["lanes"] if lane.startswith("generator")], timeline["lanes"]
        assert {"generate", "forward_backward", "optimizer"} <= phases_on(timeline, "trainer 0")
    assert all("weight_load" in phases_on(t, "trainer 0") for t in timelines[1:])


@pytest.fixture(scope="module")
def restored_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, MemorySink]:
    """Two ranks generating, a reference, and rank 1 killed before step 4 trains: back to the step-2 checkpoint."""
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.grpo_monarch import FaultDrill, train_grpo_monarch

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-in-trainer-restored")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=16", "placement.backend=monarch", "trainer.ranks=2", "generator.in_trainer=true",
        "trainer.steps=5", "trainer.batch_size=4", "trainer.micro_batch_size=8", "grpo.group_size=4",
        "trainer.optimizer.lr=3e-3", "reference.enabled=true", "grpo.kl_coef=0.05", "eval.every_steps=5",
        f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=2", "trainer.recover_failures=1",
        "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    return train_grpo_monarch(config, Recorder([sink]), drills=[FaultDrill(step=4, rank=1)]), sink


def test_every_rank_generates_its_share_and_a_restored_trainer_samples_its_restored_weights(
        restored_run: tuple[Any, MemorySink]) -> None:
    result, sink = restored_run
    recovered = _events(sink, "recovered")
    assert len(recovered) == 1 and recovered[0]["action"] == "restored_checkpoint"
    assert recovered[0]["path"].endswith("step_000002") and result.step == 5
    # every step's rollouts, before and after the restore, were sampled by the weights the trainer then held
    steps = [int(r["step"]) for r in sink.records if r["kind"] == "metric" and r["key"] == "mismatch/abs_max"]
    assert steps == [1, 2, 3, 3, 4, 5], "step 3 trained before the kill and again after the restore"
    assert all(v < 1e-4 for _, v in sink.series("mismatch/abs_max")), sink.series("mismatch/abs_max")
    assert [m for m in result.metrics if m["kl"] > 0.0], "the policy moved away from the reference"
    for timeline in recorded_timelines(sink):
        for rank in (0, 1):
            assert "generate" in phases_on(timeline, f"trainer {rank}"), (timeline["step"], rank)
    assert result.eval is not None and 0.0 <= result.eval.accuracy <= 1.0
