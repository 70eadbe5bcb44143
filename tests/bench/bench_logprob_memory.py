"""Memory of the GRPO loss's log-probs and entropy (not a test): the old [B, L, V] formula vs the chunked one.

    .venv/bin/python tests/bench/bench_logprob_memory.py [--batch 4] [--seq 256] [--vocab 151936] [--hidden 64] [--dtype float32]

One GRPO micro-batch step the way grpo_math.accumulate_gradients runs it: logits from a linear
head over random hidden states (a small hidden size, so the model part is negligible and what is
measured is the loss's), `token_logprobs(head(hidden), ...)`, `grpo_loss`, backward. Variants:

  old      the formula before chunking: log_softmax over [B, L, V] in fp32, the entropy taken
           from it with its graph, both alive until backward (as the step's loop kept them)
  chunked  losses.token_logprobs: log-probs a chunk of positions at a time, only the logits saved,
           the entropy computed without a graph

Each variant runs in its own fresh interpreter, one after the other. Figures per variant:
saved for backward (saved_tensors_hooks, summing each saved tensor's storage once), the step's
peak memory above what was allocated before it (torch.cuda.max_memory_allocated on CUDA, else the
process's peak RSS, which glibc returns large blocks to promptly), both per token, and the share
of the peak beyond the logits and their gradient (the head's own output and the gradient it
needs: with the model's logits materialised, that part is the floor any formula pays).
The CPU default is L = 256 so the old variant's peak stays under ~3 GB and a run takes well under
a minute; --seq 512 doubles both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("old", "chunked")


def _old_token_logprobs(logits, targets, temperature):  # the formula this replaced
    import torch
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(variant: str, *, batch: int, seq: int, vocab: int, hidden: int, temperature: float, dtype: str) -> dict[str, float]:
    import torch

    from workers.engine.losses import grpo_loss, token_logprobs

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=getattr(torch, dtype))
    states = torch.randn(batch, seq, hidden, device=device, dtype=head.weight.dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    behaviour = torch.full((batch, seq), -float(torch.log(torch.tensor(float(vocab)))), device=device)
    advantages = torch.randn(batch, device=device)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    formula = _old_token_logprobs if variant == "old" else token_logprobs

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = formula(head(states), targets, temperature)
        loss, _ = grpo_loss(logprobs, behaviour, advantages, mask, clip_epsilon=0.2, entropy=entropy.detach())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    del entropy
    model_bytes = sum(p.numel() * p.element_size() for p in (head.weight, states))
    logits_bytes = batch * seq * vocab * head.weight.element_size()
    saved = sum(storages.values()) - model_bytes  # the head saves its weight and input: the model's part
    tokens = batch * seq
    return {
        "device": device.type, "tokens": tokens, "logits_mib": logits_bytes / 2**20,
        "saved_mib": saved / 2**20, "saved_kib_per_token": saved / tokens / 1024,
        "peak_mib": peak / 2**20, "peak_kib_per_token": peak / tokens / 1024,
        "beyond_logits_share": max(peak - 2 * logits_bytes, 0) / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the head's, so the logits'")
    parser.add_argument("--variant", choices=VARIANTS, help="measure one variant in this process and print its JSON")
    args = parser.parse_args()
    shape = {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "hidden": args.hidden, "temperature": args.temperature,
             "dtype": args.dtype}
    if args.variant:
        print(json.dumps(measure(args.variant, **shape)))
        return
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, *(f"--{k}={v}" for k, v in shape.items())]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    first = results[VARIANTS[0]]
    print(f"B={args.batch} L={args.seq} V={args.vocab} hidden={args.hidden} on {first['device']}: "
          f"{first['tokens']} tokens, logits {first['logits_mib']:.0f} MiB ({args.dtype})")
    print(f"{'variant':<9}{'saved MiB':>11}{'saved KiB/tok':>15}{'peak MiB':>10}{'peak KiB/tok':>14}{'beyond logits':>15}")
    for variant, r in results.items():
        print(f"{variant:<9}{r['saved_mib']:>11.0f}{r['saved_kib_per_token']:>15.0f}{r['peak_mib']:>10.0f}"
              f"{r['peak_kib_per_token']:>14.0f}{100 * r['beyond_logits_share']:>14.0f}%")
    old, new = results["old"], results["chunked"]
    print(f"old / chunked: saved for backward x{old['saved_mib'] / max(new['saved_mib'], 1e-9):.2f}, "
          f"peak x{old['peak_mib'] / new['peak_mib']:.2f}")


if __name__ == "__main__":
    main()
