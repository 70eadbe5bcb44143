"""torchtitan Qwen3 and Llama3 decoders sized from a Hugging Face config.json.

The layer configs are assembled from torchtitan's own building blocks (GQAttention,
FeedForward, RMSNorm, RoPE), with the engine's `EngineAttention` as inner attention so
the same module trains on CPU, packs documents, and decodes with a KV cache.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

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
from workers.engine.planning.shapes import MAX_SIZE, ModelShape

Family = Literal["qwen3", "llama3"]

HF_MODEL_TYPES: dict[str, Family] = {"qwen3": "qwen3", "llama": "llama3"}

# Weights are overwritten by the HF checkpoint; init only matters for fresh tiny models.
_INIT = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
_NORM_INIT = {"weight": torch.nn.init.ones_}


def family_of(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type", "")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
    return HF_MODEL_TYPES[model_type]


def _positive(value: Any, *, key: str) -> float:
    """A config.json number that must be finite and above 0; ValueError naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"config.json {key}: a number above 0, got {json.dumps(value)[:40]}")
    return float(value)


def _mapping(hf_config: dict[str, Any], key: str) -> dict[str, Any]:
    value = hf_config.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config.json {key}: an object, got {type(value).__name__}")
    return value


def _rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older folders have rope_theta + rope_scaling."""
    params = dict(_mapping(hf_config, "rope_parameters"))
    if "rope_theta" not in params:
        params["rope_theta"] = hf_config.get("rope_theta", 10000.0)
    scaling = _mapping(hf_config, "rope_scaling")
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def _rope_config(family: Family, hf_config: dict[str, Any], head_dim: int) -> CosSinRoPE.Config | ComplexRoPE.Config:
    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    max_len = hf_config.get("max_position_embeddings")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= MAX_SIZE:
        raise ValueError(f"config.json max_position_embeddings: a whole number from 1 to {MAX_SIZE}, got "
                         f"{json.dumps(max_len)[:40]}")
    theta = _positive(params["rope_theta"], key="rope_theta")
    if family == "qwen3":
        if rope_type != "default":
            raise ValueError(f"qwen3 rope_type {rope_type!r} is not supported")
        return CosSinRoPE.Config(dim=head_dim, max_seq_len=max_len, theta=theta)
    if rope_type == "default":
        return ComplexRoPE.Config(dim=head_dim, max_seq_len=max_len, theta=theta, scaling="none")
    if rope_type == "llama3":
        return ComplexRoPE.Config(
            dim=head_dim, max_seq_len=max_len, theta=theta, scaling="llama",
            scaling_factor=_positive(params.get("factor"), key="rope_scaling.factor"),
            low_freq_factor=_positive(params.get("low_freq_factor"), key="rope_scaling.low_freq_factor"),
            high_freq_factor=_positive(params.get("high_freq_factor"), key="rope_scaling.high_freq_factor"),
            original_max_position_embeddings=int(_positive(params.get("original_max_position_embeddings"),
                                                           key="rope_scaling.original_max_position_embeddings")),
        )
    raise ValueError(f"llama rope_type {rope_type!r} is not supported")


def model_config_from_hf(hf_config: dict[str, Any]) -> Decoder.Config:
    """A torchtitan Decoder config with the shapes of an HF Qwen3 / Llama config.json; ValueError, naming the key, for
    one that describes no model it builds (a size that is not a whole number from 1 to MAX_SIZE, a number that is not
    a positive one)."""
    family = family_of(hf_config)
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported")
    ModelShape.from_hf_config(hf_config)  # the sizes
    dim = hf_config["hidden_size"]
    n_heads = hf_config["num_attention_heads"]
    n_kv_heads = hf_config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise ValueError(f"config.json num_key_value_heads: {n_kv_heads} does not divide num_attention_heads "
                         f"{n_heads}")
    head_dim = hf_config.get("head_dim") or dim // n_heads
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"config.json head_dim: heads of {head_dim} values (head_dim, else hidden_size / "
                         "num_attention_heads), and RoPE needs an even number of them")
    vocab = hf_config["vocab_size"]
    eps = _positive(hf_config.get("rms_norm_eps", 1e-6), key="rms_norm_eps")
    rope = _rope_config(family, hf_config, head_dim)

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init=_NORM_INIT)

    block_cls = Qwen3TransformerBlock if family == "qwen3" else Llama3TransformerBlock
    layers = [
        block_cls.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                wqkv_param_init=_INIT, wo_param_init=_INIT,
                inner_attention=EngineAttention.Config(),
                fuse_qkv=True, rope=rope,
                qk_norm=norm(head_dim) if family == "qwen3" else None,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hf_config["intermediate_size"],
                w1_param_init=_INIT, w2w3_param_init=_INIT,
            ),
        )
        for _ in range(hf_config["num_hidden_layers"])
    ]
    model_cls = Qwen3Model if family == "qwen3" else Llama3Model
    return model_cls.Config(
        dim=dim,
        vocab_size=vocab,
        norm=norm(dim),
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),
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
