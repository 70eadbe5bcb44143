"""Preflight refuses a run whose processes could never fit in the memory of the host they compute on: the trainer
rank's state, and one generate request of the torch sampler (its KV cache for every sequence's whole length and a
step's log-probs over the vocabulary), each counted as a floor of what the engine allocates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engine.cli import main
from workers.engine.config import load_config
from workers.engine.planning.shapes import ModelShape
from workers.engine.preflight import GIB, host_memory_bytes, memory_errors


def _config(model: Path, *overrides: str):
    return load_config(f"recipe: grpo\nmodel: {{family: llama3, path: '{model}'}}\n",
                       overrides=["trainer.device=cpu", *overrides])


def _floors(model: Path, config) -> tuple[int, int]:
    """(a trainer rank's state, one generate request) in bytes, counted by hand from config.json."""
    hf = json.loads((model / "config.json").read_text())
    shape = ModelShape.from_hf_config(hf)
    kv_heads, head_dim = hf.get("num_key_value_heads", hf["num_attention_heads"]), shape.head_dim
    per_token = 2 * hf["num_hidden_layers"] * kv_heads * head_dim * 4  # a key and a value, float32
    sequences = config.trainer.batch_size * config.grpo.group_size
    request = sequences * (1 + config.generator.max_new_tokens) * per_token + sequences * hf["vocab_size"] * 4
    return shape.params() * 16, request  # float32 weights, gradients and AdamW's two moments


def test_a_generate_request_the_host_cannot_hold_is_refused_at_the_batch_size(tiny_llama3: Path) -> None:
    config = _config(tiny_llama3, "trainer.batch_size=64")
    state, request = _floors(tiny_llama3, config)
    assert request > state  # so the host sizes below test the request alone
    assert memory_errors(config, _hf(tiny_llama3), host_bytes=request) == []
    (error,) = memory_errors(config, _hf(tiny_llama3), host_bytes=request - 1)
    assert error.field == "trainer.batch_size"
    assert error.message.startswith("a generate request of 512 sequences (its share of trainer.batch_size x "
                                    "grpo.group_size) needs at least")
    assert error.message.endswith("fewer prompts a step, or more generator.replicas")
    # four replicas each take a quarter of the step's prompts
    replicas = _config(tiny_llama3, "trainer.batch_size=64", "generator.replicas=4", "placement.backend=monarch")
    assert memory_errors(replicas, _hf(tiny_llama3), host_bytes=request - 1) == []
    errors = memory_errors(replicas, _hf(tiny_llama3), host_bytes=request // 4 - 1)
    assert [e.message[:40] for e in errors if e.field == "trainer.batch_size"] == ["a generate request of 128 sequences (its"]


def test_a_generator_in_the_trainer_counts_the_rank_state_beside_its_request(tiny_llama3: Path) -> None:
    config = _config(tiny_llama3, "trainer.batch_size=64", "generator.in_trainer=true", "placement.backend=monarch")
    state, request = _floors(tiny_llama3, config)
    assert memory_errors(config, _hf(tiny_llama3), host_bytes=state + request) == []
    (error,) = memory_errors(config, _hf(tiny_llama3), host_bytes=state + request - 1)
    assert error.field == "trainer.batch_size" and "beside its training state" in error.message
    assert error.message.endswith("or more trainer.ranks")


def test_a_model_the_host_cannot_train_is_refused_at_the_model(tiny_llama3: Path) -> None:
    config = _config(tiny_llama3, "trainer.batch_size=1", "generator.max_new_tokens=1")
    state, request = _floors(tiny_llama3, config)
    assert request < state
    assert memory_errors(config, _hf(tiny_llama3), host_bytes=state) == []
    (error,) = memory_errors(config, _hf(tiny_llama3), host_bytes=state - 1)
    assert error.field == "model.path" and "trainer.sharding: fsdp shards them" in error.message
    fsdp = _config(tiny_llama3, "trainer.batch_size=1", "generator.max_new_tokens=1", "trainer.sharding=fsdp",
                   "trainer.ranks=2", "placement.backend=monarch")
    assert memory_errors(fsdp, _hf(tiny_llama3), host_bytes=state - 1) == []
    sgd = _config(tiny_llama3, "trainer.batch_size=1", "generator.max_new_tokens=1", "trainer.optimizer.name=sgd")
    assert memory_errors(sgd, _hf(tiny_llama3), host_bytes=state // 2) == []  # weights and gradients only


@pytest.mark.parametrize("overrides", [["trainer.device=cuda"], ["generator.backend=vllm", "placement.backend=monarch"]])
def test_what_fails_cleanly_by_itself_is_not_checked(tiny_llama3: Path, overrides: list[str]) -> None:
    """A GPU's allocator fails in the run's own device; vLLM fits its sequences into the cache it has."""
    config = _config(tiny_llama3, "trainer.batch_size=64", *overrides)
    _, request = _floors(tiny_llama3, config)
    assert not [e for e in memory_errors(config, _hf(tiny_llama3), host_bytes=request - 1)
                if e.field == "trainer.batch_size"]


def test_the_cli_refuses_a_billion_prompts_before_anything_loads(tiny_llama3: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{family: llama3, path: '{tiny_llama3}'}}\n")
    assert main(["train", "--config", str(config), "trainer.device=cpu", "trainer.batch_size=2000000000"]) == 2
    err = capsys.readouterr().err
    assert "trainer.batch_size: a generate request of 16,000,000,000 sequences" in err
    assert f"more than this host's {host_memory_bytes() / GIB:.1f} GiB" in err


def _hf(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())
