"""The GRPO step's maths, shared by the recipes and the Monarch actors: the frozen reference's log-probs
and the policy update (gradients accumulated over micro-batches, then one optimizer step). Rewards into
group-normalised advantages: scoring.py."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.engine.batching import RolloutBatch, pack_rollouts
from workers.engine.behaviour_weights import BehaviourWeights
from workers.engine.config import GrpoConfig
from workers.engine.data_parallel import RankShare, apply_update, zero_weighted_pass
from workers.engine.fused_head import model_logprobs
from workers.engine.losses import (group_advantages, grpo_loss, kl_estimate, mismatch_metrics,
                                   rollout_importance_weights)
from workers.engine.sharding import set_gradient_sync
from workers.engine.timeline import WorkSpans


def loss_normalizer(batch: RolloutBatch, aggregation: str, *, max_new_tokens: int | None = None) -> float:
    """Of the whole step's batch: response tokens (token aggregation), sequences (sequence, sequence_sum), or
    sequences x generator.max_new_tokens (constant). Parts of a batch add up to the whole's; divide by
    `dividing_normalizer` of the sum."""
    if aggregation == "token":
        return float(batch.response_mask.sum())
    if aggregation == "constant":
        if max_new_tokens is None:
            raise ValueError("the constant normaliser needs generator.max_new_tokens")
        return float(len(batch) * max_new_tokens)
    return float(len(batch))


def micro_batch_logprobs(model: nn.Module, micro: RolloutBatch, *, temperature: float, packing: bool,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(log-probs [b, T], entropy [b, T], token positions the forward ran, how many of them were padding) of a
    micro-batch's targets: its padded rows as they are, or with `packing` (grpo.packing) packed
    (batching.pack_rollouts: each group's prompt once, its responses after it, units packed into fewer rows), the
    response targets' outputs put back in the padded layout and 0 elsewhere, which the loss masks either way."""
    if not packing:
        logprobs, entropy = model_logprobs(model, micro.inputs, micro.targets, temperature, entropy_grad=entropy_grad)
        positions = micro.inputs.numel()
        return logprobs, entropy, positions, positions - int(micro.lengths.sum())
    packed = pack_rollouts(micro)
    logprobs, entropy = model_logprobs(model, packed.inputs, packed.targets, temperature, entropy_grad=entropy_grad,
                                       positions=packed.positions, attention_masks=packed.attention_mask,
                                       read=packed.read)
    return packed.unpack(logprobs), packed.unpack(entropy), packed.inputs.numel(), packed.padding_positions


@torch.no_grad()
def sequence_logprobs(model: nn.Module, batch: RolloutBatch, *, micro_batch_size: int, temperature: float,
                      packing: bool = False) -> torch.Tensor:
    """[B, L-1] tempered log-prob of each target under `model` (the reference, or the trainer for pi_old), without
    gradient; 0 at padding with `packing`."""
    out = [micro_batch_logprobs(model, micro, temperature=temperature, packing=packing)[0]
           for micro in (batch.rows(start, start + micro_batch_size) for start in range(0, len(batch), micro_batch_size))]
    return torch.cat(out) if out else torch.zeros_like(batch.behaviour_logprobs)


def kl_reward_advantages(batch: RolloutBatch, rewards: list[float], *, grpo: GrpoConfig) -> float:
    """grpo.kl_in: reward. Takes kl_coef x each response's summed KL estimate (the generator's log-probs against the
    reference's) from its reward and recomputes the group advantages in place; returns the mean penalty."""
    if batch.ref_logprobs is None:
        raise ValueError("a KL penalty in the reward needs reference log-probs")
    per_token = kl_estimate(batch.behaviour_logprobs, batch.ref_logprobs, grpo.kl_estimator)
    penalty = grpo.kl_coef * torch.where(batch.response_mask, per_token, 0.0).sum(dim=1)
    shaped = torch.tensor(rewards, dtype=torch.float32, device=penalty.device) - penalty
    batch.advantages = group_advantages(shaped, grpo.group_size, std_normalised=grpo.std_normalised_advantages)
    return float(penalty.mean())


def dividing_normalizer(normalizer: float) -> float:
    """What a loss and its gradients are divided by: at least 1, so a batch without a response token in the loss (every
    response cut off under grpo.overlong.filter) gives a loss and gradients of 0, not 0 / 0."""
    return max(normalizer, 1.0)


@dataclass
class UpdateResult:
    loss: float  # mean over the step's optimizer updates
    parts: list[dict[str, float]]  # grpo_loss metrics per micro-batch, every update's
    grad_norm: float  # mean over the updates, before clipping
    lr: float  # the last update's
    updates: int
    skipped: int  # updates skipped on NaN or infinite gradients (data_parallel.apply_update)


def update_order(rows: int, *, grpo: GrpoConfig, seed: int) -> list[torch.Tensor]:
    """The rows of each optimizer update: grpo.epochs passes, each in grpo.mini_batches parts; shuffled per pass (the
    same on every rank, from `seed`) when there is more than one update, else the batch in order."""
    if grpo.updates_per_step == 1:
        return [torch.arange(rows)]
    order = []
    for epoch in range(grpo.epochs):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order.extend(torch.randperm(rows, generator=generator).tensor_split(grpo.mini_batches))
    return order


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    *,
    grpo: GrpoConfig,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float | None,
    max_new_tokens: int | None = None,
    share: RankShare = RankShare(),
    seed: int = 0,
    spans: WorkSpans | None = None,
) -> UpdateResult:
    """grpo.epochs x grpo.mini_batches optimizer steps on one step's rollout batch (the whole batch, on every rank).

    Each update's rows are split over the data-parallel ranks and its loss normaliser counts all of them, so summing
    the ranks' gradients (`share.reduce_gradients`, or FSDP's reduce-scatter) gives the update's full gradient. With
    a rollout correction or more than one update, `batch.old_logprobs` must hold pi_old (prepare_old_logprobs).
    """
    losses, norms, parts, lr, skipped = [], [], [], 0.0, 0
    span = (spans or WorkSpans()).span
    for rows in update_order(len(batch), grpo=grpo, seed=seed):
        update = batch.select(rows)
        mine, passes = share.rows(update, micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        with span("forward_backward"):
            loss, update_parts = accumulate_gradients(
                model, mine, grpo=grpo, temperature=temperature, micro_batch_size=micro_batch_size,
                normalizer=dividing_normalizer(loss_normalizer(update, grpo.aggregation, max_new_tokens=max_new_tokens)),
                passes=passes,
                filler=update.rows(0, 1), sync=True)
        if share.reduce_gradients is not None:
            with span("all_reduce"):
                share.reduce_gradients(model)
        with span("optimizer"):
            applied = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)
        lr = applied.lr
        skipped += applied.skipped
        losses.append(loss)
        norms.append(applied.grad_norm)
        parts.extend(update_parts)
    return UpdateResult(loss=sum(losses) / len(losses), parts=parts, grad_norm=sum(norms) / len(norms), lr=lr,
                        updates=len(losses), skipped=skipped)


def needs_old_logprobs(grpo: GrpoConfig, *, policy_age: int) -> bool:
    """Whether pi_old takes a forward of its own: the ratio's denominator under a rollout correction once the weights
    have moved (more than one update, or an older batch), and the mismatch metric with several updates. One update
    on a current batch reads it off that update's own forward."""
    return grpo.updates_per_step > 1 or (grpo.rollout_correction is not None and policy_age > 0)


def prepare_old_logprobs(
    model: nn.Module, batch: RolloutBatch, *, grpo: GrpoConfig, temperature: float, micro_batch_size: int,
    policy_age: int, batch_version: int, behaviour: BehaviourWeights | None,
) -> dict[str, float]:
    """Sets batch.old_logprobs when needs_old_logprobs: the trainer's log-probs under the weights that generated the
    batch (its own now, or `behaviour`'s copy of an older version). Every rank runs it on the whole batch, so a
    sharded model's forwards match. Returns `mismatch/behaviour_weights`: 1 when pi_old came from the batch's own
    version, 0 when that version was not kept (right after a resume) and the current weights stood in."""
    if not needs_old_logprobs(grpo, policy_age=policy_age):
        return {}
    kept = policy_age > 0 and behaviour is not None and behaviour.has(batch_version)
    with behaviour.weights_of(model, version=batch_version) if kept else nullcontext():
        batch.old_logprobs = sequence_logprobs(model, batch, micro_batch_size=micro_batch_size, temperature=temperature,
                                               packing=grpo.packing)
    exact = policy_age == 0 or kept
    return {"mismatch/behaviour_weights": 1.0 if exact else 0.0}


def accumulate_gradients(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    grpo: GrpoConfig,
    temperature: float,
    micro_batch_size: int,
    normalizer: float,
    passes: int = 0,
    filler: RolloutBatch | None = None,
    sync: bool,
) -> tuple[float, list[dict[str, float]]]:
    """Forward and backward over `batch` in micro-batches, adding to the gradients; (loss, per-micro-batch stats:
    grpo_loss's, and the token positions its forward ran and how many of them were padding).
    A sharded model reduces its gradients in the last pass when `sync`, else keeps accumulating locally."""
    step_loss, parts = 0.0, []
    starts = list(range(0, len(batch), micro_batch_size))
    total = max(len(starts), passes)
    for i in range(total):
        set_gradient_sync(model, enabled=sync and i == total - 1)
        if i >= len(starts):
            if filler is None:
                raise ValueError("passes beyond this rank's rows need a filler row")
            zero_weighted_pass(model, filler)
            continue
        micro = batch.rows(starts[i], starts[i] + micro_batch_size)
        logprobs, entropy, positions, padding = micro_batch_logprobs(
            model, micro, temperature=temperature, packing=grpo.packing, entropy_grad=grpo.entropy_coef > 0.0)
        loss, part = micro_batch_loss(micro, logprobs, entropy, grpo=grpo, normalizer=normalizer)
        loss.backward()
        step_loss += float(loss.detach())
        parts.append({**part, "forward_positions": float(positions), "padding_positions": float(padding),
                      "sample_positions": float(micro.lengths.sum())})
    return step_loss, parts


def micro_batch_loss(micro: RolloutBatch, logprobs: torch.Tensor, entropy: torch.Tensor, *, grpo: GrpoConfig,
                     normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo_loss with what the config asks: the rollout correction's weights (pi_old: the batch's, else these
    log-probs before the update), the KL in the loss or not, the entropy bonus."""
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    correction, weights, weight_metrics = grpo.rollout_correction, None, {}
    if correction is not None:
        weights, weight_metrics = rollout_importance_weights(
            old, micro.behaviour_logprobs, micro.response_mask, level=correction.level, mode=correction.mode,
            threshold=correction.threshold, threshold_low=correction.low)
    loss, part = grpo_loss(
        logprobs, micro.behaviour_logprobs, micro.advantages, micro.response_mask,
        clip_epsilon=grpo.clip_low, clip_epsilon_high=grpo.clip_high, dual_clip=grpo.dual_clip, loss=grpo.loss,
        aggregation=grpo.aggregation, kl_coef=grpo.kl_coef if grpo.kl_in == "loss" else 0.0,
        kl_estimator=grpo.kl_estimator, ref_logprobs=micro.ref_logprobs, entropy=entropy,
        entropy_coef=grpo.entropy_coef, normalizer=normalizer,
        old_logprobs=old if correction is not None else None, is_weights=weights,
    )
    return loss, {**part, **mismatch_metrics(old, micro.behaviour_logprobs, micro.response_mask), **weight_metrics}


def check_prompt_lengths(prompts: list[list[int]], limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ValueError(f"a prompt has {longest} tokens, more than data.max_prompt_tokens ({limit})")


def group_prompts(tokenizer: Any, problems: list[Any], *, group_size: int, limit: int) -> list[list[int]]:
    """Each problem's prompt tokenized and checked once, then one copy per sample of its group."""
    encoded = [tokenizer.encode_prompt(p.messages) for p in problems]
    check_prompt_lengths(encoded, limit)
    return [list(prompt) for prompt in encoded for _ in range(group_size)]
