"""CPU demo benchmark (not a test): SFT warm start, then GRPO sync and async side by side.

    .venv/bin/python tests/bench/bench_cpu_demo.py [--grpo-steps 120] [--out var/bench_cpu_demo]

Prints held-out reward before/after, steps/s and token throughputs for each GRPO mode,
measured in one run on the same warm start (these machines are noisy: compare ratios).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.engine.models.hf_folder import export_hf  # noqa: E402
from workers.engine.config import load_config  # noqa: E402
from workers.engine.metrics import MemorySink, Recorder  # noqa: E402
from workers.engine.models.tiny import make_tiny_model  # noqa: E402
from workers.engine.recipes.grpo import train_grpo  # noqa: E402
from workers.engine.recipes.sft import train_sft  # noqa: E402

DATA = ["data.max_operand=20", "data.eval_size=128", "generator.max_new_tokens=6", "telemetry.console=false",
        "trainer.threads_per_process=1"]


def _mean(sink: MemorySink, key: str) -> float:
    values = [v for _, v in sink.series(key)]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grpo-steps", type=int, default=120)
    parser.add_argument("--out", default="var/bench_cpu_demo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)

    model = make_tiny_model(out / "tiny-qwen3", family="qwen3")
    sft_config = load_config(f"recipe: sft\nmodel: {{path: '{model}'}}\n", overrides=[
        *DATA, "data.seq_len=256", "trainer.steps=240", "trainer.batch_size=32", "trainer.micro_batch_size=8",
        "trainer.optimizer.lr=3e-3", "trainer.optimizer.warmup_steps=10", "eval.every_steps=240",
        f"checkpoint.folder={out / 'sft'}",
    ])
    sink = MemorySink()
    sft = train_sft(sft_config, Recorder([sink]))
    warm_start = export_hf(sft.checkpoint, out / "sft-hf")
    report = {"sft": {"steps_per_s": round(len(sft.losses) / sft.seconds, 2),
                      "train_tokens_per_s": round(_mean(sink, "throughput/train_tokens_per_s")),
                      "held_out_reward_end": sft.eval.reward_mean if sft.eval else None}}

    for name, overrides in {"sync": ["grpo.mode=sync"], "async_age2": ["grpo.mode=async", "grpo.max_policy_age=2"]}.items():
        config = load_config(f"recipe: grpo\nmodel: {{path: '{warm_start}'}}\n", overrides=[
            *DATA, *overrides, f"trainer.steps={args.grpo_steps}", "trainer.batch_size=16",
            "trainer.micro_batch_size=128", "grpo.group_size=8", "trainer.optimizer.lr=2e-4",
            f"eval.every_steps={args.grpo_steps}", f"checkpoint.folder={out / name}",
        ])
        sink = MemorySink()
        started = time.perf_counter()
        result = train_grpo(config, Recorder([sink]))
        report[name] = {
            "held_out_reward_start": result.first_eval.reward_mean if result.first_eval else None,
            "held_out_reward_end": result.eval.reward_mean if result.eval else None,
            "steps_per_s": round(len(result.losses) / result.seconds, 2),
            "wall_s": round(time.perf_counter() - started, 1),
            "gen_tokens_per_s": round(_mean(sink, "throughput/gen_tokens_per_s")),
            "train_tokens_per_s": round(_mean(sink, "throughput/train_tokens_per_s")),
            "weight_sync_ms": round(1000 * _mean(sink, "time/weight_sync_s"), 2),
            "clip_fraction": round(_mean(sink, "clip_fraction"), 4),
            "mean_policy_age": round(_mean(sink, "staleness/policy_age"), 2),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
