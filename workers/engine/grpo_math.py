"""The GRPO step's maths, shared by the recipes and the Monarch actors: rewards into group-normalised
advantages, the frozen reference's log-probs, and the policy update (gradients accumulated over
micro-batches, then one optimizer step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.engine.batching import RolloutBatch
from workers.engine.config import GrpoConfig
from workers.engine.losses import group_advantages, grpo_loss, token_logprobs
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import Completion
from workers.engine.sharding import set_gradient_sync
from workers.engine.tasks import Problem
from workers.engine.training import grad_norm_and_clip


def score_rollouts(
    problems: list[Problem], prompts: list[list[int]], completions: list[Completion], reward: CombinedReward,
    tokenizer: ChatTokenizer, *, group_size: int, std_normalised: bool = True,
) -> RolloutBatchRecord:
    """Reward every completion and normalise advantages within each prompt's group (`std_normalised`:
    GrpoConfig.std_normalised_advantages, which the Monarch reward actor is given too)."""
    texts = [tokenizer.decode_reply(c.token_ids) for c in completions]
    scores = [reward(problems[i // group_size], text, c.finished) for i, (text, c) in enumerate(zip(texts, completions))]
    rewards = torch.tensor([s.total for s in scores])
    advantages = group_advantages(rewards, group_size, std_normalised=std_normalised)
    return RolloutBatchRecord(
        prompts=prompts, responses=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
        rewards=rewards.tolist(), advantages=advantages.tolist(), policy_version=min(c.policy_version for c in completions),
        prompt_texts=[problems[i // group_size].messages[-1]["content"] for i in range(len(prompts))],
        response_texts=texts, reward_parts={name: [s.parts[name] for s in scores] for name in reward.names},
        sample_ids=[p.meta.get("sample_id", "") for p in problems],
    )


def loss_normalizer(batch: RolloutBatch, aggregation: str, *, max_new_tokens: int | None = None) -> float:
    """Of the whole step's batch: response tokens (token aggregation), sequences (sequence, sequence_sum), or
    sequences x generator.max_new_tokens (constant)."""
    if aggregation == "token":
        return float(batch.response_mask.sum())
    if aggregation == "constant":
        if max_new_tokens is None:
            raise ValueError("the constant normaliser needs generator.max_new_tokens")
        return float(len(batch) * max_new_tokens)
    return float(len(batch))


@torch.no_grad()
def reference_logprobs(reference: nn.Module, batch: RolloutBatch, *, micro_batch_size: int, temperature: float) -> list[torch.Tensor]:
    out = []
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.rows(start, start + micro_batch_size)
        out.append(token_logprobs(reference(micro.inputs), micro.targets, temperature)[0])
    return out


@dataclass
class UpdateResult:
    loss: float
    parts: list[dict[str, float]]  # grpo_loss metrics per micro-batch
    grad_norm: float
    lr: float


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
    normalizer: float,
    ref_logprobs: list[torch.Tensor] | None = None,
    reduce_gradients: Callable[[nn.Module], None] | None = None,
    passes: int = 0,
    filler: RolloutBatch | None = None,
) -> UpdateResult:
    """One optimizer step on a rollout batch, gradients accumulated over micro-batches.

    `normalizer` counts the whole step's batch (over all data-parallel ranks), so summing
    the ranks' gradients (`reduce_gradients`, or FSDP's reduce-scatter) gives the full batch's
    gradient. A sharded model needs the same number of forward/backward passes on every rank:
    with `passes` more than this rank's micro-batches, the rest run on `filler` with weight 0.
    """
    optimizer.zero_grad(set_to_none=True)
    step_loss, parts = accumulate_gradients(
        model, batch, grpo=grpo, temperature=temperature, micro_batch_size=micro_batch_size, normalizer=normalizer,
        ref_logprobs=ref_logprobs, passes=passes, filler=filler, sync=True)
    if reduce_gradients is not None:
        reduce_gradients(model)
    grad_norm, lr = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)
    return UpdateResult(loss=step_loss, parts=parts, grad_norm=grad_norm, lr=lr)


def accumulate_gradients(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    grpo: GrpoConfig,
    temperature: float,
    micro_batch_size: int,
    normalizer: float,
    ref_logprobs: list[torch.Tensor] | None = None,
    passes: int = 0,
    filler: RolloutBatch | None = None,
    sync: bool,
) -> tuple[float, list[dict[str, float]]]:
    """Forward and backward over `batch` in micro-batches, adding to the gradients; (loss, per-micro-batch stats).
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
        logprobs, entropy = token_logprobs(model(micro.inputs), micro.targets, temperature,
                                           entropy_grad=grpo.entropy_coef > 0.0)
        loss, part = grpo_loss(
            logprobs, micro.behaviour_logprobs, micro.advantages, micro.response_mask,
            clip_epsilon=grpo.clip_low, clip_epsilon_high=grpo.clip_high, dual_clip=grpo.dual_clip, loss=grpo.loss,
            aggregation=grpo.aggregation, kl_coef=grpo.kl_coef, kl_estimator=grpo.kl_estimator,
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[i], entropy=entropy, entropy_coef=grpo.entropy_coef,
            normalizer=normalizer,
        )
        loss.backward()
        step_loss += float(loss.detach())
        parts.append(part)
    return step_loss, parts


def zero_weighted_pass(model: nn.Module, filler: RolloutBatch) -> None:
    """A forward and backward that adds nothing to the gradients: a sharded rank's share of a collective."""
    (model(filler.inputs).float().sum() * 0.0).backward()


def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, *,
                 grad_clip: float | None) -> tuple[float, float]:
    """Clip, step the optimizer and the schedule; (gradient norm before clipping, learning rate used)."""
    grad_norm = grad_norm_and_clip(model, grad_clip)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return grad_norm, lr


def check_prompt_lengths(prompts: list[list[int]], limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ValueError(f"a prompt has {longest} tokens, more than data.max_prompt_tokens ({limit})")
