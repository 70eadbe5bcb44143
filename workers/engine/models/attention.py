"""The inner attention the engine plugs into torchtitan's GQAttention.

torchtitan's language models use FlexAttention (no backward on CPU) or varlen (CUDA
only); its SDPA module accepts no masks. This module runs `scaled_dot_product_attention`
on any device and understands three kinds of `attention_masks`:

- None: plain causal attention over one document per row (GRPO batches, right padding).
- a bool Tensor [B, 1, Lq, Lk]: True where a query may attend to a key (packed SFT
  documents, built by `document_causal_mask`).
- a `KVCache`: decoding. The new keys/values are written into the cache and the query
  attends to every cached position allowed by `cache.mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.protocols.module import Module


class KVCache:
    """Per-layer key/value buffers for batched decoding, preallocated on first use."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions already written by previous forwards
        self.mask: torch.Tensor | None = None  # [B, 1, Lq, length + Lq], set before each forward
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def append(self, layer: object, k_BNLH: torch.Tensor, v_BNLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(layer)  # one buffer pair per attention module
        if key not in self._keys:
            b, n, _, h = k_BNLH.shape
            self._keys[key] = k_BNLH.new_zeros(b, n, self.max_len, h)
            self._values[key] = v_BNLH.new_zeros(b, n, self.max_len, v_BNLH.shape[-1])
        end = self.length + k_BNLH.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full")
        self._keys[key][:, :, self.length:end] = k_BNLH
        self._values[key][:, :, self.length:end] = v_BNLH
        return self._keys[key][:, :, :end], self._values[key][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


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
        if enable_gqa:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.transpose(1, 2)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool mask for rows packed with several documents.

    A document starts wherever `positions` is 0; a token sees earlier tokens of its own
    document only.
    """
    doc_ids = torch.cumsum((positions == 0).int(), dim=1)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return (same_doc & causal)[:, None]
