"""GRPO advantages and clipped-ratio loss, k3 KL, aggregation, SFT loss: exact small cases."""

from __future__ import annotations

import pytest
import torch

from workers.engine.losses import group_advantages, grpo_loss, k3_kl, sft_loss, token_logprobs


def test_group_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal when a group agrees


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    advantages = torch.tensor([1.0, -2.0])
    behaviour = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.9], [0.2, 0.9, 0.9, 0.9]]))
    return mask, advantages, behaviour


def test_on_policy_loss_is_the_policy_gradient() -> None:
    mask, advantages, behaviour = _case()
    logprobs = behaviour.clone().requires_grad_(True)
    loss, metrics = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2)
    # ratio 1 everywhere: loss = -(3 * 1 + 1 * -2) / 4 response tokens
    assert loss.item() == pytest.approx(-0.25)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_fraction"] == 0.0
    loss.backward()
    expected = torch.tensor([[-0.25, -0.25, -0.25, 0.0], [0.5, 0.0, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected)


def test_ratio_uses_the_generator_logprob_and_clips() -> None:
    mask, advantages, behaviour = _case()
    # the policy moved: token (0,0) is now 1.5x likelier (beyond 1 + 0.2), token (1,0) 0.5x (beyond 1 - 0.2)
    shift = torch.zeros(2, 4)
    shift[0, 0] = torch.log(torch.tensor(1.5))
    shift[1, 0] = torch.log(torch.tensor(0.5))
    logprobs = (behaviour + shift).requires_grad_(True)
    loss, metrics = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2)
    # (0,0): A=+1, ratio 1.5 -> clipped to 1.2; (1,0): A=-2, ratio 0.5 -> clipped to 0.8
    expected = -(1.2 + 1.0 + 1.0 + 0.8 * -2.0) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 4)
    assert metrics["ratio_max"] == pytest.approx(1.5, abs=1e-5) and metrics["ratio_min"] == pytest.approx(0.5, abs=1e-5)
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[1, 0] == 0.0  # clipped tokens pass no gradient
    assert logprobs.grad[0, 1] != 0.0


def test_clip_does_not_bound_a_ratio_moving_against_the_advantage() -> None:
    mask = torch.tensor([[True]])
    behaviour = torch.log(torch.tensor([[0.5]]))
    logprobs = (behaviour + torch.log(torch.tensor(2.0))).requires_grad_(True)
    loss, metrics = grpo_loss(logprobs, behaviour, torch.tensor([-1.0]), mask, clip_epsilon=0.2)
    assert loss.item() == pytest.approx(2.0, abs=1e-5)  # min(2 * -1, 1.2 * -1) = -2: pessimistic bound
    assert metrics["clip_fraction"] == 0.0


def test_token_and_sequence_aggregation() -> None:
    mask, advantages, behaviour = _case()
    token, _ = grpo_loss(behaviour, behaviour, advantages, mask, clip_epsilon=0.2, aggregation="token")
    sequence, _ = grpo_loss(behaviour, behaviour, advantages, mask, clip_epsilon=0.2, aggregation="sequence")
    assert token.item() == pytest.approx(-0.25)
    assert sequence.item() == pytest.approx(-(1.0 + -2.0) / 2)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_add_up_to_the_batch_loss(aggregation: str) -> None:
    mask, advantages, behaviour = _case()
    logprobs = behaviour + 0.05
    whole, _ = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2, aggregation=aggregation)
    normalizer = float(mask.sum()) if aggregation == "token" else 2.0
    parts = [
        grpo_loss(logprobs[i:i + 1], behaviour[i:i + 1], advantages[i:i + 1], mask[i:i + 1],
                  clip_epsilon=0.2, aggregation=aggregation, normalizer=normalizer)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_k3_kl_penalty() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    kl = k3_kl(logprobs, ref)
    assert kl[0, 1] == 0.0 and kl[0, 0].item() == pytest.approx(0.5 - torch.log(torch.tensor(0.5)).item() - 1.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = grpo_loss(logprobs, logprobs, torch.tensor([0.0]), mask, clip_epsilon=0.2)
    penalised, metrics = grpo_loss(logprobs, logprobs, torch.tensor([0.0]), mask, clip_epsilon=0.2, kl_coef=0.1, ref_logprobs=ref)
    assert penalised.item() == pytest.approx(base.item() + 0.1 * kl.mean().item())
    assert metrics["kl"] == pytest.approx(kl.mean().item())
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logprobs, logprobs, torch.tensor([0.0]), mask, clip_epsilon=0.2, kl_coef=0.1)


def test_tempered_logprobs_and_entropy() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    lp1, ent1 = token_logprobs(logits, torch.tensor([[0]]), temperature=1.0)
    lp2, ent2 = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp1.item() == pytest.approx(torch.log_softmax(logits[0, 0], -1)[0].item())
    assert lp2.item() == pytest.approx(torch.log_softmax(logits[0, 0] / 2, -1)[0].item())
    assert ent2.item() > ent1.item() > 0.0


def test_sft_loss_counts_response_tokens_only() -> None:
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[False, False, True, True]])
    loss, metrics = sft_loss(logits, targets, mask)
    expected = -torch.log_softmax(logits[0, 2:], -1)[torch.arange(2), targets[0, 2:]].mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    changed = logits.clone()
    changed[0, :2] += 5.0  # prompt positions do not matter
    assert sft_loss(changed, targets, mask)[0].item() == pytest.approx(loss.item(), abs=1e-6)
    assert metrics["tokens"] == 2.0
