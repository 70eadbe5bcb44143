"""Run configs the system tests launch."""

from __future__ import annotations

from pathlib import Path


def sft_yaml(model: Path, *, steps: int, max_restarts: int = 0) -> str:
    return f"""\
recipe: sft
model: {{family: qwen3, path: {model}}}
data: {{source: arithmetic, max_operand: 9, eval_size: 16, seq_len: 128}}
generator: {{max_new_tokens: 4}}
trainer: {{steps: {steps}, batch_size: 8, micro_batch_size: 8, threads_per_process: 1}}
eval: {{every_steps: 10, rollout_samples: 1}}
checkpoint: {{every_steps: 10}}
telemetry: {{console: false, flush_seconds: 0.2}}
max_restarts: {max_restarts}
"""
