"""DAPO's rollout shaping: the soft overlong punishment, masking cut-off responses, and dynamic sampling (groups
without a reward spread dropped and the batch refilled), from the formulas up to single-process GRPO runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.batching import collate_record
from workers.engine.config import OverlongConfig
from workers.engine.grpo_math import loss_normalizer
from workers.engine.losses import group_advantages
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.recipes.grpo import train_grpo
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.rollout_shaping import BatchFilling, groups_with_spread, overlong_penalty, select_groups
from workers.engine.sampler import Completion
from workers.engine.scoring import score_rollouts
from workers.engine.tasks import Problem


# --- the soft overlong punishment ---------------------------------------------------------------------------

@pytest.mark.parametrize(("length", "expected"), [
    (0, 0.0), (12, 0.0),  # up to max_new_tokens - penalty_tokens = 12: no penalty
    (13, -0.25), (14, -0.5), (15, -0.75),  # (12 - length) / 4 inside the last 4 tokens
    (16, -1.0),  # cut off at max_new_tokens
    (17, -1.0), (40, -1.0),  # beyond
])
def test_overlong_penalty_values(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_new_tokens=16, penalty_tokens=4, factor=1.0) == pytest.approx(expected)


def test_overlong_penalty_scales_with_factor() -> None:
    for length in (12, 13, 15, 16, 30):
        base = overlong_penalty(length, max_new_tokens=16, penalty_tokens=4, factor=1.0)
        assert overlong_penalty(length, max_new_tokens=16, penalty_tokens=4, factor=0.4) == pytest.approx(0.4 * base)
    assert overlong_penalty(16, max_new_tokens=16, penalty_tokens=16, factor=2.5) == pytest.approx(-2.5)
    assert overlong_penalty(1, max_new_tokens=16, penalty_tokens=16, factor=2.0) == pytest.approx(-2.0 / 16)


# --- scoring -------------------------------------------------------------------------------------------------

def _completion(tokenizer: ChatTokenizer, text: str, *, finished: bool) -> Completion:
    ids = tokenizer.encode(text) + (tokenizer.eos_token_ids[:1] if finished else [])
    return Completion(prompt_ids=[1, 2], token_ids=ids, logprobs=[-0.5] * len(ids), finished=finished)


def test_score_rollouts_marks_truncation_and_adds_the_overlong_part(tiny_qwen3: Path) -> None:
    tokenizer = ChatTokenizer(tiny_qwen3)
    problem = Problem(messages=[{"role": "user", "content": "3+4="}], response=None, answer="7", meta={"sample_id": "s0"})
    # byte-level tokens: "7"+eos is 2 tokens, "  7"+eos 4, "     7" (cut off) 6, "8"+eos 2
    completions = [_completion(tokenizer, "7", finished=True), _completion(tokenizer, "  7", finished=True),
                   _completion(tokenizer, "     7", finished=False), _completion(tokenizer, "8", finished=True)]
    assert [len(c.token_ids) for c in completions] == [2, 4, 6, 2]
    prompts = [[1, 2]] * 4
    kwargs = dict(group_size=4, max_new_tokens=6)
    plain = score_rollouts([problem], prompts, completions, CombinedReward(["exact_math"]), tokenizer,
                           overlong=OverlongConfig(), **kwargs)
    assert plain.truncated == [False, False, True, False]
    assert set(plain.reward_parts) == {"exact_math"}
    assert plain.rewards == [1.0, 1.0, 1.0, 0.0]

    shaped = score_rollouts([problem], prompts, completions, CombinedReward(["exact_math"]), tokenizer,
                            overlong=OverlongConfig(penalty_tokens=3, penalty_factor=0.5), **kwargs)
    assert shaped.truncated == [False, False, True, False]
    # expected length 6 - 3 = 3: row 1 (4 tokens) loses (3 - 4) / 3 * 0.5, the cut-off row 2 the whole 0.5
    assert shaped.reward_parts["overlong"] == pytest.approx([0.0, -1 / 6, -0.5, 0.0])
    assert shaped.reward_parts["exact_math"] == [1.0, 1.0, 1.0, 0.0]
    assert shaped.rewards == pytest.approx([1.0, 5 / 6, 0.5, 0.0])
    expected = group_advantages(torch.tensor([1.0, 5 / 6, 0.5, 0.0]), 4)
    assert shaped.advantages == pytest.approx(expected.tolist(), abs=1e-6)
    assert shaped.advantages[1] > shaped.advantages[2]  # the unpenalised run had them equal
    assert plain.advantages[1] == pytest.approx(plain.advantages[2])
    assert shaped.sample_ids == ["s0"]


# --- masking cut-off responses -------------------------------------------------------------------------------

def _record(rewards: list[float], *, group_size: int, truncated: list[bool] | None = None) -> RolloutBatchRecord:
    """Row i: prompt [100 + i // group_size], a response of 1 + i % 3 tokens [i, ...], texts naming i."""
    n = len(rewards)
    responses = [[i] * (1 + i % 3) for i in range(n)]
    return RolloutBatchRecord(
        prompts=[[100 + i // group_size, 7] for i in range(n)], responses=responses,
        logprobs=[[-0.1 * (i + 1)] * len(r) for i, r in enumerate(responses)], rewards=list(rewards),
        advantages=group_advantages(torch.tensor(rewards), group_size).tolist(), policy_version=3,
        prompt_texts=[f"p{i // group_size}" for i in range(n)], response_texts=[f"r{i}" for i in range(n)],
        reward_parts={"exact_math": list(rewards), "overlong": [-0.01 * i for i in range(n)]},
        sample_ids=[f"s{g}" for g in range(n // group_size)],
        truncated=truncated if truncated is not None else [i % 2 == 1 for i in range(n)],
    )


def test_collate_record_masks_exactly_the_truncated_rows() -> None:
    record = _record([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], group_size=3, truncated=[False, True, False, False, True, True])
    full = collate_record(record, pad_id=0)
    masked = collate_record(record, pad_id=0, mask_truncated=True)
    cut = torch.tensor(record.truncated)
    assert full.response_mask[cut].any(dim=1).all()  # every truncated row had response tokens to clear
    assert not masked.response_mask[cut].any()
    assert torch.equal(masked.response_mask[~cut], full.response_mask[~cut])
    assert torch.equal(masked.inputs, full.inputs) and torch.equal(masked.advantages, full.advantages)
    kept_tokens = sum(len(r) for r, t in zip(record.responses, record.truncated) if not t)
    assert loss_normalizer(full, "token") == sum(len(r) for r in record.responses)
    assert loss_normalizer(masked, "token") == kept_tokens == 1 + 3 + 1
    assert torch.equal(collate_record(record, pad_id=0, mask_truncated=False).response_mask, full.response_mask)


# --- dynamic sampling's groups -------------------------------------------------------------------------------

def test_groups_with_spread_and_selection_keep_rows_aligned() -> None:
    record = _record([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0], group_size=3)
    assert groups_with_spread(record, group_size=3) == [True, False, True]
    chosen = select_groups(record, [0, 2], group_size=3)
    rows = [0, 1, 2, 6, 7, 8]
    assert len(chosen) == 6 and chosen.policy_version == 3
    assert chosen.prompts == [record.prompts[r] for r in rows]
    assert chosen.responses == [record.responses[r] for r in rows]
    assert chosen.logprobs == [record.logprobs[r] for r in rows]
    assert chosen.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert chosen.advantages == [record.advantages[r] for r in rows]
    assert chosen.prompt_texts == ["p0"] * 3 + ["p2"] * 3
    assert chosen.response_texts == ["r0", "r1", "r2", "r6", "r7", "r8"]
    assert chosen.reward_parts["overlong"] == [record.reward_parts["overlong"][r] for r in rows]
    assert chosen.reward_parts["exact_math"] == chosen.rewards
    assert chosen.sample_ids == ["s0", "s2"]
    assert chosen.truncated == [False, True, False, False, True, False]


def test_batch_filling_keeps_informative_groups_across_rounds() -> None:
    filling = BatchFilling(batch_size=3, group_size=3, max_rounds=4)
    filling.add(_record([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0], group_size=3))  # groups 0, 2 informative
    assert not filling.done
    second = _record([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], group_size=3)  # groups 1, 2: one is needed
    filling.add(second)
    assert filling.done and filling.rounds == 2 and filling.dropped == 2 and filling.discarded == 2
    record = filling.record()
    assert len(record) == 9 and record.sample_ids == ["s0", "s2", "s1"]
    assert record.rewards[6:] == second.rewards[3:6] and record.response_texts[6:] == ["r3", "r4", "r5"]
    assert all(groups_with_spread(record, group_size=3))
    with pytest.raises(ValueError, match="already filled"):
        filling.add(second)


def test_batch_filling_short_and_empty() -> None:
    flat = _record([1.0, 1.0, 0.0, 0.0], group_size=2)
    mixed = _record([1.0, 0.0, 1.0, 1.0], group_size=2)
    short = BatchFilling(batch_size=2, group_size=2, max_rounds=2)
    short.add(flat)
    short.add(mixed)
    assert short.done and len(short.record()) == 2 and short.record().rewards == [1.0, 0.0]
    assert short.discarded == 3
    empty = BatchFilling(batch_size=2, group_size=2, max_rounds=2)
    last = _record([0.0, 0.0, 1.0, 1.0], group_size=2)
    empty.add(flat)
    empty.add(last)
    assert empty.record() is last  # nothing informative: the last round's groups
    assert empty.dropped == 4 and empty.discarded == 2
    off = BatchFilling(batch_size=2, group_size=2, max_rounds=None)
    off.add(flat)
    assert off.done and off.record() is flat and off.dropped == 0


# --- single-process runs -------------------------------------------------------------------------------------

DYNAMIC = (*ARITHMETIC, "trainer.batch_size=4", "trainer.micro_batch_size=64", "grpo.group_size=4",
           "eval.every_steps=0", "eval.rollout_samples=16", "trainer.optimizer.lr=1e-3")


def _train_groups(sink: MemorySink, *, group_size: int) -> dict[int, list[list[float]]]:
    """step -> the rewards of each trained group, from the train rollouts the run recorded (all of them)."""
    by_step: dict[int, list[float]] = {}
    for r in sink.records:
        if r["kind"] == "rollout" and r["split"] == "train":
            by_step.setdefault(r["step"], []).append(r["reward"])
    return {step: [rewards[i: i + group_size] for i in range(0, len(rewards), group_size)]
            for step, rewards in by_step.items()}


def test_dynamic_sampling_trains_only_on_groups_with_a_spread(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sink = MemorySink()
    result = train_grpo(make_config("grpo", folder, *DYNAMIC, "trainer.steps=4", "grpo.dynamic_sampling.max_rounds=8"),
                        Recorder([sink]))
    steps = [1, 2, 3, 4]
    assert [s for s, _ in sink.series("sampling/rounds")] == steps
    dropped = dict(sink.series("sampling/groups_dropped"))
    rounds = dict(sink.series("sampling/rounds"))
    short = dict(sink.series("sampling/groups_short"))
    print(f"max_rounds 8: rounds {rounds}, dropped {dropped}, short {short}")
    assert max(dropped.values()) > 0  # the warm start gets some groups all right or all wrong
    assert all(rounds[s] >= 2 for s in steps if dropped[s] > 0)  # a dropped group is replaced from a new round
    groups = _train_groups(sink, group_size=4)
    assert sorted(groups) == steps
    for step in steps:
        assert len(groups[step]) == 4 - short[step]
        assert all(max(g) > min(g) for g in groups[step]), (step, groups[step])
    assert all(m["reward/std"] > 0.0 for m in result.metrics)

    sink1 = MemorySink()
    train_grpo(make_config("grpo", folder, *DYNAMIC, "trainer.steps=4", "grpo.dynamic_sampling.max_rounds=1"),
               Recorder([sink1]))
    assert [v for _, v in sink1.series("sampling/rounds")] == [1.0] * 4
    dropped1, short1 = dict(sink1.series("sampling/groups_dropped")), dict(sink1.series("sampling/groups_short"))
    print(f"max_rounds 1: dropped {dropped1}, short {short1}")
    assert max(dropped1.values()) > 0
    assert all(short1[s] == dropped1[s] for s in steps)  # one round: every dropped group leaves the batch short
    groups1 = _train_groups(sink1, group_size=4)
    assert all(len(groups1[s]) == 4 - short1[s] for s in steps)


def test_dynamic_sampling_off_reports_no_sampling_metrics(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sink = MemorySink()
    train_grpo(make_config("grpo", folder, *DYNAMIC, "trainer.steps=1"), Recorder([sink]))
    assert sink.series("sampling/rounds") == [] and len(_train_groups(sink, group_size=4)[1]) == 4


def test_overlong_penalty_in_a_run(tiny_trainable_qwen3: Path, make_config) -> None:
    """The random model's replies run to max_new_tokens (6): each loses the whole penalty_factor."""
    sink = MemorySink()
    result = train_grpo(make_config("grpo", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=2", "trainer.batch_size=2",
                                    "trainer.micro_batch_size=64", "grpo.group_size=4", "eval.every_steps=0",
                                    "grpo.overlong.penalty_tokens=3", "grpo.overlong.penalty_factor=0.5"),
                        Recorder([sink]))
    assert all(m["response_length/mean"] > 5.0 for m in result.metrics)
    assert all(m["reward/overlong"] < 0.0 for m in result.metrics)
    assert [s for s, _ in sink.series("reward/overlong")] == [1, 2]
    assert min(m["reward/overlong"] for m in result.metrics) >= -0.5
    for m in result.metrics:
        assert m["reward/mean"] == pytest.approx(m["reward/exact_math"] + m["reward/overlong"], abs=1e-6)


def test_a_batch_whose_every_response_is_filtered_trains_on_nothing_without_nan(tiny_trainable_qwen3: Path,
                                                                                make_config) -> None:
    """The random model's replies run to max_new_tokens: grpo.overlong.filter masks every one, and the token
    normaliser (0 tokens) once made the loss 0 / 0 = NaN."""
    result = train_grpo(make_config("grpo", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=2", "trainer.batch_size=2",
                                    "trainer.micro_batch_size=64", "grpo.group_size=4", "eval.every_steps=0",
                                    "grpo.overlong.filter=true", "generator.max_new_tokens=1"),
                        Recorder())
    assert all(m["response_length/mean"] == 1.0 for m in result.metrics)
    assert result.losses == [0.0, 0.0] and all(m["grad_norm"] == 0.0 for m in result.metrics)


def test_dynamic_sampling_fills_every_async_batch(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sink = MemorySink()
    result = train_grpo(make_config("grpo", folder, *DYNAMIC, "trainer.steps=4", "grpo.dynamic_sampling.max_rounds=8",
                                    "grpo.mode=async", "grpo.max_policy_age=1"), Recorder([sink]))
    assert [m["staleness/policy_age"] for m in result.metrics] == [0, 1, 1, 1]
    rounds = dict(sink.series("sampling/rounds"))
    assert rounds[1] >= 2  # step 1 fills two batches (the one it trains on and the one ahead)
    assert sum(v for _, v in sink.series("sampling/groups_dropped")) > 0
    groups = _train_groups(sink, group_size=4)
    for step in range(1, 5):
        assert len(groups[step]) == 4 and all(max(g) > min(g) for g in groups[step]), (step, groups[step])
