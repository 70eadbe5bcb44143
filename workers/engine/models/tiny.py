"""Tiny random Qwen3 / Llama3 HF folders with a byte-level tokenizer, for tests and the CPU demo.

Nothing is downloaded: the tokenizer maps each byte to a token and adds three specials;
the chat template is Qwen's ChatML shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from workers.engine.models.hf_config import Family

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 320  # 256 bytes + 3 specials, padded


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(
    out: str | Path,
    *,
    family: Family = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    init_scale: float = 1.0,
    seed: int = 0,
) -> Path:
    """Write a random model, its tokenizer and chat template as an HF folder; return the folder.

    init_scale > 1 sharpens the random model's distributions (numerics tests want logits
    far from uniform).
    """
    out = Path(out)
    tokenizer = byte_level_tokenizer()
    common = dict(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024, tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, dtype="float32",
    )
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden_size // num_heads, rms_norm_eps=1e-6, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0, **common))
    if init_scale != 1.0:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.mul_(init_scale)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
