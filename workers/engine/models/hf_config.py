"""A Hugging Face model folder's config.json, read and checked without torch: preflight refuses one the model's load
would refuse, with the same words, before any proc starts (`models/titan.py` builds the model from `model_dims`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from workers.engine.fields import ConfigError
from workers.engine.planning.shapes import MAX_SIZE, ModelShape

HF_CONFIG_MAX_BYTES = 1 << 20  # a model's config.json is a few KB

Family = Literal["qwen3", "llama3"]

HF_MODEL_TYPES: dict[str, Family] = {"qwen3": "qwen3", "llama": "llama3"}


@dataclass(frozen=True)
class LlamaRope:
    """Llama 3's RoPE scaling (rope_type llama3)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelDims:
    """What a config.json says of the model, checked (`model_dims`)."""

    family: Family
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    layers: int
    vocab: int
    eps: float
    tie_embeddings: bool
    max_len: int
    rope_theta: float
    llama_rope: LlamaRope | None  # None: RoPE unscaled


def read_hf_config(folder: str | Path, *, field: str = "model.path") -> dict[str, Any]:
    """The folder's config.json, a JSON object; a ConfigError on `field` (the one that named the folder) when it is
    missing, not a file, or not a JSON object (`read_json_object`)."""
    path = Path(folder) / "config.json"
    try:
        if not path.is_file():
            raise ConfigError.on(field, f"{folder} has no config.json file (the model's description)")
    except OSError as exc:
        raise ConfigError.on(field, f"cannot read {path} ({exc.strerror or exc})") from None
    return read_json_object(path, field=field)


def read_json_object(path: Path, *, field: str, max_bytes: int = HF_CONFIG_MAX_BYTES) -> dict[str, Any]:
    """A JSON file of a model folder (config.json, generation_config.json, the tokenizer's), an object; a ConfigError on
    `field` when it cannot be read, is longer than `max_bytes` (read no further), not UTF-8, not JSON, or not an
    object."""
    try:
        with open(path, "rb") as file:
            raw = file.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError.on(field, f"cannot read {path} ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise too_long(path, field=field, max_bytes=max_bytes)
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError.on(field, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError.on(field, f"{path} is not JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError):  # a number of over 4300 digits, arrays nested a thousand deep
        raise ConfigError.on(field, f"{path} is not JSON this engine can read") from None
    if not isinstance(value, dict):
        raise ConfigError.on(field, f"{path} is a JSON {type(value).__name__}, not an object")
    return value


def too_long(path: Path, *, field: str, max_bytes: int) -> ConfigError:
    return ConfigError.on(field, f"{path} is longer than {max_bytes} bytes: not a model's {path.name}")


def family_of(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type", "")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
    return HF_MODEL_TYPES[model_type]


def model_dims(hf_config: dict[str, Any]) -> ModelDims:
    """The dimensions of the HF Qwen3 / Llama model a config.json describes; ValueError, naming the key, for one that
    describes no model the engine builds (a size that is not a whole number from 1 to MAX_SIZE, a number that is not a
    positive one, heads the key-value heads do not divide, RoPE it does not implement)."""
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
    eps = _positive(hf_config.get("rms_norm_eps", 1e-6), key="rms_norm_eps")
    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    max_len = hf_config.get("max_position_embeddings")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= MAX_SIZE:
        raise ValueError(f"config.json max_position_embeddings: a whole number from 1 to {MAX_SIZE}, got "
                         f"{json.dumps(max_len)[:40]}")
    theta = _positive(params["rope_theta"], key="rope_theta")
    return ModelDims(family=family, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     hidden_dim=hf_config["intermediate_size"], layers=hf_config["num_hidden_layers"],
                     vocab=hf_config["vocab_size"], eps=eps,
                     tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)), max_len=max_len,
                     rope_theta=theta, llama_rope=_llama_rope(family, rope_type, params))


def _llama_rope(family: Family, rope_type: Any, params: dict[str, Any]) -> LlamaRope | None:
    if family == "qwen3":
        if rope_type != "default":
            raise ValueError(f"qwen3 rope_type {rope_type!r} is not supported")
        return None
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return LlamaRope(
            factor=_positive(params.get("factor"), key="rope_scaling.factor"),
            low_freq_factor=_positive(params.get("low_freq_factor"), key="rope_scaling.low_freq_factor"),
            high_freq_factor=_positive(params.get("high_freq_factor"), key="rope_scaling.high_freq_factor"),
            original_max_position_embeddings=int(_positive(params.get("original_max_position_embeddings"),
                                                           key="rope_scaling.original_max_position_embeddings")),
        )
    raise ValueError(f"llama rope_type {rope_type!r} is not supported")


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
