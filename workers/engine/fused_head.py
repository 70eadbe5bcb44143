"""The LM head fused into the chunked log-probs: nothing [B, L, V] is materialised, forward or backward.

`losses.token_logprobs` keeps only the logits for backward, but the head still writes all [B, L, V] of them and
backward allocates their gradient, the same size again (at a 150k vocabulary, a large share of a GRPO step's peak).
Here the head's matmul runs inside the chunk loop: forward computes logits = hidden @ W^T a chunk of positions at a
time and keeps only the hidden states, the weight and the targets; backward recomputes each chunk's logits, forms
their gradient with the per-chunk functions `losses._ChunkedLogprobs` uses, and folds it straight into the gradients
of the hidden states (grad_logits @ W) and of the weight (grad_logits^T @ hidden).

Each chunk's logits are computed in the weight's dtype, as nn.Linear would, then upcast to float32, so the
log-probs are those of the unfused path. With a low-precision weight the weight's gradient is accumulated chunk by
chunk in that dtype (one rounding per chunk, where one matmul over all positions rounds once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from workers.engine.losses import LOGPROB_CHUNK_TOKENS, chunk_grad_logits, chunk_logprobs, token_logprobs
from workers.engine.precision import compute_dtype
from workers.engine.sharding import is_sharded


class _FusedHeadLogprobs(torch.autograd.Function):
    """log softmax(hidden @ W^T / temperature)[target] and the entropy per position, a chunk of positions at a time.

    Saves hidden [N, H], W [V, H] and the targets. Backward, per chunk: d logp[target] / d logits =
    (onehot(target) - softmax) / temperature; with `entropy_grad` (an entropy bonus) also d entropy / d logits =
    -softmax * (log softmax + entropy) / temperature; then grad_hidden = grad_logits @ W and
    grad_W += grad_logits^T @ hidden.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_tokens: int, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, 1)
        chosen = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, flat.shape[0], chunk_tokens):
            end = start + chunk_tokens
            scaled = F.linear(flat[start:end], weight).float().div_(temperature)  # a fresh tensor: in place is safe
            chosen[start:end], entropy[start:end] = chunk_logprobs(scaled, flat_targets[start:end], with_entropy=True)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad = temperature, chunk_tokens, entropy_grad
        entropy = entropy.view(targets.shape)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return chosen.view(targets.shape), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_chosen: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, 1)
        flat_grad = grad_chosen.reshape(-1, 1).float()
        flat_grad_entropy = grad_entropy.reshape(-1, 1).float() if ctx.entropy_grad else None
        grad_hidden = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, flat.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            grad_logits = chunk_grad_logits(  # in the logits' dtype, what nn.Linear's backward would receive
                F.linear(flat[start:end], weight).float().div_(ctx.temperature), flat_targets[start:end],
                flat_grad[start:end], None if flat_grad_entropy is None else flat_grad_entropy[start:end],
                ctx.temperature).to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), flat[start:end])
        return (grad_hidden.view(hidden.shape) if grad_hidden is not None else None, grad_weight,
                None, None, None, None)


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                         chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`losses.token_logprobs(F.linear(hidden, weight), targets, ...)` without the logits: hidden [..., H],
    weight [V, H], targets [...]. The entropy carries a gradient only with `entropy_grad`."""
    return _FusedHeadLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, entropy_grad)


def fused_head_applies(model: nn.Module) -> bool:
    """Whether `head_logprobs` may run `model`: a torchtitan Decoder whose head is a plain bias-free linear layer
    (tied to the embedding or not), not sharded.

    An FSDP-sharded model stays on the unfused path: FSDP2 gathers the root unit's parameters (the head's weight
    among them) for its forward and reshards them after it, so the weight must not be used outside that forward.
    A tensor-parallel head (a DTensor weight) stays there too.
    """
    from torchtitan.models.common.decoder import Decoder  # here, not at import: the controller imports no model code

    head = getattr(model, "lm_head", None)
    return (isinstance(model, Decoder) and not is_sharded(model) and isinstance(head, nn.Linear)
            and head.bias is None and not isinstance(head.weight, DTensor))


def head_logprobs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                  entropy_grad: bool, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, positions: torch.Tensor | None = None,
                  attention_masks: torch.Tensor | None = None,
                  read: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each position) under softmax(model(inputs) / temperature), the model run
    without its head and the head fused into the chunked log-probs. Needs `fused_head_applies(model)`.
    `positions` and `attention_masks` go to the model (packed rows: batching.PackedRows); with `read` [N] (flat
    positions of the rows) the head runs on those positions only, against `targets` [N].

    A tied head's weight is the embedding's: autograd sums the two uses' gradients into the one parameter.
    """
    skip = model._skip_lm_head
    model._skip_lm_head = True
    try:
        hidden = model(inputs, positions=positions, attention_masks=attention_masks)
    finally:
        model._skip_lm_head = skip
    if read is not None:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, read)
    weight = model.lm_head.weight
    if (dtype := compute_dtype(model)) is not None:  # trainer.mixed_precision: the head in bf16, as autocast's would be
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return fused_token_logprobs(hidden, weight, targets, temperature, chunk_tokens=chunk_tokens,
                                entropy_grad=entropy_grad)


def model_logprobs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   entropy_grad: bool = False, positions: torch.Tensor | None = None,
                   attention_masks: torch.Tensor | None = None,
                   read: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the targets under the model: the fused head where it applies, else the model's logits
    through losses.token_logprobs. `positions` and `attention_masks` go to the model (None: one sequence a row);
    `read` [N] picks the flat positions whose outputs `targets` [N] are scored (None: every position, targets
    shaped as inputs)."""
    if fused_head_applies(model):
        return head_logprobs(model, inputs, targets, temperature, entropy_grad=entropy_grad, positions=positions,
                             attention_masks=attention_masks, read=read)
    logits = model(inputs, positions=positions, attention_masks=attention_masks)
    if read is not None:
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, read)
    return token_logprobs(logits, targets, temperature, entropy_grad=entropy_grad)
