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
