"""Padding-free GRPO training (grpo.packing) against right-padded rows, on rollouts of varied lengths (not a test).

    .venv/bin/python tests/bench/bench_packing.py [--rounds 3] [--steps 4] [--size tiny|small] [--threads 1] [--group 8]

Each step is one grpo_math.policy_update (one optimizer step, AdamW) on a batch of 64 rollouts, micro-batches of 8:
prompts of 16-96 tokens, completions long-tailed (7 in 10 of 16-64 tokens, the rest 128-384), as a reasoning task's
GRPO batch looks; --group G samples share each prompt (a GRPO group; 1: every prompt distinct), which packing runs
once (data/shared_prompt_share). Both layouts train the same batches from the same weights; rounds interleave them, since these
machines are noisy. Padding share: padded positions / all positions of the update's forwards (data/padding_share).
Train tokens/s: the samples' real tokens (prompt + completion) over the update's seconds, the first step of each
round left out (warm-up).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from workers.engine.batching import RolloutBatch, collate_rollouts  # noqa: E402
from workers.engine.config import GrpoConfig, OptimizerConfig  # noqa: E402
from workers.engine.grpo_math import policy_update  # noqa: E402
from workers.engine.grpo_metrics import update_metrics  # noqa: E402
from workers.engine.models.hf_folder import load_pretrained  # noqa: E402
from workers.engine.models.tiny import make_tiny_model  # noqa: E402
from workers.engine.training import build_optimizer, build_scheduler  # noqa: E402

SIZES = {"tiny": {}, "small": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768}}
SAMPLES, MICRO_BATCH = 64, 8


def rollouts(*, seed: int, group: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)

    def between(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    distinct = [torch.randint(0, 256, (between(16, 96),), generator=gen).tolist() for _ in range(SAMPLES // group)]
    prompts = [prompt for prompt in distinct for _ in range(group)]
    lengths = [between(16, 64) if float(torch.rand(1, generator=gen)) < 0.7 else between(128, 384)
               for _ in range(SAMPLES)]
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    logprobs = [(-2.0 * torch.rand(n, generator=gen)).tolist() for n in lengths]
    return collate_rollouts(prompts, responses, logprobs, torch.randn(SAMPLES, generator=gen).tolist(), pad_id=0)


def run_layout(model: torch.nn.Module, batches: list[RolloutBatch], *, packing: bool) -> dict[str, float]:
    model = copy.deepcopy(model)
    optimizer_config = OptimizerConfig(lr=1e-5)
    optimizer = build_optimizer(model, optimizer_config)
    scheduler = build_scheduler(optimizer, optimizer_config, len(batches))
    grpo = GrpoConfig(packing=packing)
    seconds, tokens, parts, losses = [], [], [], []
    for batch in batches:
        started = time.perf_counter()
        update = policy_update(model, optimizer, scheduler, batch, grpo=grpo, temperature=1.0,
                               micro_batch_size=MICRO_BATCH, grad_clip=1.0)
        seconds.append(time.perf_counter() - started)
        tokens.append(int(batch.lengths.sum()) + len(batch))  # a row of n positions holds n + 1 tokens
        parts.extend(update.parts)
        losses.append(update.loss)
    metrics = update_metrics(parts)
    return {"tokens_per_s": sum(tokens[1:]) / sum(seconds[1:]), "padding_share": metrics["data/padding_share"],
            "shared_prompt_share": metrics["data/shared_prompt_share"], "positions": metrics["data/forward_positions"],
            "first_loss": losses[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group", type=int, default=8, choices=[1, 2, 4, 8, 16], help="samples per prompt")
    parser.add_argument("--out", default="var/bench_packing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = make_tiny_model(Path(args.out) / f"model-{args.size}", family="qwen3", **SIZES[args.size])
    model = load_pretrained(folder).model.train()
    batches = [rollouts(seed=step, group=args.group) for step in range(args.steps)]
    results: dict[str, list[dict[str, float]]] = {"padded": [], "packed": []}
    for round_ in range(args.rounds):
        for name in results:
            results[name].append(run_layout(model, batches, packing=name == "packed"))
            print(f"round {round_ + 1} {name}: {results[name][-1]['tokens_per_s']:.0f} train tokens/s", flush=True)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    padded, packed = median["padded"], median["packed"]
    print(f"\nGRPO policy update, {args.size} model, {args.threads} thread(s), {args.steps} steps x {SAMPLES} rollouts, "
          f"micro-batches of {MICRO_BATCH}, {args.group} samples a prompt; medians of {args.rounds} rounds")
    print(f"{'layout':8} {'padding share':>14} {'shared prompt':>14} {'positions':>10} {'train tokens/s':>15} "
          f"{'first loss':>11}")
    for name, row in median.items():
        print(f"{name:8} {row['padding_share']:14.3f} {row['shared_prompt_share']:14.3f} {row['positions']:10.0f} "
              f"{row['tokens_per_s']:15.0f} {row['first_loss']:11.6f}")
    print(f"packed / padded: tokens/s x{packed['tokens_per_s'] / padded['tokens_per_s']:.2f}, "
          f"positions x{packed['positions'] / padded['positions']:.2f}")


if __name__ == "__main__":
    main()
