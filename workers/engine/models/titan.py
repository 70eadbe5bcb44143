"""torchtitan Qwen3 and Llama3 decoders sized from a Hugging Face config.json.

The layer configs are assembled from torchtitan's own building blocks (GQAttention,
FeedForward, RMSNorm, RoPE), with the engine's `EngineAttention` as inner attention so
the same module trains on CPU, packs documents, and decodes with a KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from workers.engine.models.attention import EngineAttention
from workers.engine.models.hf_config import ModelDims, family_of, model_dims

# Weights are overwritten by the HF checkpoint; init only matters for fresh tiny models.
_INIT = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
_NORM_INIT = {"weight": torch.nn.init.ones_}


def _rope_config(dims: ModelDims) -> CosSinRoPE.Config | ComplexRoPE.Config:
    if dims.family == "qwen3":
        return CosSinRoPE.Config(dim=dims.head_dim, max_seq_len=dims.max_len, theta=dims.rope_theta)
    if dims.llama_rope is None:
        return ComplexRoPE.Config(dim=dims.head_dim, max_seq_len=dims.max_len, theta=dims.rope_theta, scaling="none")
    scaling = dims.llama_rope
    return ComplexRoPE.Config(
        dim=dims.head_dim, max_seq_len=dims.max_len, theta=dims.rope_theta, scaling="llama",
        scaling_factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )


def model_config_from_hf(hf_config: dict[str, Any]) -> Decoder.Config:
    """A torchtitan Decoder config with the shapes of an HF Qwen3 / Llama config.json; ValueError, naming the key, for
    one that describes no model it builds (`hf_config.model_dims`)."""
    dims = model_dims(hf_config)
    dim, family = dims.dim, dims.family

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=dims.eps, param_init=_NORM_INIT)

    block_cls = Qwen3TransformerBlock if family == "qwen3" else Llama3TransformerBlock
    layers = [
        block_cls.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim, n_heads=dims.n_heads, n_kv_heads=dims.n_kv_heads, head_dim=dims.head_dim,
                wqkv_param_init=_INIT, wo_param_init=_INIT,
                inner_attention=EngineAttention.Config(),
                fuse_qkv=True, rope=_rope_config(dims),
                qk_norm=norm(dims.head_dim) if family == "qwen3" else None,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=dims.hidden_dim,
                w1_param_init=_INIT, w2w3_param_init=_INIT,
            ),
        )
        for _ in range(dims.layers)
    ]
    model_cls = Qwen3Model if family == "qwen3" else Llama3Model
    return model_cls.Config(
        dim=dim,
        vocab_size=dims.vocab,
        norm=norm(dim),
        enable_weight_tying=dims.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=dims.vocab, embedding_dim=dim, param_init=_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=dims.vocab, param_init=_INIT),
        layers=layers,
    )


def state_dict_adapter(hf_config: dict[str, Any], model_config: Decoder.Config) -> Qwen3StateDictAdapter | Llama3StateDictAdapter:
    if family_of(hf_config) == "qwen3":
        return Qwen3StateDictAdapter(model_config, None)
    return Llama3StateDictAdapter(model_config, None)


def build_decoder(hf_config: dict[str, Any], *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    """A randomly initialised decoder; load weights with `load_state_dict` after."""
    config = model_config_from_hf(hf_config)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
        # Parameters only: the RoPE caches stay float32.
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
