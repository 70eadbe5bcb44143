"""GRPO and SFT losses.

GRPO's importance ratio is pi_theta(token) / mu(token), where mu is the generator's
recorded log-prob at the sampling temperature. No "old policy" forward is recomputed:
when rollouts come from stale weights (async mode) the ratio corrects for exactly the
policy that produced them, and the clip bounds how far one update moves from it.

Log-probs and entropy are computed a chunk of token positions at a time: nothing the size of
the logits is kept for backward besides the logits themselves, which matters with a 150k vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token", "sequence"]


LOGPROB_CHUNK_TOKENS = 256  # token positions per softmax: one [256, V] fp32 block at a time


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per position, and optionally the entropy, a chunk at a time.

    Saves only the logits and targets; backward recomputes each chunk's softmax:
    d logp[target] / d logits = (onehot(target) - softmax) / temperature.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        chosen = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty(flat.shape[0] if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logp = flat[start:end].to(torch.float32, copy=True).div_(temperature)  # log-softmax in place on a copy
            logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))
            chosen[start:end] = logp.gather(-1, flat_targets[start:end]).squeeze(-1)
            if with_entropy:
                entropy[start:end] = -logp.exp().mul_(logp).sum(dim=-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        entropy = entropy.view(targets.shape) if with_entropy else entropy
        ctx.mark_non_differentiable(entropy)
        return chosen.view(targets.shape), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_chosen: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets = ctx.saved_tensors
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        flat_grad = grad_chosen.reshape(-1, 1).float()
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            chunk = flat[start:end].to(torch.float32, copy=True).div_(ctx.temperature)  # softmax in place on a copy
            chunk.sub_(chunk.amax(dim=-1, keepdim=True)).exp_().div_(chunk.sum(dim=-1, keepdim=True))
            chunk.mul_(-flat_grad[start:end])
            chunk.scatter_add_(-1, flat_targets[start:end], flat_grad[start:end])
            grad[start:end] = chunk.div_(ctx.temperature)
        return grad.view(logits.shape), None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each position) under softmax(logits / temperature).

    The log-probs carry the gradient; the entropy is a metric and carries none.
    """
    return _ChunkedLogprobs.apply(logits, targets, temperature, chunk_tokens, True)


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
    dual_clip: float | None = None,
    aggregation: Aggregation = "token",
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss over response tokens [B, T]; advantages are per sequence [B].

    `dual_clip` (c > 1; dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c) bounds the objective of a token with a
    negative advantage from below by c * A: however far the ratio has grown, that token's loss is at most
    c * |A| and it passes no gradient. None: plain PPO clip, where the ratio has no upper bound for A < 0.

    Returns the loss and token-mean metrics over this micro-batch's response tokens.
    """
    ratio = torch.exp(logprobs - behaviour_logprobs)
    adv = advantages[:, None].float()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv
    objective = torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(objective, dtype=torch.bool)
    if dual_clip is not None:
        floor = dual_clip * adv
        dual_clipped = (adv < 0) & (objective < floor)
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    per_token = -objective
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
            "dual_clip_fraction": float(dual_clipped[m].sum()) / n,
            "tokens": float(m.sum()),
        }
        if kl is not None:
            metrics["kl"] = float(kl[m].sum()) / n
        if entropy is not None:
            metrics["entropy"] = float(entropy[m].sum()) / n
    return loss, metrics


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, *, normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the positions where loss_mask is True (response tokens only)."""
    logp, _ = _ChunkedLogprobs.apply(logits, targets, 1.0, LOGPROB_CHUNK_TOKENS, False)
    mask = loss_mask.float()
    count = mask.sum()
    loss = -(logp * mask).sum() / (normalizer if normalizer is not None else count.clamp(min=1.0))
    with torch.no_grad():
        n = max(float(count), 1.0)
        metrics = {"nll": float(-(logp * mask).sum()) / n, "tokens": float(count)}
    return loss, metrics
