"""GRPO and SFT losses.

GRPO's importance ratio is pi_theta(token) / mu(token), where mu is the generator's
recorded log-prob at the sampling temperature. No "old policy" forward is recomputed:
when rollouts come from stale weights (async mode) the ratio corrects for exactly the
policy that produced them, and the clip bounds how far one update moves from it.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token", "sequence"]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each position) under softmax(logits / temperature)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for rewards laid out group after group."""
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, unbiased=False)
    return ((groups - mean) / (std + eps)).view(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - pi. Always >= 0."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def _aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normalizer: float | None) -> torch.Tensor:
    """Sum of per-token values over the response, scaled so micro-batches add up to the batch mean.

    token: every response token in the batch weighs the same (normalizer = batch token count).
    sequence: each sequence's mean token value weighs the same (normalizer = batch sequence count).
    """
    mask = mask.float()
    if aggregation == "token":
        total = (values * mask).sum()
        return total / (normalizer if normalizer is not None else mask.sum().clamp(min=1.0))
    per_sequence = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_sequence.sum() / (normalizer if normalizer is not None else values.shape[0])


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_epsilon: float,
    aggregation: Aggregation = "token",
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss over response tokens [B, T]; advantages are per sequence [B].

    Returns the loss and token-mean metrics over this micro-batch's response tokens.
    """
    ratio = torch.exp(logprobs - behaviour_logprobs)
    adv = advantages[:, None].float()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        if kl_coef > 0.0:
            per_token = per_token + kl_coef * kl
    elif kl_coef > 0.0:
        raise ValueError("kl_coef > 0 needs reference log-probs")
    loss = _aggregate(per_token, mask, aggregation, normalizer)

    with torch.no_grad():
        m = mask.bool()
        n = max(int(m.sum()), 1)
        was_clipped = ((adv > 0) & (ratio > 1.0 + clip_epsilon)) | ((adv < 0) & (ratio < 1.0 - clip_epsilon))
        metrics = {
            "ratio_mean": float(ratio[m].sum()) / n,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            "ratio_min": float(ratio[m].min()) if m.any() else 1.0,
            "clip_fraction": float(was_clipped[m].sum()) / n,
            "tokens": float(m.sum()),
        }
        if kl is not None:
            metrics["kl"] = float(kl[m].sum()) / n
        if entropy is not None:
            metrics["entropy"] = float(entropy[m].sum()) / n
    return loss, metrics


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, *, normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the positions where loss_mask is True (response tokens only)."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = loss_mask.float()
    count = mask.sum()
    loss = -(logp * mask).sum() / (normalizer if normalizer is not None else count.clamp(min=1.0))
    with torch.no_grad():
        n = max(float(count), 1.0)
        metrics = {"nll": float(-(logp * mask).sum()) / n, "tokens": float(count)}
    return loss, metrics
