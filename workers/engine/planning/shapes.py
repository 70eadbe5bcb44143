"""A decoder's shape and what it costs per token: parameters, FLOPs, bytes of weights and KV cache.

FLOPs follow the accounting of the PaLM paper's appendix B (Chowdhery et al., 2022), which MFU is usually quoted
against: a forward pass costs 2 FLOPs per weight of every matmul (the LM head included, embeddings looked up for free)
plus 4 * layers * (heads * head_dim) * context for attention's two matmuls (scores and the weighted sum of values); a
training step costs 3x the forward (the backward computes gradients for activations and weights). That gives PaLM's
6N + 12 * L * H * Q * T per trained token when N counts the matmul weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2}
MAX_SIZE = 10_000_000  # no dimension of a decoder is larger (vocabularies are ~10^5, widths ~10^4)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen3 / Llama3 decoder (a Hugging Face config.json's fields)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool  # Qwen3 normalises each head's queries and keys (two head_dim vectors a layer)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, name: str = "") -> "ModelShape":
        """ValueError (naming the field) for a config.json without the sizes, or with sizes no model has."""
        sizes = {}
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                    "num_key_value_heads", "head_dim"):
            value = config.get(key)
            if value is None and key in ("num_key_value_heads", "head_dim"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
                raise ValueError(f"config.json {key}: a whole number from 1 to {MAX_SIZE}, got {value!r}"[:200])
            sizes[key] = value
        heads = sizes["num_attention_heads"]
        hidden = sizes["hidden_size"]
        config = {**config, **sizes}
        return cls(
            name=name or str(config.get("_name_or_path") or config.get("model_type") or "model")[:100],
            layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type") == "qwen3",
        )

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def layer_matmul_params(self) -> int:
        q_and_o = 2 * self.hidden * self.attention_width
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden * self.intermediate  # SwiGLU: gate, up, down

    def layer_params(self) -> int:
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layer_matmul_params() + norms

    def params(self) -> int:
        """Every weight, the embedding counted once when the LM head shares it."""
        embedding = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_params() + embedding + head + self.hidden  # + the final norm

    def non_embedding_params(self) -> int:
        return self.layers * self.layer_params() + self.hidden

    def matmul_params(self) -> int:
        """The weights a forward multiplies by: every layer's matmuls and the LM head."""
        return self.layers * self.layer_matmul_params() + self.vocab * self.hidden

    def forward_flops_per_token(self, *, context: float) -> float:
        """One token's forward at `context` tokens of attention (the mean context of a causal sequence of T is T/2
        when its tokens are counted one by one; PaLM counts T for every token, `training_flops_per_token`)."""
        return 2.0 * self.matmul_params() + 4.0 * self.layers * self.attention_width * context

    def training_flops_per_token(self, *, seq_len: float) -> float:
        """PaLM's 6N + 12 * L * H * Q * T: forward and backward of one token of a sequence of `seq_len`."""
        return 3.0 * self.forward_flops_per_token(context=seq_len)

    def weight_bytes(self, dtype: str) -> int:
        return self.params() * BYTES_PER_VALUE[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """The KV cache one token of context holds: a key and a value per KV head per layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_VALUE[dtype]


def _qwen3(name: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
           tied: bool) -> ModelShape:
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=128,
                      intermediate=intermediate, vocab=151_936, tied_embeddings=tied, qk_norm=True)


def _llama3(name: str, layers: int, hidden: int, heads: int, intermediate: int, vocab: int) -> ModelShape:
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=8, head_dim=hidden // heads,
                      intermediate=intermediate, vocab=vocab, tied_embeddings=False, qk_norm=False)


# From each model's published config.json.
KNOWN_SHAPES: dict[str, ModelShape] = {shape.name: shape for shape in (
    _qwen3("qwen3-0.6b", 28, 1024, 16, 8, 3072, tied=True),
    _qwen3("qwen3-1.7b", 28, 2048, 16, 8, 6144, tied=True),
    _qwen3("qwen3-4b", 36, 2560, 32, 8, 9728, tied=True),
    _qwen3("qwen3-8b", 36, 4096, 32, 8, 12288, tied=False),
    _qwen3("qwen3-14b", 40, 5120, 40, 8, 17408, tied=False),
    _qwen3("qwen3-32b", 64, 5120, 64, 8, 25600, tied=False),
    _llama3("llama3-8b", 32, 4096, 32, 14336, 128_256),
    _llama3("llama3-70b", 80, 8192, 64, 28672, 128_256),
)}
