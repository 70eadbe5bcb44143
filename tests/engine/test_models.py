"""torchtitan Qwen3 / Llama3 built from HF folders: logits equal transformers', save/load round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.engine.fields import ConfigError
from workers.engine.models.hf_folder import load_hf_state_dict, load_pretrained, save_pretrained
from workers.engine.models.tiny import make_tiny_model

# float32 on CPU: the two implementations differ only in summation order.
LOGIT_TOLERANCE = 1e-5


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers(tmp_path: Path, family: str, tied: bool) -> None:
    folder = make_tiny_model(tmp_path / family, family=family, tie_word_embeddings=tied, init_scale=3.0, num_kv_heads=2)
    loaded = load_pretrained(folder, family=family)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = reference(input_ids=ids).logits
    assert ours.shape == theirs.shape == (2, 24, 320)
    assert theirs.abs().max() > 0.5  # sharpened weights: a wrong mapping cannot hide near zero
    assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE


def test_family_mismatch_is_refused(tiny_llama3: Path) -> None:
    with pytest.raises(ConfigError, match="^model.family: the folder holds a llama3 model, not qwen3$"):
        load_pretrained(tiny_llama3, family="qwen3")


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama3"])
def test_save_load_round_trip(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    folder: Path = request.getfixturevalue(fixture)
    loaded = load_pretrained(folder)
    with torch.no_grad():
        for param in loaded.model.parameters():
            param.add_(0.01)  # make the saved weights differ from the source folder's
    out = save_pretrained(loaded.model, loaded.hf_config, folder, tmp_path / "saved")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    source_state = load_hf_state_dict(folder)
    saved_state = load_hf_state_dict(out)
    assert set(saved_state) == set(source_state)
    assert all(torch.allclose(saved_state[k], source_state[k] + 0.01) for k in source_state)

    again = load_pretrained(out)
    ids = torch.randint(0, 259, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again.model(ids), loaded.model(ids))
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert (reference(input_ids=ids).logits - again.model(ids)).abs().max() < LOGIT_TOLERANCE


def test_chat_tokenizer_splits_prompt_and_response(tiny_qwen3: Path) -> None:
    tokenizer = load_pretrained(tiny_qwen3).tokenizer
    messages = [{"role": "user", "content": "2+3="}]
    prompt, response = tokenizer.encode_exchange(messages, "5")
    assert prompt == tokenizer.encode_prompt(messages)
    assert tokenizer.decode(response) == "5\n"
    assert response[1] in tokenizer.eos_token_ids  # the reply ends with the end-of-turn token
