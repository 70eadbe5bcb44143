"""The rollout correction (truncated / masked importance sampling), several updates per batch, the trainer's weights
at a batch's own version, and the KL in the reward: exact small cases, then the single-process recipe end to end."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from workers.engine.batching import collate_rollouts
from workers.engine.behaviour_weights import BehaviourWeights
from workers.engine.config import GrpoConfig, RolloutCorrection
from workers.engine.data_parallel import RankShare
from workers.engine.grpo_math import (accumulate_gradients, kl_reward_advantages, loss_normalizer, micro_batch_loss,
                                      prepare_old_logprobs, sequence_logprobs, update_order)
from workers.engine.losses import grpo_loss, rollout_importance_weights
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.recipes.grpo import train_grpo
from tests.engine.test_recipes import GRPO

MASK = torch.tensor([[True, True, True, False]])
TRAINER = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
GENERATOR = torch.tensor([[-1.5, -1.0, -3.0, -9.0]])  # w = e^0.5, e^-1, 1; the padding's -9 must not count


def _weights(level: str, mode: str, threshold: float, low: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    return rollout_importance_weights(TRAINER, GENERATOR, MASK, level=level, mode=mode, threshold=threshold,
                                      threshold_low=low if low is not None else 1.0 / threshold)


def test_token_truncation_caps_each_weight_at_the_threshold() -> None:
    weights, metrics = _weights("token", "truncate", 1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0]]))
    assert metrics["is_truncated_share"] == pytest.approx(1 / 3) and metrics["is_masked_share"] == 0.0
    assert metrics["is_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0) + 1.0) / 3)
    untouched, metrics = _weights("token", "truncate", 2.0)
    assert torch.allclose(untouched, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 0.0]]))
    assert metrics["is_truncated_share"] == 0.0


def test_token_masking_drops_weights_outside_both_bounds() -> None:
    weights, metrics = _weights("token", "mask", 1.5, low=0.5)
    assert torch.equal(weights, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))  # e^0.5 > 1.5, e^-1 < 0.5
    assert metrics["is_masked_share"] == pytest.approx(2 / 3) and metrics["is_truncated_share"] == 0.0


def test_sequence_level_weight_is_the_product_over_the_response() -> None:
    weights, _ = _weights("sequence", "truncate", 2.0)
    assert torch.allclose(weights, torch.tensor([[math.exp(-0.5)] * 3 + [0.0]]))  # e^(0.5 - 1 + 0)
    masked, metrics = _weights("sequence", "mask", 2.0, low=0.7)
    assert torch.equal(masked, torch.zeros(1, 4)) and metrics["is_masked_share"] == 1.0  # the whole response goes


def test_a_long_response_cannot_overflow_the_sequence_weight() -> None:
    mask = torch.ones(1, 400, dtype=torch.bool)
    weights, metrics = rollout_importance_weights(torch.zeros(1, 400), torch.full((1, 400), -3.0), mask, level="sequence",
                                                  mode="truncate", threshold=2.0, threshold_low=0.5)
    assert torch.equal(weights, torch.full((1, 400), 2.0)) and metrics["is_truncated_share"] == 1.0  # e^1200 capped
    weights, _ = rollout_importance_weights(torch.zeros(1, 400), torch.full((1, 400), -3.0), mask, level="sequence",
                                            mode="mask", threshold=2.0, threshold_low=0.5)
    assert torch.equal(weights, torch.zeros(1, 400))


def test_weighted_loss_and_gradient_are_w_times_the_policy_gradient() -> None:
    """On-policy against pi_old (ratio 1): loss = -sum(w A) / N and d loss / d logp = -w A / N per token."""
    weights, _ = _weights("token", "truncate", 1.5)
    logprobs = TRAINER.clone().requires_grad_(True)
    loss, metrics = grpo_loss(logprobs, GENERATOR, torch.tensor([2.0]), MASK, clip_epsilon=0.2,
                              old_logprobs=TRAINER, is_weights=weights)
    loss.backward()
    w = weights[0, :3]
    assert loss.item() == pytest.approx(float(-(w * 2.0).sum() / 3), abs=1e-6)
    assert torch.allclose(logprobs.grad[0, :3], -w * 2.0 / 3, atol=1e-6) and logprobs.grad[0, 3] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)  # the ratio is against pi_old, not the generator
    assert metrics["mismatch_abs_mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert metrics["mismatch_abs_max"] == pytest.approx(1.0)


def test_the_weights_match_trls_vllm_importance_sampling_correction() -> None:
    """TRL (GRPOTrainer, vllm_importance_sampling_correction, token truncation): per-token loss x
    min(exp(old - sampling), cap), with the clipped surrogate against old. Written out here from its definition."""
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    old = torch.log(torch.rand(2, 4) * 0.8 + 0.1)
    sampling = old + torch.randn(2, 4) * 0.7
    advantages = torch.tensor([1.0, -1.5])
    theta = old + torch.randn(2, 4) * 0.3
    cap, eps = 2.0, 0.2
    weights, _ = rollout_importance_weights(old, sampling, mask, level="token", mode="truncate", threshold=cap,
                                            threshold_low=1 / cap)
    ours_lp = theta.clone().requires_grad_(True)
    ours, _ = grpo_loss(ours_lp, sampling, advantages, mask, clip_epsilon=eps, old_logprobs=old, is_weights=weights)
    ours.backward()
    trl_lp = theta.clone().requires_grad_(True)
    ratio = torch.exp(trl_lp - old)
    per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(1 - eps, 1 + eps) * advantages[:, None])
    per_token = per_token * torch.exp(old - sampling).clamp(max=cap)
    trl = (per_token * mask).sum() / mask.sum()
    trl.backward()
    assert ours.item() == pytest.approx(trl.item(), abs=1e-6)
    assert torch.allclose(ours_lp.grad, trl_lp.grad, atol=1e-6)


def _micro(generator: torch.Tensor, advantages: list[float]):
    return collate_rollouts([[1]] * len(advantages), [[2] * generator.shape[1]] * len(advantages), generator.tolist(),
                            advantages, pad_id=0)


def test_without_pi_old_the_correction_reads_it_off_the_update_itself() -> None:
    """One update on a current batch: pi_old is these log-probs before the step, the ratio is 1 with its gradient."""
    batch = _micro(torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]), [1.0, -1.0])
    logprobs = torch.tensor([[-1.5, -1.0, -0.2], [-2.0, -2.0, -2.0]])
    lp = logprobs.clone().requires_grad_(True)
    grpo = GrpoConfig(rollout_correction=RolloutCorrection(threshold=1.5))
    loss, part = micro_batch_loss(batch, lp, torch.zeros(2, 3), grpo=grpo, normalizer=6.0)
    loss.backward()
    w = torch.exp(logprobs - batch.behaviour_logprobs).clamp(max=1.5)
    assert part["ratio_mean"] == pytest.approx(1.0)
    assert torch.allclose(lp.grad, -w * torch.tensor([[1.0], [-1.0]]) / 6.0, atol=1e-6)
    assert part["is_truncated_share"] == pytest.approx(1 / 6)  # e^0.8 > 1.5: one token of six
    assert part["mismatch_abs_max"] == pytest.approx(0.8)


def test_update_order_covers_every_row_once_per_epoch() -> None:
    grpo = GrpoConfig(epochs=3, mini_batches=4)
    order = update_order(10, grpo=grpo, seed=7)
    assert len(order) == 12 and [len(rows) for rows in order[:4]] == [3, 3, 2, 2]
    for epoch in range(3):
        assert sorted(torch.cat(order[epoch * 4:(epoch + 1) * 4]).tolist()) == list(range(10))
    assert torch.cat(order[:4]).tolist() != torch.cat(order[4:8]).tolist()  # shuffled again each pass
    again = update_order(10, grpo=grpo, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(order, again))  # every rank draws the same order
    assert [r.tolist() for r in update_order(10, grpo=GrpoConfig(), seed=7)] == [list(range(10))]


def test_the_ranks_shares_of_a_mini_batch_sum_to_its_gradient(tiny_qwen3: Path) -> None:
    """A mini-batch's normaliser counts all its rows, so the ranks' summed gradients are the mini-batch's own."""
    model = load_pretrained(tiny_qwen3).model.train()
    prompts = [[1, 2, 3]] * 5
    responses = [[4, 5], [6], [7, 8, 9], [10, 11], [12]]
    batch = collate_rollouts(prompts, responses, [[-1.0] * len(r) for r in responses], [1.0, -1.0, 0.5, 2.0, -0.3], pad_id=0)
    mini = batch.select(torch.tensor([4, 0, 2, 3]))
    grpo = GrpoConfig()

    def gradients(share: RankShare) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        rows, passes = share.rows(mini, 1)
        accumulate_gradients(model, rows, grpo=grpo, temperature=1.0, micro_batch_size=1, passes=passes,
                             normalizer=loss_normalizer(mini, "token"), sync=True)
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    whole = gradients(RankShare())
    summed = [a + b for a, b in zip(gradients(RankShare(rank=0, world=2)), gradients(RankShare(rank=1, world=2)))]
    assert max((a - b).abs().max().item() for a, b in zip(whole, summed)) < 1e-6
    assert max(g.abs().max().item() for g in whole) > 1e-4


def test_behaviour_weights_keep_the_versions_a_batch_can_still_come_from(tiny_qwen3: Path) -> None:
    model = load_pretrained(tiny_qwen3).model
    kept = BehaviourWeights(max_policy_age=2)
    first = next(model.parameters())
    values = {}
    for version in range(4):
        with torch.no_grad():
            first.add_(1.0)
        values[version] = first.detach().clone()
        kept.record(model, version=version)
    assert len(kept) == 3 and not kept.has(0) and all(kept.has(v) for v in (1, 2, 3))
    with kept.weights_of(model, version=1):
        assert torch.equal(first, values[1])
    assert torch.equal(first, values[3])
    with pytest.raises(RuntimeError, match="inside"), kept.weights_of(model, version=2):
        raise RuntimeError("inside")
    assert torch.equal(first, values[3])  # restored on an error too
    with pytest.raises(KeyError, match="version 0"), kept.weights_of(model, version=0):
        pass
    nothing = BehaviourWeights(max_policy_age=0)
    nothing.record(model, version=5)
    assert len(nothing) == 0


def test_pi_old_of_an_older_batch_is_computed_with_that_versions_weights(tiny_qwen3: Path) -> None:
    model = load_pretrained(tiny_qwen3).model.train()
    then = copy.deepcopy(model)
    kept = BehaviourWeights(max_policy_age=1)
    kept.record(model, version=4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kept.record(model, version=5)
    batch = collate_rollouts([[1, 2, 3]] * 2, [[4, 5, 6], [7, 8]], [[-1.0] * 3, [-1.0] * 2], [1.0, -1.0], pad_id=0)
    grpo = GrpoConfig(mode="async", max_policy_age=1, rollout_correction=RolloutCorrection())
    found = prepare_old_logprobs(model, batch, grpo=grpo, temperature=1.0, micro_batch_size=1, policy_age=1,
                                 batch_version=4, behaviour=kept)
    expected = sequence_logprobs(then, batch, micro_batch_size=2, temperature=1.0, packing=grpo.packing)
    now = sequence_logprobs(model, batch, micro_batch_size=2, temperature=1.0, packing=grpo.packing)
    assert found == {"mismatch/behaviour_weights": 1.0}
    assert torch.allclose(batch.old_logprobs, expected, atol=1e-6) and not torch.allclose(now, expected, atol=1e-3)
    missing = prepare_old_logprobs(model, batch, grpo=grpo, temperature=1.0, micro_batch_size=1, policy_age=1,
                                   batch_version=3, behaviour=kept)
    assert missing == {"mismatch/behaviour_weights": 0.0} and torch.allclose(batch.old_logprobs, now, atol=1e-6)
    assert prepare_old_logprobs(model, batch, grpo=GrpoConfig(), temperature=1.0, micro_batch_size=1, policy_age=0,
                                batch_version=5, behaviour=None) == {}


def test_kl_in_the_reward_is_taken_before_the_group_advantages() -> None:
    batch = collate_rollouts([[1]] * 4, [[2, 3], [4], [5, 6], [7]], [[-1.0, -1.0], [-2.0], [-1.0, -1.0], [-0.5]],
                             [0.0] * 4, pad_id=0)
    batch.ref_logprobs = batch.behaviour_logprobs - torch.where(batch.response_mask, 0.5, 0.0)  # k1 = 0.5 per token
    grpo = GrpoConfig(group_size=2, kl_coef=0.2, kl_in="reward", kl_estimator="k1")
    penalty = kl_reward_advantages(batch, [1.0, 1.0, 0.0, 1.0], grpo=grpo)
    # penalties 0.2 (2 tokens), 0.1, 0.2, 0.1: shaped rewards 0.8, 0.9 | -0.2, 0.9
    assert penalty == pytest.approx((0.2 + 0.1 + 0.2 + 0.1) / 4)
    assert torch.allclose(batch.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-4)
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match="needs reference log-probs"):
        kl_reward_advantages(batch, [1.0, 1.0, 0.0, 1.0], grpo=grpo)
    batch.ref_logprobs = batch.behaviour_logprobs - torch.where(batch.response_mask, 0.5, 0.0)
    dr = GrpoConfig(group_size=2, kl_coef=0.2, kl_in="reward", kl_estimator="k1", loss="dr_grpo")
    kl_reward_advantages(batch, [1.0, 1.0, 0.0, 1.0], grpo=dr)
    assert torch.allclose(batch.advantages, torch.tensor([-0.05, 0.05, -0.55, 0.55]), atol=1e-6)


def test_several_updates_per_batch_on_the_single_process_recipe(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sink = MemorySink()
    config = make_config("grpo", folder, *GRPO, "trainer.steps=3", "trainer.optimizer.lr=1e-3", "grpo.epochs=2",
                         "grpo.mini_batches=2", "trainer.micro_batch_size=16", "trainer.optimizer.schedule=linear")
    result = train_grpo(config, Recorder([sink]))
    assert [m["train/updates"] for m in result.metrics] == [4, 4, 4]
    # the first update of a step is on-policy; the later ones see the ratio move, so the clip has work to do
    assert max(m["ratio/max"] for m in result.metrics) > 1.0 + 1e-3
    assert all(m["mismatch/abs_max"] < 1e-4 for m in result.metrics)  # pi_old computed before the updates
    lrs = [v for _, v in sink.series("lr")]  # each step's last update's: the schedule counts all 12 updates
    assert lrs == pytest.approx([1e-3 * (1 - k / 12) for k in (3, 7, 11)], rel=1e-6)


def test_async_correction_uses_the_weights_that_made_each_batch(sft_warm_start: tuple[Path, float], make_config) -> None:
    """Async, max_policy_age 2: pi_old under the batch's own version agrees with the generator (same numerics on
    CPU), where the trainer's newer weights would not."""
    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *GRPO, "trainer.steps=5", "trainer.optimizer.lr=3e-3", "grpo.mode=async",
                         "grpo.max_policy_age=2", "grpo.rollout_correction.mode=truncate")
    result = train_grpo(config, Recorder())
    ages = [m["staleness/policy_age"] for m in result.metrics]
    assert max(ages) == 2
    for metrics in result.metrics:
        if metrics["staleness/policy_age"]:  # pi_old takes its own forward only for an older batch
            assert metrics["mismatch/behaviour_weights"] == 1.0
        else:
            assert "mismatch/behaviour_weights" not in metrics
        assert metrics["mismatch/abs_max"] < 1e-3 and metrics["mismatch/truncated_share"] == 0.0
    stale = [m for m in result.metrics if m["staleness/policy_age"] > 0]
    assert stale and all(m["ratio/max"] > 1.0 + 1e-4 or m["ratio/min"] < 1.0 - 1e-4 for m in stale)
