"""Pipelined GRPO (`grpo.mode: pipelined`): chunks of a step train while later chunks generate.

The trainer's chunked step must be the very step it takes on the whole batch (the
normaliser is applied once every chunk is in), replicated or sharded, whatever the order of
the chunks; a pipelined run trains on-policy, one generation request per chunk, and
survives trainer drills in the middle of a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ARITHMETIC
from tests.engine.test_monarch_fsdp import _record, _sharded_trainer, _single_process
from workers.engine.config import load_config
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.replay_buffer import RolloutBatchRecord, concat_records

pytestmark = pytest.mark.slow


def _chunk(record: RolloutBatchRecord, first: int, last: int) -> RolloutBatchRecord:
    return concat_records([RolloutBatchRecord(
        prompts=record.prompts[first:last], responses=record.responses[first:last], logprobs=record.logprobs[first:last],
        rewards=record.rewards[first:last], advantages=record.advantages[first:last], policy_version=record.policy_version,
        prompt_texts=record.prompt_texts[first:last], response_texts=record.response_texts[first:last], reward_parts={},
    )])


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_chunks_in_any_order_take_the_same_step_as_the_whole_batch(sft_warm_start: tuple[Path, float], sharding: str) -> None:
    folder, _ = sft_warm_start
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n", overrides=[
        "placement.backend=monarch", "trainer.ranks=2", f"trainer.sharding={sharding}", "trainer.micro_batch_size=3",
        "trainer.optimizer.lr=0.1", "trainer.optimizer.name=sgd", "trainer.optimizer.grad_clip=0.5", "grpo.group_size=2",
        "grpo.mode=pipelined", "grpo.pipeline_chunks=3", "trainer.batch_size=6",
    ])
    record = _record(folder, rows=12, seed=4)
    chunks = [_chunk(record, 8, 12), _chunk(record, 0, 2), _chunk(record, 2, 8)]  # uneven, out of order
    procs, trainer = _sharded_trainer(config, 2)
    try:
        rows = [list(trainer.accumulate.call(chunk, None).get().values()) for chunk in chunks]
        results = list(trainer.finish_step.call().get().values())
        state = list(trainer.state_dict.call().get().values())[0]
        trainer.shutdown.call().get()
    finally:
        procs.stop().get()

    model, _, _, update = _single_process(folder, config, record)

    assert rows == [[2, 2], [1, 1], [3, 3]]
    assert sum(r["loss"] for r in results) == pytest.approx(update.loss, abs=1e-6)
    assert update.grad_norm > 0.5 and [r["grad_norm"] for r in results] == pytest.approx([update.grad_norm] * 2, rel=1e-5)
    assert sum(r["train_tokens"] for r in results) > 0
    single = model.state_dict()
    assert max((state[k] - single[k]).abs().max().item() for k in single) < 1e-6


@pytest.fixture(scope="module")
def pipelined_run(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, MemorySink]:
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("monarch-pipelined")
    drills = "drills:\n  - {kind: raise, role: trainer, schedule: {at_step: 2}}\n  - {kind: kill, role: trainer, schedule: {at_step: 4}}\n"
    config = load_config(f"recipe: grpo\nmodel: {{path: '{folder}'}}\n{drills}", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=2", "generator.replicas=1",
        "grpo.mode=pipelined", "grpo.pipeline_chunks=3", "trainer.steps=5", "trainer.batch_size=6",
        "trainer.micro_batch_size=8", "grpo.group_size=4", "reference.enabled=true", "grpo.kl_coef=0.05",
        "eval.every_steps=0", f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=2",
        "trainer.recover_failures=1", "failover.call_timeout_s=30", "telemetry.console=false",
        "trainer.threads_per_process=1", "grpo.packing=true",  # packed forwards on the ranks and the reference proc
    ])
    sink = MemorySink()
    return train_grpo_monarch(config, Recorder([sink])), sink


def _events(sink: MemorySink, name: str) -> list[dict[str, Any]]:
    return [r for r in sink.records if r["kind"] == "event" and r["name"] == name]


def test_pipelined_run_trains_on_policy_one_request_per_chunk(pipelined_run) -> None:
    result, sink = pipelined_run
    # steps 1-3 ran, step 4's trainer was killed, steps 3-5 ran again from the step-2 checkpoint
    assert result.step == 5 and [m["policy_version"] for m in result.metrics] == [1, 2, 3, 3, 4, 5]
    assert all(m["staleness/policy_age"] == 0 for m in result.metrics)
    assert _events(sink, "staleness_histogram")[-1]["counts"] == {"0": 5}
    assert all("kl" in m and m["grad_norm"] > 0.0 for m in result.metrics)
    assert all(0 < m["data/forward_positions"] <= m["data/train_tokens"] for m in result.metrics)
    # 3 requests per generation: 6 trained steps and the one whose rollouts the killed trainer dropped
    assert result.metrics[-1]["generator/replica_0_requests"] == 3 * 7


def test_pipelined_run_survives_trainer_drills_mid_step(pipelined_run) -> None:
    result, sink = pipelined_run
    detected = [(e["role"], e["step"], e["reason"]) for e in _events(sink, "failure_detected")]
    recovered = [(e["role"], e["action"]) for e in _events(sink, "recovered")]
    assert len(detected) == 2 and detected[0] == ("trainer", 2, "a pipelined chunk raised")
    assert recovered == [("trainer", "retried"), ("trainer", "restored_checkpoint")]
    assert result.metrics[-1]["faults/samples_dropped"] == 6 * 4  # the killed step's rollouts, never trained on
    assert result.metrics[-1]["faults/steps_lost"] == 1
    trained = [sample for step in sorted(result.trained_samples) for sample in result.trained_samples[step]]
    assert len(trained) == len(set(trained)) == 5 * 6
