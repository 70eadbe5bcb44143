"""The inner attention the engine plugs into torchtitan's GQAttention.

torchtitan's language models use FlexAttention (no backward on CPU) or varlen (CUDA
only); its SDPA module accepts no masks. This module runs `scaled_dot_product_attention`
on any device and understands three kinds of `attention_masks`:

- None: plain causal attention over one document per row (GRPO batches, right padding).
- a bool Tensor [B, 1, Lq, Lk]: True where a query may attend to a key (packed SFT
  documents and packed GRPO rollouts, built by `batching.document_causal_mask`).
- a `KVCache`: decoding. The new keys/values are written into the cache and the query
  attends to every cached position allowed by `cache.mask`.

On a CPU in bfloat16 (trainer.mixed_precision) it runs SDPA's math kernel: there the flash kernel's backward took
3.4x as long at these lengths (the flash kernel stays in float32, where it is the faster one).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.protocols.module import Module

from workers.engine.models.kv_cache import KVCache

__all__ = ["EngineAttention", "KVCache"]


class EngineAttention(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None):
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | KVCache | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        mask: torch.Tensor | None
        if isinstance(attention_masks, KVCache):
            k, v = attention_masks.append(self, k, v)
            mask = attention_masks.mask
        else:
            mask = attention_masks
        # Grouped-query heads are SDPA's own (enable_gqa): repeating K and V copied a decode's whole cache every step.
        # CUDA's memory-efficient kernel, the one that takes a mask, has no enable_gqa: there K and V are repeated.
        gqa = enable_gqa and q.shape[1] != k.shape[1]
        if gqa and mask is not None and q.device.type == "cuda":
            repeat = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), False
        low_precision_cpu = q.device.type == "cpu" and q.dtype != torch.float32
        with sdpa_kernel(SDPBackend.MATH) if low_precision_cpu else nullcontext():
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
