"""GRPO advantages and clipped-ratio loss, dual clip, k3 KL, aggregation, chunked log-probs, SFT loss: exact small cases."""

from __future__ import annotations

import pytest
import torch

from workers.engine.config import GrpoConfig
from workers.engine.losses import group_advantages, grpo_loss, k3_kl, kl_estimate, sft_loss, token_logprobs


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


# --- the loss family: each against its paper's formula written out, and TRL's where TRL has the loss ---

def _moved_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences, a padded tail; the policy moved by log-ratios that cross both clip bounds."""
    mask, advantages, behaviour = _case()
    log_ratio = torch.tensor([[0.4, -0.1, 0.05, 0.0], [-0.7, 0.0, 0.0, 0.0]])
    return mask, advantages, behaviour, behaviour + log_ratio


def _trl_loss(logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float,
              eps_high: float, level: str, loss_type: str, max_completion_length: int = 0) -> torch.Tensor:
    """TRL GRPOTrainer's per-token loss and aggregation (trl/trainer/grpo_trainer.py), rewritten here."""
    mask = mask.float()
    log_ratio = logprobs - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    assert loss_type == "dr_grpo"
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


def _grad(fn, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logprobs.clone().requires_grad_(True)
    value = fn(leaf)
    value.backward()
    return value.detach(), leaf.grad


@pytest.mark.parametrize(("loss", "aggregation", "eps", "level", "trl_type"), [
    ("grpo", "token", (0.2, 0.2), "token", "bnpo"),
    ("grpo", "sequence", (0.2, 0.2), "token", "grpo"),
    ("dapo", "token", (0.2, 0.28), "token", "dapo"),
    ("dr_grpo", "constant", (0.2, 0.2), "token", "dr_grpo"),
    ("gspo", "sequence", (3e-4, 4e-4), "sequence", "grpo"),
    ("gspo", "sequence", (0.2, 0.28), "sequence", "grpo"),
])
def test_losses_match_trl_in_value_and_gradient(loss: str, aggregation: str, eps: tuple[float, float], level: str,
                                                trl_type: str) -> None:
    mask, advantages, behaviour, logprobs = _moved_case()
    ours, our_grad = _grad(lambda lp: grpo_loss(lp, behaviour, advantages, mask, clip_epsilon=eps[0], clip_epsilon_high=eps[1],
                                                loss=loss, aggregation=aggregation)[0], logprobs)
    trl, trl_grad = _grad(lambda lp: _trl_loss(lp, behaviour, advantages, mask, eps_low=eps[0], eps_high=eps[1], level=level,
                                               loss_type=trl_type, max_completion_length=4), logprobs)
    assert ours.item() == pytest.approx(trl.item(), abs=1e-6)
    assert torch.allclose(our_grad, trl_grad, atol=1e-6)


def test_dapo_clip_higher_lets_a_positive_advantage_ratio_reach_1_28() -> None:
    mask = torch.tensor([[True, True]])
    behaviour = torch.log(torch.tensor([[0.1, 0.1]]))
    logprobs = behaviour + torch.log(torch.tensor([[1.25, 1.5]]))
    value, grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([1.0]), mask, clip_epsilon=0.2,
                                             clip_epsilon_high=0.28, loss="dapo")[0], logprobs)
    # 1.25 is inside [0.8, 1.28] and keeps its gradient r * A / N; 1.5 stops at 1.28 and passes none
    assert value.item() == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6)
    assert grad[0, 0].item() == pytest.approx(-1.25 / 2, abs=1e-6) and grad[0, 1].item() == 0.0
    symmetric, symmetric_grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([1.0]), mask, clip_epsilon=0.2)[0], logprobs)
    assert symmetric.item() == pytest.approx(-(1.2 + 1.2) / 2, abs=1e-6) and symmetric_grad[0, 0].item() == 0.0
    # the lower bound stays 1 - 0.2 for a negative advantage
    _, metrics = grpo_loss(behaviour + torch.log(torch.tensor([[0.79, 0.81]])), behaviour, torch.tensor([-1.0]), mask,
                           clip_epsilon=0.2, clip_epsilon_high=0.28, loss="dapo")
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_dr_grpo_advantages_and_constant_normaliser() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    assert torch.allclose(group_advantages(rewards, 4, std_normalised=False),
                          torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]))
    mask, advantages, behaviour = _case()
    value, grad = _grad(lambda lp: grpo_loss(lp, behaviour, advantages, mask, clip_epsilon=0.2, aggregation="constant",
                                             normalizer=2 * 10)[0], behaviour)
    # on-policy: -(sum of r A over response tokens) / (sequences x max_new_tokens), whatever each length
    assert value.item() == pytest.approx(-(3 * 1.0 + 1 * -2.0) / 20)
    assert torch.allclose(grad, torch.tensor([[-1.0, -1.0, -1.0, 0.0], [2.0, 0.0, 0.0, 0.0]]) / 20)


@pytest.mark.parametrize("aggregation", ["sequence_sum", "constant"])
def test_new_aggregations_add_up_over_micro_batches(aggregation: str) -> None:
    mask, advantages, behaviour, logprobs = _moved_case()
    normalizer = 2.0 if aggregation == "sequence_sum" else 2.0 * 4
    whole, _ = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2, aggregation=aggregation, normalizer=normalizer)
    parts = [grpo_loss(logprobs[i:i + 1], behaviour[i:i + 1], advantages[i:i + 1], mask[i:i + 1], clip_epsilon=0.2,
                       aggregation=aggregation, normalizer=normalizer)[0] for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)
    sequence_sum, _ = grpo_loss(behaviour, behaviour, advantages, mask, clip_epsilon=0.2, aggregation="sequence_sum")
    assert sequence_sum.item() == pytest.approx(-(3 * 1.0 + 1 * -2.0) / 2)  # mean over sequences of each token sum


def test_gspo_sequence_ratio_in_value_and_gradient() -> None:
    mask = torch.tensor([[True, True, False]])
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    log_ratio = torch.tensor([[0.02, -0.01, 30.0]])  # the padded token's huge ratio must change nothing
    logprobs = behaviour + log_ratio
    eps = 0.2
    value, grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([1.0]), mask, clip_epsilon=eps, loss="gspo",
                                             aggregation="sequence")[0], logprobs)
    s = torch.exp(torch.tensor(0.005)).item()  # exp(mean of 0.02, -0.01)
    assert value.item() == pytest.approx(-s, abs=1e-6)
    # d(-s A)/d logp_t = -s A / |y| on each response token, 0 on padding
    assert torch.allclose(grad, torch.tensor([[-s / 2, -s / 2, 0.0]]), atol=1e-6)
    # with the paper's epsilons the sequence (s = 1.005 > 1 + 4e-4) is clipped: no gradient for any token
    _, clipped_grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([1.0]), mask, clip_epsilon=3e-4,
                                                 clip_epsilon_high=4e-4, loss="gspo", aggregation="sequence")[0], logprobs)
    assert torch.equal(clipped_grad, torch.zeros_like(clipped_grad))


def test_cispo_keeps_a_gradient_through_the_clipped_stop_gradient_weight() -> None:
    mask = torch.tensor([[True, True, True, False]])
    behaviour = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.2]]))
    ratios = torch.tensor([[0.5, 1.1, 8.0, 1e6]])  # the padded token's ratio changes nothing
    logprobs = behaviour + torch.log(ratios)
    value, grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([2.0]), mask, clip_epsilon=1.0, clip_epsilon_high=5.0,
                                             loss="cispo")[0], logprobs)
    weights = torch.tensor([[0.5, 1.1, 6.0, 0.0]])  # clip(r, 1 - 1, 1 + 5), sg: a constant in the gradient
    assert value.item() == pytest.approx(-(weights * 2.0 * logprobs).sum().item() / 3, rel=1e-6)
    assert torch.allclose(grad, -weights * 2.0 / 3, atol=1e-6)  # even the clipped token (r = 8) keeps its gradient


def test_cispo_bounds_the_extreme_ratio_case() -> None:
    """The issue's case: generator -12, trainer -1, A = -1. PPO without dual clip gives ~6e4; CISPO's weight is capped."""
    mask = torch.tensor([[True]])
    behaviour, logprobs = torch.tensor([[-12.0]]), torch.tensor([[-1.0]])
    value, grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([-1.0]), mask, clip_epsilon=1.0, clip_epsilon_high=5.0,
                                             loss="cispo")[0], logprobs)
    assert value.item() == pytest.approx(6.0 * -1.0, abs=1e-5) and grad.item() == pytest.approx(6.0, abs=1e-5)
    plain, plain_grad = _grad(lambda lp: grpo_loss(lp, behaviour, torch.tensor([-1.0]), mask, clip_epsilon=0.2)[0], logprobs)
    assert plain.item() > 5e4 and plain_grad.item() > 5e4


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator: str) -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    d = torch.log(torch.tensor(2.0)).item()  # log pi - log ref on the first token
    expected = {"k1": d, "k2": 0.5 * d * d, "k3": 0.5 + d - 1.0}[estimator]
    kl = kl_estimate(logprobs, ref, estimator)
    assert kl[0, 0].item() == pytest.approx(expected, abs=1e-6) and kl[0, 1].item() == pytest.approx(0.0, abs=1e-7)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, grad = _grad(lambda lp: grpo_loss(lp, lp.detach(), torch.tensor([0.0]), mask, clip_epsilon=0.2, kl_coef=0.5,
                                         kl_estimator=estimator, ref_logprobs=ref)[0], logprobs)
    expected_grad = {"k1": 1.0, "k2": d, "k3": 1.0 - 0.5}[estimator]  # d/d logp of each estimator at the first token
    assert grad[0, 0].item() == pytest.approx(0.5 * expected_grad / 2, abs=1e-6)


def test_mismatch_metrics_over_response_tokens_and_parts() -> None:
    from workers.engine.grpo_metrics import update_metrics

    mask = torch.tensor([[True, True, False], [True, False, False]])
    behaviour = torch.zeros(2, 3) - 1.0
    logprobs = behaviour + torch.tensor([[0.1, -0.3, 50.0], [0.2, 9.0, 9.0]])  # padding never counts
    _, metrics = grpo_loss(logprobs, behaviour, torch.tensor([1.0, 1.0]), mask, clip_epsilon=0.2)
    assert metrics["mismatch_abs_mean"] == pytest.approx(0.6 / 3, abs=1e-6)
    assert metrics["mismatch_abs_max"] == pytest.approx(0.3, abs=1e-6)
    _, first = grpo_loss(logprobs[:1], behaviour[:1], torch.tensor([1.0]), mask[:1], clip_epsilon=0.2)
    _, second = grpo_loss(logprobs[1:], behaviour[1:], torch.tensor([1.0]), mask[1:], clip_epsilon=0.2)
    merged = update_metrics([first, second])
    assert merged["mismatch/abs_mean"] == pytest.approx(0.6 / 3, abs=1e-6)  # token-weighted over micro-batches
    assert merged["mismatch/abs_max"] == pytest.approx(0.3, abs=1e-6)


@pytest.mark.parametrize(("loss", "aggregation", "low", "high", "std"), [
    ("grpo", "token", 0.2, 0.2, True),
    ("dapo", "token", 0.2, 0.28, True),
    ("dr_grpo", "constant", 0.2, 0.2, False),
    ("gspo", "sequence", 3e-4, 4e-4, True),
    ("cispo", "token", 1.0, 5.0, True),
])
def test_each_loss_brings_its_defaults(loss: str, aggregation: str, low: float, high: float, std: bool) -> None:
    grpo = GrpoConfig(loss=loss)
    assert (grpo.aggregation, grpo.clip_low, grpo.clip_high, grpo.std_normalised_advantages) == (aggregation, low, high, std)
    assert GrpoConfig().kl_estimator == "k3"


def test_set_options_win_over_the_loss_defaults() -> None:
    grpo = GrpoConfig(loss="dapo", loss_aggregation="sequence", clip_epsilon_high=0.3)
    assert (grpo.aggregation, grpo.clip_low, grpo.clip_high) == ("sequence", 0.2, 0.3)
    assert GrpoConfig(clip_epsilon=0.1).clip_high == 0.1  # grpo: symmetric at clip_epsilon


def test_dr_grpo_keeps_the_group_mean_and_a_constant_normaliser_on_either_backend() -> None:
    from workers.engine.config import load_config

    base = "recipe: grpo\nmodel: {path: /models/m}\n"
    for backend in ("local", "monarch"):
        grpo = load_config(base, overrides=["grpo.loss=dr_grpo", f"placement.backend={backend}"]).grpo
        assert (grpo.aggregation, grpo.std_normalised_advantages) == ("constant", False)


def test_constant_normaliser_counts_max_new_tokens() -> None:
    from workers.engine.batching import collate_rollouts
    from workers.engine.grpo_math import loss_normalizer

    batch = collate_rollouts([[1, 2], [1]], [[3, 4, 5], [6]], [[-1.0, -1.0, -1.0], [-1.0]], [1.0, -1.0], pad_id=0)
    assert loss_normalizer(batch, "token") == 4.0 and loss_normalizer(batch, "sequence_sum") == 2.0
    assert loss_normalizer(batch, "constant", max_new_tokens=16) == 32.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        loss_normalizer(batch, "constant")


@pytest.mark.parametrize("chunk_tokens", [3, 256])
def test_entropy_bonus_gradient_matches_the_plain_formula(chunk_tokens: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (2.0 * torch.randn(2, 4, 7, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, 7, (2, 4), generator=gen)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    advantages, behaviour = torch.tensor([1.0, -0.5]), torch.full((2, 4), -2.0)
    logprobs, entropy = token_logprobs(logits, targets, 1.5, chunk_tokens=chunk_tokens, entropy_grad=True)
    loss, metrics = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2, entropy=entropy, entropy_coef=0.1)
    loss.backward()
    plain_logits = logits.detach().clone().requires_grad_(True)
    plain_logprobs, plain_entropy = _plain_logprobs(plain_logits, targets, 1.5)  # the entropy keeps its graph here
    ratio, adv = torch.exp(plain_logprobs - behaviour), advantages[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    plain = ((-objective - 0.1 * plain_entropy) * mask).sum() / mask.sum()
    plain.backward()
    assert loss.item() == pytest.approx(plain.item(), abs=1e-6)
    assert torch.allclose(logits.grad, plain_logits.grad, atol=1e-6)
    assert metrics["entropy"] == pytest.approx(float((plain_entropy * mask).sum() / mask.sum()), abs=1e-6)


def test_entropy_bonus_needs_the_entropy_gradient() -> None:
    logits, targets = torch.randn(1, 2, 5, requires_grad=True), torch.tensor([[1, 2]])
    logprobs, entropy = token_logprobs(logits, targets)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, clip_epsilon=0.2, entropy=entropy, entropy_coef=0.1)
    assert GrpoConfig().entropy_coef == 0.0


@pytest.mark.parametrize(("overrides", "field"), [
    (["grpo.loss=dapo", "grpo.clip_epsilon=0.1"], "grpo.clip_epsilon"),
    (["grpo.loss=cispo", "grpo.dual_clip=5"], "grpo.dual_clip"),
    (["grpo.kl_estimator=k1"], "grpo.kl_estimator"),
])
def test_loss_options_nothing_reads_are_refused(overrides: list[str], field: str) -> None:
    from workers.engine.config import load_config
    from workers.engine.fields import ConfigError

    base = "recipe: grpo\nmodel: {path: /models/m}\n"
    with pytest.raises(ConfigError, match=field):
        load_config(base, overrides=overrides)
    with pytest.raises(ConfigError, match="grpo.clip_epsilon"):
        load_config(base, overrides=["grpo.loss=dapo", "grpo.clip_epsilon=0.1", "grpo.clip_epsilon_high=0.3"])
    grpo = load_config(base, overrides=["grpo.clip_epsilon=0.1", "grpo.clip_epsilon_high=0.3"]).grpo
    assert (grpo.clip_low, grpo.clip_high) == (0.1, 0.3)
    assert load_config(base, overrides=["grpo.kl_estimator=k1", "reference.enabled=true"]).grpo.kl_estimator == "k1"
