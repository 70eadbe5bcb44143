"""GRPO advantages and clipped-ratio loss, dual clip, k3 KL, aggregation, chunked log-probs, SFT loss: exact small cases."""

from __future__ import annotations

import pytest
import torch

from workers.engine.config import GrpoConfig
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


def test_dual_clip_bounds_an_extreme_ratio_against_a_negative_advantage() -> None:
    # the generator scored the token at -12, the trainer at -1: ratio e^11, about 6e4
    mask = torch.tensor([[True, True]])
    behaviour = torch.tensor([[-12.0, -1.0]])
    logprobs = torch.tensor([[-1.0, -1.1]], requires_grad=True)
    plain, plain_metrics = grpo_loss(logprobs, behaviour, torch.tensor([-1.0]), mask, clip_epsilon=0.2)
    assert plain.item() == pytest.approx((torch.exp(torch.tensor(11.0)).item() + torch.exp(torch.tensor(-0.1)).item()) / 2, rel=1e-5)
    assert plain.item() > 2e4 and plain_metrics["dual_clip_fraction"] == 0.0
    loss, metrics = grpo_loss(logprobs, behaviour, torch.tensor([-1.0]), mask, clip_epsilon=0.2, dual_clip=3.0)
    # token 0: max(min(r * -1, 1.2 * -1), 3 * -1) = -3; token 1 (ratio 0.905, inside the clip): r * -1
    assert loss.item() == pytest.approx((3.0 + torch.exp(torch.tensor(-0.1)).item()) / 2, abs=1e-6)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 2) and metrics["clip_fraction"] == 0.0
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0  # the dual-clipped token passes no gradient
    assert logprobs.grad[0, 1].item() == pytest.approx(torch.exp(torch.tensor(-0.1)).item() / 2, abs=1e-6)
    assert logprobs.grad.abs().max() <= 3.0


@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0, 2.99])
def test_dual_clip_leaves_ratios_below_c_alone(ratio: float) -> None:
    mask = torch.tensor([[True], [True]])
    behaviour = torch.log(torch.tensor([[0.2], [0.2]]))
    logprobs = behaviour + torch.log(torch.tensor(ratio))
    advantages = torch.tensor([-1.0, 2.0])
    plain, _ = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2)
    dual, metrics = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2, dual_clip=3.0)
    assert dual.item() == pytest.approx(plain.item(), abs=1e-6) and metrics["dual_clip_fraction"] == 0.0


def test_dual_clip_does_not_touch_positive_advantages() -> None:
    mask = torch.tensor([[True]])
    behaviour = torch.tensor([[-12.0]])
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    loss, metrics = grpo_loss(logprobs, behaviour, torch.tensor([1.0]), mask, clip_epsilon=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.2) and metrics["clip_fraction"] == 1.0 and metrics["dual_clip_fraction"] == 0.0


def test_dual_clip_is_on_by_default_with_the_papers_constant() -> None:
    assert GrpoConfig().dual_clip == 3.0
    assert GrpoConfig(dual_clip=None).dual_clip is None
    with pytest.raises(ValueError):
        GrpoConfig(dual_clip=1.0)


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


def _plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(dim=-1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 5, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_chunked_logprobs_match_the_plain_formula_in_value_and_gradient(chunk_tokens: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(chunk_tokens)
    logits = (3.0 * torch.randn(2, 5, 11, generator=gen)).requires_grad_(True)  # L = 5, B * L = 10
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    weights = torch.randn(2, 5, generator=gen)
    chosen, entropy = token_logprobs(logits, targets, temperature, chunk_tokens=chunk_tokens)
    (chosen * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    plain_chosen, plain_entropy = _plain_logprobs(logits, targets, temperature)
    (plain_chosen * weights).sum().backward()
    assert torch.allclose(chosen, plain_chosen, atol=1e-6) and torch.allclose(entropy, plain_entropy, atol=1e-5)
    assert torch.allclose(grad, logits.grad, atol=1e-6)
    assert not entropy.requires_grad  # a metric: no graph behind it


def test_chunked_logprobs_of_bf16_logits_keep_their_dtype_in_the_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 9, generator=gen).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 9, (1, 6), generator=gen)
    token_logprobs(logits, targets, 0.8, chunk_tokens=4)[0].sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    _plain_logprobs(logits, targets, 0.8)[0].sum().backward()
    assert grad.dtype == torch.bfloat16 and torch.allclose(grad.float(), logits.grad.float(), atol=1e-2)


def test_chunked_logprobs_keep_nothing_but_the_logits_for_backward() -> None:
    logits = torch.randn(2, 8, 50, requires_grad=True)
    targets = torch.randint(0, 50, (2, 8))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits, targets, 0.9, chunk_tokens=3)
    assert sum(t.numel() for t in saved if t.is_floating_point()) == logits.numel()


def test_sft_loss_gradient_matches_the_plain_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 700, 13, generator=gen, requires_grad=True)  # more positions than one chunk
    targets = torch.randint(0, 13, (2, 700), generator=gen)
    mask = torch.rand(2, 700, generator=gen) > 0.3
    loss, _ = sft_loss(logits, targets, mask)
    loss.backward()
    grad = logits.grad.clone()
    logits.grad = None
    plain = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    plain.backward()
    assert loss.item() == pytest.approx(plain.item(), abs=1e-5) and torch.allclose(grad, logits.grad, atol=1e-7)
