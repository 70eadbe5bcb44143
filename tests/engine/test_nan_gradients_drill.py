"""The nan_gradients drill on a trainer rank (actors/trainer_rank.py NanGradients): armed through the actor's
`arm_fault`, it makes the next update's gradients NaN whichever forward made them (the fused head's too, and FSDP's
reduced shards), so data_parallel.apply_update skips that update; no-grad forwards before it and the update after it
are untouched. The live run is tests/engine/test_monarch_diverged.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from workers.engine.actors.generator import GeneratorActor
from workers.engine.actors.reward import RewardActor
from workers.engine.actors.trainer import TrainerActor
from workers.engine.batching import RolloutBatch, collate_rollouts
from workers.engine.config import GrpoConfig, OptimizerConfig
from workers.engine.data_parallel import apply_update
from workers.engine.fused_head import fused_head_applies
from workers.engine.grpo_math import accumulate_gradients, loss_normalizer, sequence_logprobs
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.sharding import full_model_state, shard_model
from workers.engine.training import build_optimizer, build_scheduler

ARM = {"duration_s": 0.0, "latency_ms": None, "bandwidth_mbps": None}  # what DrillTargets' arm_trainer sends


def _rollouts() -> RolloutBatch:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 2, 4, 3)]
    return collate_rollouts(prompts, responses, [(-3.0 * torch.rand(len(r), generator=gen)).tolist() for r in responses],
                            [1.0, -0.5, 0.3, -0.8], pad_id=0)


def _trainer(model: nn.Module) -> TrainerActor:
    """A trainer rank's actor object with a model (no Monarch proc: only `arm_fault` is called)."""
    actor = TrainerActor.__new__(TrainerActor)
    actor.model = model
    return actor


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, batch: RolloutBatch) -> tuple[bool, float]:
    """One GRPO update in two micro-batches, as grpo_math.policy_update takes it: (skipped, grad norm)."""
    grpo = GrpoConfig(entropy_coef=0.05)  # a gradient whatever the advantages
    optimizer.zero_grad(set_to_none=True)
    accumulate_gradients(model, batch, grpo=grpo, temperature=1.0, micro_batch_size=2,
                         normalizer=loss_normalizer(batch, grpo.aggregation), sync=True)
    applied = apply_update(model, optimizer, scheduler, grad_clip=1.0)
    return applied.skipped, applied.grad_norm


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in full_model_state(model).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def _check_the_next_update_is_skipped_and_the_one_after_trains(model: nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    batch, actor = _rollouts(), _trainer(model)
    actor.arm_fault("nan_gradients", **ARM)
    with torch.no_grad():  # the old log-probs' and an eval's forwards come before the update: not the drill's
        sequence_logprobs(model, batch, micro_batch_size=2, temperature=1.0)
    before = _weights(model)

    skipped, norm = _update(model, optimizer, scheduler, batch)
    assert skipped and math.isnan(norm)
    assert _same(before, _weights(model)), "the skipped update left the weights as they were"
    assert len(actor.nan_gradients.hooks) <= 1, "disarmed once it fired (its own hook goes at the next arming)"

    skipped, norm = _update(model, optimizer, scheduler, batch)
    assert not skipped and math.isfinite(norm) and norm > 0.0
    assert not _same(before, _weights(model)), "the next update trained"

    actor.arm_fault("nan_gradients", **ARM)  # armed again: the same again
    assert _update(model, optimizer, scheduler, batch)[0]
    assert not _update(model, optimizer, scheduler, batch)[0]


def test_an_armed_trainer_rank_skips_its_next_update_through_the_fused_head(tiny_trainable_qwen3: Path) -> None:
    model = load_pretrained(tiny_trainable_qwen3).model.train()
    assert fused_head_applies(model), "the GRPO update's forward does not call the model: a module hook would miss it"
    _check_the_next_update_is_skipped_and_the_one_after_trains(model)


def test_an_armed_fsdp_rank_skips_its_next_update(tiny_trainable_qwen3: Path, tmp_path: Path) -> None:
    model = load_pretrained(tiny_trainable_qwen3).model.train()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_model(model, mixed_precision="off")
        _check_the_next_update_is_skipped_and_the_one_after_trains(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("actor_class", [GeneratorActor, RewardActor])
def test_only_a_trainer_rank_takes_nan_gradients_and_a_trainer_still_takes_the_other_kinds(actor_class: type) -> None:
    with pytest.raises(ValueError, match=f"nan_gradients is not a fault that {actor_class.__name__} injects into itself"):
        actor_class.__new__(actor_class).arm_fault("nan_gradients", **ARM)
    trainer = _trainer(nn.Linear(2, 2))
    trainer.arm_fault("raise", **ARM)
    assert trainer._raise_next and trainer.nan_gradients is None
