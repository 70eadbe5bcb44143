"""SFT throughput at 1 and 2 trainer ranks on Monarch, beside the single-process recipe (not a test).

    .venv/bin/python tests/bench/bench_sft_ranks.py [--rounds 2] [--steps 12] [--size tiny|small] [--out var/bench_sft]

Every variant trains the same packed batches (arithmetic chat, 128 examples a step packed into rows of 256 tokens)
with the same total torch threads (2: one process of 2 threads, or 2 ranks of 1); rounds interleave the variants,
since these machines are noisy. Train tokens/s is summed tokens over summed step seconds, the first step of each run
left out (its one-off warm-up); overhead is the run's wall time outside steps 2..N (start-up, the first step, the
last checkpoint, shut-down). Ratios are to the single-process recipe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import workers.engine.actors  # noqa: E402,F401 - before monarch
from workers.engine.config import load_config  # noqa: E402
from workers.engine.metrics import MemorySink, Recorder  # noqa: E402
from workers.engine.models.tiny import make_tiny_model  # noqa: E402
from workers.engine.recipes.sft import train_sft  # noqa: E402
from workers.engine.recipes.sft_monarch import train_sft_monarch  # noqa: E402

SIZES = {"tiny": {}, "small": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768}}
VARIANTS = {
    "single process (2 threads)": ("local", 1, "replicate", 2),
    "monarch, 1 rank (2 threads)": ("monarch", 1, "replicate", 2),
    "monarch, 2 ranks replicated": ("monarch", 2, "replicate", 1),
    "monarch, 2 ranks fsdp": ("monarch", 2, "fsdp", 1),
}


def run_once(model: Path, out: Path, *, backend: str, ranks: int, sharding: str, threads: int, steps: int) -> dict:
    config = load_config(f"recipe: sft\nmodel: {{path: '{model}'}}\n", overrides=[
        "data.max_operand=99", "data.eval_size=8", "data.seq_len=256", f"trainer.steps={steps}",
        "trainer.batch_size=128", "trainer.micro_batch_size=4", "eval.every_steps=0", f"checkpoint.folder={out}",
        "telemetry.console=false", f"trainer.threads_per_process={threads}", f"placement.backend={backend}",
        f"trainer.ranks={ranks}", f"trainer.sharding={sharding}",
    ])
    sink = MemorySink()
    started = time.perf_counter()
    train = train_sft_monarch if backend == "monarch" else train_sft
    train(config, Recorder([sink]))
    wall = time.perf_counter() - started
    step_seconds = [v for _, v in sink.series("time/step_s")]
    tokens = [v for _, v in sink.series("data/train_tokens")]
    return {"tokens_per_s": sum(tokens[1:]) / sum(step_seconds[1:]), "overhead_s": wall - sum(step_seconds[1:]),
            "loss": sink.last("loss")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", default="var/bench_sft")
    args = parser.parse_args()
    out = Path(args.out)
    model = make_tiny_model(out / f"model-{args.size}", family="qwen3", **SIZES[args.size])
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, (backend, ranks, sharding, threads) in VARIANTS.items():
            results[name].append(run_once(model, out / f"r{round_}-{backend}-{ranks}-{sharding}", backend=backend,
                                          ranks=ranks, sharding=sharding, threads=threads, steps=args.steps))
            print(f"round {round_ + 1} {name}: {results[name][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    base = statistics.median(r["tokens_per_s"] for r in results["single process (2 threads)"])
    print(f"\nSFT, {args.size} model, {args.steps} steps x 128 examples packed into rows of 256 tokens, "
          f"medians of {args.rounds} rounds")
    print(f"{'variant':32} {'train tokens/s':>15} {'/ single':>9} {'overhead s':>11} {'last loss':>10}")
    for name, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        print(f"{name:32} {tps:15.0f} {tps / base:9.2f} {statistics.median(r['overhead_s'] for r in runs):11.1f} "
              f"{statistics.median(r['loss'] for r in runs):10.4f}")


if __name__ == "__main__":
    main()
