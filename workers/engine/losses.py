"""GRPO and SFT losses.

GRPO's importance ratio is pi_theta(token) / mu(token), where mu is the generator's
recorded log-prob at the sampling temperature. No "old policy" forward is recomputed:
when rollouts come from stale weights (async mode) the ratio corrects for exactly the
policy that produced them, and the clip bounds how far one update moves from it.

Log-probs and entropy are computed a chunk of token positions at a time: nothing the size of
the logits is kept for backward besides the logits themselves, which matters with a 150k vocabulary.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Aggregation = Literal["token", "sequence", "sequence_sum", "constant"]
LossName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
KlEstimator = Literal["k1", "k2", "k3"]


LOGPROB_CHUNK_TOKENS = 256  # token positions per softmax: one [256, V] fp32 block at a time


def chunk_logprobs(scaled: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's (log-prob of each target [C], entropy [C] or None) from its tempered float32 logits [C, V], which
    it overwrites with their log-softmax."""
    scaled.sub_(torch.logsumexp(scaled, dim=-1, keepdim=True))
    chosen = scaled.gather(-1, targets).squeeze(-1)
    return chosen, (-scaled.exp().mul_(scaled).sum(dim=-1) if with_entropy else None)


def chunk_grad_logits(scaled: torch.Tensor, targets: torch.Tensor, grad_chosen: torch.Tensor,
                      grad_entropy: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """One chunk's float32 gradient in its logits [C, V] from its tempered float32 logits (overwritten):
    d logp[target] / d logits = (onehot(target) - softmax) / temperature, and with `grad_entropy` (an entropy bonus)
    d entropy / d logits = -softmax * (log softmax + entropy) / temperature."""
    if grad_entropy is not None:
        logp = torch.log_softmax(scaled, dim=-1)
        del scaled
        probs = logp.exp()
        entropy = -(probs * logp).sum(dim=-1, keepdim=True)
        entropy_term = logp.add_(entropy).mul_(probs).mul_(-grad_entropy)
    else:  # softmax in place
        probs = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
        probs.div_(probs.sum(dim=-1, keepdim=True))
    probs.mul_(-grad_chosen)
    probs.scatter_add_(-1, targets, grad_chosen)
    if grad_entropy is not None:
        probs.add_(entropy_term)
    return probs.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per position, and optionally the entropy, a chunk at a time.

    Saves only the logits and targets; backward recomputes each chunk's softmax (chunk_grad_logits).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int,
                with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        chosen = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty(flat.shape[0] if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_tokens):
            end = start + chunk_tokens
            scaled = flat[start:end].to(torch.float32, copy=True).div_(temperature)
            chosen[start:end], chunk_entropy = chunk_logprobs(scaled, flat_targets[start:end], with_entropy=with_entropy)
            if with_entropy:
                entropy[start:end] = chunk_entropy
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad = temperature, chunk_tokens, entropy_grad
        entropy = entropy.view(targets.shape) if with_entropy else entropy
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return chosen.view(targets.shape), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_chosen: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets = ctx.saved_tensors
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        flat_grad = grad_chosen.reshape(-1, 1).float()
        flat_grad_entropy = grad_entropy.reshape(-1, 1).float() if ctx.entropy_grad else None
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            grad[start:end] = chunk_grad_logits(
                flat[start:end].to(torch.float32, copy=True).div_(ctx.temperature), flat_targets[start:end],
                flat_grad[start:end], None if flat_grad_entropy is None else flat_grad_entropy[start:end],
                ctx.temperature)
        return grad.view(logits.shape), None, None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each position) under softmax(logits / temperature).

    The log-probs carry the gradient; the entropy is a metric and carries none unless `entropy_grad`
    (an entropy bonus in the loss).
    """
    return _ChunkedLogprobs.apply(logits, targets, temperature, chunk_tokens, True, entropy_grad)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, std_normalised: bool = True) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for rewards laid out group after group; r - group mean when not
    `std_normalised` (Dr. GRPO: dividing by the std favours groups that nearly agree)."""
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if not std_normalised:
        return (groups - mean).view(-1)
    std = groups.std(dim=1, keepdim=True, unbiased=False)
    return ((groups - mean) / (std + eps)).view(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - pi. Always >= 0."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Schulman's estimators of KL(pi || ref) per token from samples of pi: k1 = log pi - log ref (unbiased,
    can be negative), k2 = (log pi - log ref)^2 / 2, k3 as k3_kl (unbiased, >= 0)."""
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    return log_ratio if estimator == "k1" else 0.5 * log_ratio.square()


def rollout_importance_weights(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
    level: Literal["token", "sequence"], mode: Literal["truncate", "mask"], threshold: float, threshold_low: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights w = pi_old / mu [B, T] between the trainer's log-probs under the behaviour weights and the
    generator's, without gradient (truncated IS: Yao et al. 2025; masked IS: IcePop, verl's rollout correction).

    level token: one w per token; sequence: one per response, exp(sum of its tokens' log-ratios), for all its tokens.
    mode truncate: min(w, threshold); mask: w where threshold_low <= w <= threshold, else 0 (the token, or at the
    sequence level the whole response, leaves the policy loss). Metrics: the weights' token mean and the share of
    response tokens truncated or masked.
    """
    m = mask.bool()
    log_w = torch.where(m, trainer_logprobs.detach() - behaviour_logprobs, 0.0)
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    # bounded before exp so a long response cannot overflow; every value beyond a bound is cut the same way
    log_w = log_w.clamp(math.log(threshold_low) - 1.0, math.log(threshold) + 1.0)
    weights = torch.exp(log_w)
    if mode == "truncate":
        cut = weights > threshold
        weights = weights.clamp(max=threshold)
    else:
        cut = (weights > threshold) | (weights < threshold_low)
        weights = torch.where(cut, 0.0, weights)
    weights = torch.where(m, weights, 0.0)
    n = max(int(m.sum()), 1)
    share = float(cut[m].sum()) / n
    return weights, {"is_weight_mean": float(weights[m].sum()) / n,
                     "is_truncated_share": share if mode == "truncate" else 0.0,
                     "is_masked_share": share if mode == "mask" else 0.0}


def _aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normalizer: float | None) -> torch.Tensor:
    """Sum of per-token values over the response, scaled so micro-batches add up to the batch mean.

    token: every response token in the batch weighs the same (normalizer = batch token count).
    sequence: each sequence's mean token value weighs the same (normalizer = batch sequence count).
    sequence_sum: each sequence's token sum weighs the same (normalizer = batch sequence count).
    constant: the token sum over a constant, batch sequences x generator.max_new_tokens (Dr. GRPO); without a
    normalizer, this micro-batch's sequences x its padded response width.
    """
    values = torch.where(mask.bool(), values, 0.0)
    mask = mask.float()
    if aggregation == "token":
        return values.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1.0))
    if aggregation == "constant":
        return values.sum() / (normalizer if normalizer is not None else float(values.numel()))
    per_sequence = values.sum(dim=1)
    if aggregation == "sequence":
        per_sequence = per_sequence / mask.sum(dim=1).clamp(min=1.0)
    return per_sequence.sum() / (normalizer if normalizer is not None else values.shape[0])


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_epsilon: float,
    clip_epsilon_high: float | None = None,
    dual_clip: float | None = None,
    loss: LossName = "grpo",
    aggregation: Aggregation = "token",
    kl_coef: float = 0.0,
    kl_estimator: KlEstimator = "k3",
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    normalizer: float | None = None,
    old_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss over response tokens [B, T]; advantages are per sequence [B].

    The ratio r = pi_theta / mu (the generator's log-probs), or pi_theta / pi_old with `old_logprobs` (the trainer's
    under the behaviour weights, for a rollout correction), is clipped to [1 - clip_epsilon, 1 + clip_epsilon_high] (symmetric when
    clip_epsilon_high is None). The losses:
    - grpo (Shao et al. 2024, DeepSeekMath): PPO's clipped surrogate -min(r A, clip(r) A) per token.
    - dapo (Yu et al. 2025, DAPO): the same with clip-higher, a larger upper epsilon so unlikely tokens with a
      positive advantage can grow (paper 0.2 / 0.28), and token-level aggregation.
    - dr_grpo (Liu et al. 2025, "Understanding R1-Zero-like Training"): the same surrogate; its advantages are not
      std-normalised (score_rollouts) and its aggregation is a constant normaliser.
    - gspo (Zheng et al. 2025, GSPO): the sequence-level ratio s = exp(mean over the response of log r), clipped
      with small epsilons (paper 3e-4 / 4e-4), the same s for every token of the sequence.
    - cispo (MiniMax 2025, MiniMax-M1): REINFORCE weighted by the clipped, stop-gradient ratio:
      -sg(clip(r)) A log pi_theta; every token keeps a gradient. dual_clip does not apply (the weight is bounded).

    `dual_clip` (c > 1; dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c) bounds the objective of a token with a
    negative advantage from below by c * A: however far the ratio has grown, that token's loss is at most
    c * |A| and it passes no gradient. None: plain PPO clip, where the ratio has no upper bound for A < 0.

    `is_weights` [B, T] (rollout_importance_weights, no gradient) multiply each token's policy loss, not its KL or
    entropy terms.

    `entropy_coef` > 0 subtracts coef x entropy per token (an entropy bonus; `entropy` then needs its gradient,
    token_logprobs(..., entropy_grad=True)).

    Returns the loss and token-mean metrics over this micro-batch's response tokens; `mismatch_abs_*` compare the
    trainer's log-probs (`old_logprobs` when given, else these) with the generator's.
    """
    low, high = clip_epsilon, clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    m = mask.bool()
    denominator = behaviour_logprobs if old_logprobs is None else old_logprobs
    log_ratio = torch.where(m, logprobs - denominator, 0.0)  # padding: ratio 1, whatever it holds
    if loss == "gspo":
        sequence = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1)
        ratio = torch.exp(sequence)[:, None].expand_as(logprobs)
    else:
        ratio = torch.exp(log_ratio)
    adv = advantages[:, None].float()
    dual_clipped = torch.zeros_like(ratio, dtype=torch.bool)
    if loss == "cispo":
        objective = ratio.detach().clamp(1.0 - low, 1.0 + high) * adv * logprobs
        was_clipped = (ratio > 1.0 + high) | (ratio < 1.0 - low)
    else:
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
        objective = torch.minimum(unclipped, clipped)
        if dual_clip is not None:
            floor = dual_clip * adv
            dual_clipped = (adv < 0) & (objective < floor)
            objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
        was_clipped = ((adv > 0) & (ratio > 1.0 + high)) | ((adv < 0) & (ratio < 1.0 - low))
    per_token = -objective if is_weights is None else -objective * is_weights
    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if kl_coef > 0.0:
            per_token = per_token + kl_coef * kl
    elif kl_coef > 0.0:
        raise ValueError("kl_coef > 0 needs reference log-probs")
    if entropy_coef > 0.0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the entropy with its gradient")
        per_token = per_token - entropy_coef * entropy
    value = _aggregate(per_token, mask, aggregation, normalizer)

    with torch.no_grad():
        n = max(int(m.sum()), 1)
        metrics = {
            "ratio_mean": float(ratio[m].sum()) / n,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            "ratio_min": float(ratio[m].min()) if m.any() else 1.0,
            "clip_fraction": float(was_clipped[m].sum()) / n,
            "dual_clip_fraction": float(dual_clipped[m].sum()) / n,
            **mismatch_metrics(logprobs if old_logprobs is None else old_logprobs, behaviour_logprobs, mask),
            "tokens": float(m.sum()),
        }
        if kl is not None:
            metrics["kl"] = float(kl[m].sum()) / n
        if entropy is not None:
            metrics["entropy"] = float(entropy[m].sum()) / n
    return value, metrics


def mismatch_metrics(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |log pi_trainer - log mu| over response tokens: how far generator and trainer disagree."""
    m = mask.bool()
    gap = (trainer_logprobs.detach() - behaviour_logprobs).abs()[m]
    return {"mismatch_abs_mean": float(gap.sum()) / max(int(m.sum()), 1),
            "mismatch_abs_max": float(gap.max()) if m.any() else 0.0}


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, *, normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the positions where loss_mask is True (response tokens only)."""
    logp, _ = _ChunkedLogprobs.apply(logits, targets, 1.0, LOGPROB_CHUNK_TOKENS, False, False)
    mask = loss_mask.float()
    count = mask.sum()
    loss = -(logp * mask).sum() / (normalizer if normalizer is not None else count.clamp(min=1.0))
    with torch.no_grad():
        n = max(float(count), 1.0)
        metrics = {"nll": float(-(logp * mask).sum()) / n, "tokens": float(count)}
    return loss, metrics
