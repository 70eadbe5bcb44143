"""Completions into a scored rollout batch: decoded, rewarded, advantages normalised within each prompt's group.

Imports no model code, so the Monarch reward proc that runs it starts in the time torch and a tokenizer take.
"""

from __future__ import annotations

import torch

from workers.engine.config import OverlongConfig
from workers.engine.losses import group_advantages
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.rollout_shaping import overlong_penalty
from workers.engine.sampler import Completion
from workers.engine.tasks import Problem


def score_rollouts(
    problems: list[Problem], prompts: list[list[int]], completions: list[Completion], reward: CombinedReward,
    tokenizer: ChatTokenizer, *, group_size: int, std_normalised: bool = True, overlong: OverlongConfig,
    max_new_tokens: int,
) -> RolloutBatchRecord:
    """Reward every completion and normalise advantages within each prompt's group (`std_normalised`:
    GrpoConfig.std_normalised_advantages, which the Monarch reward actor is given too). With
    `overlong.penalty_tokens` set, DAPO's soft overlong punishment (rollout_shaping.overlong_penalty) is added to
    each total before the advantages and recorded as the reward part "overlong"."""
    texts = [tokenizer.decode_reply(c.token_ids) for c in completions]
    scores = [reward(problems[i // group_size], text, c.finished) for i, (text, c) in enumerate(zip(texts, completions))]
    parts = {name: [s.parts[name] for s in scores] for name in reward.names}
    totals = [s.total for s in scores]
    if overlong.penalty_tokens is not None:
        parts["overlong"] = [overlong_penalty(len(c.token_ids), max_new_tokens=max_new_tokens,
                                              penalty_tokens=overlong.penalty_tokens, factor=overlong.penalty_factor)
                             for c in completions]
        totals = [total + penalty for total, penalty in zip(totals, parts["overlong"])]
    rewards = torch.tensor(totals)
    advantages = group_advantages(rewards, group_size, std_normalised=std_normalised)
    return RolloutBatchRecord(
        prompts=prompts, responses=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
        rewards=rewards.tolist(), advantages=advantages.tolist(), policy_version=min(c.policy_version for c in completions),
        prompt_texts=[problems[i // group_size].messages[-1]["content"] for i in range(len(prompts))],
        response_texts=texts, reward_parts=parts, sample_ids=[p.meta.get("sample_id", "") for p in problems],
        truncated=[not c.finished for c in completions],
    )
