"""tests/bench/gpu_bf16.py (the lent-GPU measurement script) runs end to end in --smoke mode.

On the GPU machine there is no time to debug it, so its CPU mode is tested here in fresh
interpreters: with torchtitan (the engine's model path) and with torchtitan made
unimportable (transformers' Qwen3 behind the engine's sampler), checking the JSON lines it
prints and that it pulls in neither Monarch nor vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "bench" / "gpu_bf16.py"

# Run the script as __main__ with `import torchtitan` failing, as on a machine without it.
WITHOUT_TORCHTITAN = (
    "import runpy, sys; sys.modules['torchtitan'] = None; "
    f"sys.argv = [{str(SCRIPT)!r}, '--smoke']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
)


def _run(args: list[str]) -> dict[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            lines.setdefault(record["kind"], []).append(record)
    return lines


def _check(lines: dict[str, list[dict]], model_path: str) -> None:
    assert set(lines) == {"env", "model", "generate", "train", "weight_sync", "in_trainer", "summary"}, sorted(lines)
    env, model, generate, summary = lines["env"][0], lines["model"][0], lines["generate"][0], lines["summary"][0]
    assert env["smoke"] is True and env["dtype"] == "float32" and env["threads"] == 1
    assert model["model_path"] == model_path and model["params"] > 0
    assert generate["generated_tokens"] == env["gen_batch"] * env["new_tokens"]
    assert generate["tokens_per_s"] > 0 and generate["seconds"] > 0
    # the sampler's recorded log-probs equal a full forward's, with left-padded (ragged) prompts
    assert generate["logprob_max_abs_diff_vs_full_forward"] < 1e-4
    # and in GRPO groups: each prompt prefilled once, its cache fanned out to its rows (the adapter's HF cache too)
    distinct, grouped = lines["generate"]
    assert (distinct["group"], grouped["group"]) == (1, env["group"]) and grouped["batch"] == env["gen_batch"]
    assert grouped["generated_tokens"] == env["gen_batch"] * env["new_tokens"]
    assert grouped["logprob_max_abs_diff_vs_full_forward"] < 1e-4 and summary["gen_tokens_per_s_grouped"] > 0
    assert [t["loss"] for t in lines["train"]] == ["grpo", "sft"]
    scoring = "fused_head" if model_path == "engine-torchtitan" else "logits"  # GRPO's log-probs as policy_update's
    assert [t["logprobs"] for t in lines["train"]] == [scoring, "logits"]
    assert env["peak_tflops"] > 0
    for train in lines["train"]:
        assert train["model_path"] == model_path and train["losses_finite"] is True
        assert train["tokens_per_step"] == env["train_rows"] * env["train_seq"]
        for key in ("seconds_per_step", "tokens_per_s", "tflops_per_s", "mfu", "mfu_with_attention"):
            assert train[key] > 0, (key, train)
    for key in ("params", "gen_tokens_per_s", "train_tokens_per_s", "mfu", "mfu_with_attention", "sft_train_tokens_per_s",
                "sft_mfu", "peak_tflops"):
        assert summary[key] > 0, (key, summary)
    assert summary["model_path"] == model_path
    weights = lines["weight_sync"][0]
    assert weights["exact"] is True and weights["model_bytes"] > 0 and weights["assemble_s"] >= 0
    assert len(weights["tied"]) == 1, "the 1.7B shape's LM head is its embedding: its bytes travel once"
    one, eight = weights["ranks1"], weights["ranks8"]
    assert one["part_bytes"] >= weights["model_bytes"] > eight["part_bytes"] > 0, "8 ranks serve an eighth or so each"
    assert one["stage_s"] > 0 and eight["stage_s"] > 0 and one["pinned"] is False  # pinned only for GPU weights
    copy = lines["in_trainer"][0]
    assert copy["exact"] is True, "the refreshed rollout copy holds the trained weights, not the starting ones"
    assert copy["copy_bytes"] == 4 * summary["params"], "a float32 copy of every parameter (smoke: the script's dtype)"
    assert copy["refresh_s"] > 0 and copy["copy_s"] > 0
    assert summary["in_trainer_refresh_s"] == copy["refresh_s"]
    assert summary["imported_monarch"] is False and summary["imported_vllm"] is False


@pytest.mark.slow
def test_gpu_script_smoke_with_the_engine_model() -> None:
    lines = _run([str(SCRIPT), "--smoke"])
    _check(lines, "engine-torchtitan")
    assert lines["env"][0]["torchtitan"] and lines["env"][0]["torchtitan_error"] is None


@pytest.mark.slow
def test_gpu_script_smoke_without_torchtitan() -> None:
    lines = _run(["-c", WITHOUT_TORCHTITAN])
    _check(lines, "transformers-fallback")
    assert lines["env"][0]["torchtitan"] is None and "torchtitan" in lines["env"][0]["torchtitan_error"]


def _script_module():  # noqa: ANN202
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bf16", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mfu_peak_follows_the_lent_device_by_its_name() -> None:
    script = _script_module()
    assert script.peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert script.peak_tflops_of("NVIDIA H100 NVL") == 835.0
    assert script.peak_tflops_of("NVIDIA H100 80GB HBM3") == script.peak_tflops_of("NVIDIA H200") == 989.0
    assert script.peak_tflops_of("some other device") == script.DEFAULT_PEAK_TFLOPS


def test_the_transformers_fallback_in_bf16_keeps_rope_frequencies_in_float32() -> None:
    import torch

    script = _script_module()
    model = script.HFQwen3ForEngine(script.TINY, torch.bfloat16, torch.device("cpu"))
    buffers = dict(model.named_buffers())
    assert [name for name in buffers if name.endswith("inv_freq")], sorted(buffers)
    assert all(b.dtype == torch.float32 for name, b in buffers.items() if name.endswith("inv_freq"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        logits = model(torch.ones(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, script.TINY["vocab_size"]) and bool(torch.isfinite(logits.float()).all())
