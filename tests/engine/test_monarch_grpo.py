"""GRPO on Monarch process meshes: data-parallel trainer over gloo, generator replicas, async
staleness, and recovery from a killed trainer proc.

These tests start real processes (each imports torch), so they share one run where they can.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.batching import collate_rollouts
from workers.engine.config import RunConfig
from workers.engine.grpo_math import policy_update, prepare_old_logprobs
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.recipes.results import GrpoResult
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.training import build_optimizer, build_scheduler

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def monarch_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory) -> tuple[GrpoResult, MemorySink, RunConfig]:
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import FaultDrill, train_grpo_monarch

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-grpo")
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "data.eval_size=16", "placement.backend=monarch", "trainer.ranks=2", "generator.replicas=2",
        "generator.routing=round_robin", "trainer.steps=5", "trainer.batch_size=4", "trainer.micro_batch_size=8",
        "grpo.group_size=4", "grpo.mode=async", "grpo.max_policy_age=2", "trainer.optimizer.lr=3e-3",
        "reference.enabled=true", "grpo.kl_coef=0.05", "eval.every_steps=5", "eval.rollout_samples=2",
        f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=2", "trainer.recover_failures=1",
        "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    # rank 1 is killed before step 4 trains: the run resumes from the step-2 checkpoint
    result = train_grpo_monarch(config, Recorder([sink]), drills=[FaultDrill(step=4, rank=1)])
    return result, sink, config


def test_monarch_run_trains_with_stale_rollouts(monarch_run: tuple[GrpoResult, MemorySink, RunConfig]) -> None:
    result, sink, _ = monarch_run
    ages = [m["staleness/policy_age"] for m in result.metrics]
    assert ages[:3] == [0, 1, 2] and max(ages) <= 2
    assert all(m["mismatch/abs_max"] < 1e-4 for m in result.metrics if m["staleness/policy_age"] == 0)
    stale = [m for m in result.metrics if m["staleness/policy_age"] > 0]
    # a stale batch's log-probs come from older weights, unless no update moved them since (a step whose groups all
    # agreed has no gradient)
    moved = [m for m in stale if m["mismatch/abs_max"] > 1e-3]
    assert len(moved) >= 2 and all(abs(m["ratio/mean"] - 1.0) > 1e-4 for m in moved)
    assert max(m["clip_fraction"] for m in stale) > 0.0
    assert result.metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6) and result.metrics[-1]["kl"] > 0.0
    assert all(m["time/weight_sync_s"] > 0.0 for m in result.metrics[1:3])
    # both replicas served requests
    assert result.metrics[-1]["generator/replica_0_requests"] > 0 and result.metrics[-1]["generator/replica_1_requests"] > 0
    assert result.eval is not None and 0.0 <= result.eval.accuracy <= 1.0
    assert result.checkpoint is not None and result.checkpoint.name == "step_000005"
    events = {r["name"] for r in sink.records if r["kind"] == "event"}
    assert {"meshes_ready", "checkpoint_saved", "staleness_histogram", "dataset"} <= events


def test_monarch_run_recovers_from_a_killed_trainer_rank(monarch_run: tuple[GrpoResult, MemorySink, RunConfig]) -> None:
    result, sink, _ = monarch_run
    events = [r for r in sink.records if r["kind"] == "event"]
    names = [e["name"] for e in events]
    assert names.count("failure_detected") == names.count("recovered") == 1
    assert names.index("fault_injected") < names.index("failure_detected") < names.index("replica_replaced") < names.index("recovered")
    injected, detected, recovered = (events[names.index(n)] for n in ("fault_injected", "failure_detected", "recovered"))
    assert (injected["fault_kind"], injected["role"], injected["replica"]) == ("kill", "trainer", 1)
    assert detected["fault_id"] == recovered["fault_id"] == injected["fault_id"] and not detected["hung"]
    assert 0.0 <= detected["time_to_detect_s"] < 10.0 and recovered["time_to_recover_s"] > 0.0
    assert recovered["path"].endswith("step_000002") and recovered["policy_version"] == 2
    assert recovered["action"] == "restored_checkpoint" and recovered["steps_lost"] == 1
    # steps 1-3 ran, step 4 failed, steps 3-5 ran again from the step-2 checkpoint
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3, 3, 4, 5]
    assert all(m["grad_norm"] > 0.0 for m in result.metrics[3:])
    assert result.metrics[-1]["faults/steps_lost"] == 1
    # the run's final steps trained each sample once (step 3 was redone from the restored data position)
    ids = [sample for step in sorted(result.trained_samples) for sample in result.trained_samples[step]]
    assert len(ids) == 5 * 4 and len(set(ids)) == len(ids)


def test_monarch_checkpoint_loads_in_one_process(monarch_run: tuple[GrpoResult, MemorySink, RunConfig]) -> None:
    from workers.engine.models.hf_folder import export_hf

    result, _, config = monarch_run
    exported = load_pretrained(export_hf(result.checkpoint, Path(config.checkpoint.folder).parent / "exported"))
    start = load_pretrained(config.model.path)
    ids = torch.randint(0, 259, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported.model(ids) - start.model(ids)).abs().max() > 1e-4  # the distributed updates were saved


@pytest.mark.parametrize("overrides", [
    (),
    ("grpo.epochs=2", "grpo.mini_batches=2"),  # 4 updates, 5 shuffled rows each: 3 on rank 0, 2 on rank 1
    ("grpo.mini_batches=3", "grpo.rollout_correction.mode=mask", "grpo.rollout_correction.threshold=1.5"),
], ids=["one-update", "epochs-and-mini-batches", "mini-batches-with-correction"])
def test_data_parallel_step_equals_single_process_step(sft_warm_start: tuple[Path, float], overrides: tuple[str, ...]) -> None:
    """Two gloo ranks, each on half of every update's rows, take the same step as one process on all rows."""
    from monarch.spmd import setup_torch_elastic_env

    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.trainer import TrainerActor
    from workers.engine.config import load_config
    from workers.engine.sampler import SamplingParams, TorchSampler

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", "trainer.micro_batch_size=3", "trainer.optimizer.lr=0.1",
        "trainer.optimizer.name=sgd",  # linear in the gradient: compares the summed gradient itself
        "grpo.group_size=4", *overrides,
    ])
    loaded = load_pretrained(folder)
    sampler = TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids, pad_id=loaded.tokenizer.pad_id)
    prompts = [loaded.tokenizer.encode_prompt([{"role": "user", "content": f"{a}+{a}="}]) for a in range(5) for _ in range(2)]
    completions = sampler.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    record = RolloutBatchRecord(
        prompts=prompts, responses=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
        rewards=[0.0] * 10, advantages=[(-1.0) ** i * (1 + i / 10) for i in range(10)], policy_version=0,
        prompt_texts=[""] * 10, response_texts=[""] * 10, reward_parts={},
    )

    procs = spawn_procs(2, threads=1)
    try:
        setup_torch_elastic_env(procs)
        trainer = procs.spawn("trainer", TrainerActor, config)
        trainer.setup.call().get()
        results = list(trainer.train_step.call(record, None, 0).get().values())
        distributed_state = trainer.slice(procs=1).state_dict.call_one().get()  # rank 1: replicas stay identical
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    model = load_pretrained(folder).model.train()
    optimizer = build_optimizer(model, config.trainer.optimizer)
    scheduler = build_scheduler(optimizer, config.trainer.optimizer, config.trainer.steps)
    batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages, pad_id=loaded.tokenizer.pad_id)
    prepare_old_logprobs(model, batch, grpo=config.grpo, temperature=1.0, micro_batch_size=3, policy_age=0,
                         batch_version=0, behaviour=None)
    update = policy_update(model, optimizer, scheduler, batch, grpo=config.grpo, temperature=1.0, micro_batch_size=3,
                           grad_clip=config.trainer.optimizer.grad_clip)

    assert update.updates == config.grpo.updates_per_step and all(r["updates"] == update.updates for r in results)
    assert sum(r["loss"] for r in results) == pytest.approx(update.loss, abs=1e-6)
    assert results[0]["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-5)
    single_state = model.state_dict()
    assert max((distributed_state[k] - single_state[k]).abs().max().item() for k in single_state) < 1e-6


def test_the_reward_actor_scores_dr_grpo_advantages_without_the_std_division(tiny_qwen3: Path) -> None:
    """Dr. GRPO on Monarch: the reward proc is given the loss's advantage rule (A = r - group mean)."""
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.reward import RewardActor
    from workers.engine.config import OverlongConfig
    from workers.engine.models.tokenizer import ChatTokenizer
    from workers.engine.sampler import Completion
    from workers.engine.tasks import Problem

    assert RunConfig.model_validate({"recipe": "grpo", "model": {"path": "/m"}, "grpo": {"loss": "dr_grpo"},
                                     "placement": {"backend": "monarch"}}).grpo.std_normalised_advantages is False
    tokenizer = ChatTokenizer(str(tiny_qwen3))
    problems = [Problem(messages=[{"role": "user", "content": "1+1="}], response=None, answer="2")]
    prompts = [tokenizer.encode_prompt(problems[0].messages)] * 4
    replies = ["2", "3", "2", "5"]  # rewards 1, 0, 1, 0: mean 0.5, std 0.5
    completions = [Completion(prompt_ids=prompts[0], token_ids=(ids := tokenizer.encode(text)), logprobs=[-1.0] * len(ids),
                              finished=True) for text in replies]
    procs = spawn_procs(1, threads=1)
    try:
        advantages = {}
        for std_normalised in (True, False):
            actor = procs.spawn(f"reward_{std_normalised}", RewardActor, str(tiny_qwen3), ["exact_math"], None,
                                std_normalised, OverlongConfig(), 6)
            record = actor.score.call_one(problems, prompts, completions, 4).get()
            advantages[std_normalised] = record.advantages
    finally:
        procs.stop().get()
    assert advantages[False] == pytest.approx([0.5, -0.5, 0.5, -0.5])
    assert advantages[True] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-4)


def test_monarch_async_correction_and_several_updates(sft_warm_start: tuple[Path, float], tmp_path: Path) -> None:
    """On Monarch, async with a rollout correction and 2 epochs x 2 mini-batches: each rank keeps the weights of the
    versions a batch may come from, so pi_old of a stale batch is the generator's own policy (same numerics here)."""
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        *ARITHMETIC, "placement.backend=monarch", "trainer.ranks=2", "trainer.steps=4", "trainer.batch_size=4",
        "trainer.micro_batch_size=8", "grpo.group_size=4", "grpo.mode=async", "grpo.max_policy_age=1",
        "trainer.optimizer.lr=3e-3", "grpo.epochs=2", "grpo.mini_batches=2", "grpo.rollout_correction.mode=truncate",
        "eval.every_steps=0", f"checkpoint.folder={tmp_path / 'checkpoints'}", "telemetry.console=false",
        "trainer.threads_per_process=1",
    ])
    result = train_grpo_monarch(config, Recorder([]))
    assert [m["train/updates"] for m in result.metrics] == [4] * 4
    stale = [m for m in result.metrics if m["staleness/policy_age"] == 1]
    assert stale and all(m["mismatch/behaviour_weights"] == 1.0 for m in stale)
    assert all(m["mismatch/abs_max"] < 1e-3 and m["mismatch/truncated_share"] == 0.0 for m in result.metrics)
    assert all(m["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) for m in result.metrics)
