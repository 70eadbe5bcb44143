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

With --model qwen3-0.6b: a whole GRPO micro-step on a real model instead of a bare head.

    .venv/bin/python tests/bench/bench_logprob_memory.py --model qwen3-0.6b --layers 1 2 4 --batch 2 --seq 512

The engine's torchtitan Qwen3 (models.titan.build_decoder) with Qwen3-0.6B's shape (vocab 151936,
hidden 1024, 16 / 8 KV heads of 128, intermediate 3072, tied embeddings) and random weights, but
--layers decoder blocks. The step is grpo_math.policy_update's for one micro-batch: zero_grad
(set_to_none), model(inputs) -> formula -> grpo_loss (GrpoConfig defaults) -> backward ->
apply_update (clip 1.0, AdamW). A third variant runs here, fused: fused_head.head_logprobs, the model without
its head and the head's matmul inside the chunk loop (the GRPO step's path for an unsharded model), so no
[B, L, V] logits or logits gradient exist at all. The baseline, taken just before the step, holds the parameters and
the AdamW state (allocated by an optimizer step on zero gradients beforehand), the RoPE caches and
the batch; the gradients are not in it: the step allocates them, so its peak includes them.
Peak: torch.cuda.max_memory_allocated on CUDA; on CPU the process's VmHWM, reset before the step
(/proc/self/clear_refs), with glibc mmap-ing every block of 1 MiB or more so a freed tensor leaves
the resident set. A control run takes the same model and step with the head's
output cut to --control-vocab columns (the tied weight, its gradient and AdamW state stay full
size), so the difference of the two peaks is what the [B, L, V] logits, log-probs, entropy and
their gradients cost, and the vocabulary share of the peak is that difference over the full peak
(one control, with the chunked formula, serves every variant: 128 columns wide, the formulas differ
by a few MiB). "saved [..V]": the vocabulary-wide tensors autograd saved for backward.
Two or more --layers give a straight-line fit of both peaks in the layer count, extrapolated to
the real model's 28 blocks. The fit holds only while the peak stays at the same moment of the step:
with few blocks the chunked step peaks in its tail (gradients, the embedding's dense gradient, the
AdamW update's temporaries), after the logits are freed; with many blocks their activations may
move it to the start of backward. --layers 28 measures that directly (float32 at B=2 L=512: ~17 GB by
the fit, but ~20 minutes a variant on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("old", "chunked")
MODEL_VARIANTS = (*VARIANTS, "fused")  # --model only: fused_head.head_logprobs, the head inside the chunk loop


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


QWEN3_0_6B = {  # Qwen/Qwen3-0.6B's config.json, less the tokenizer ids; num_hidden_layers is --layers
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
MODELS = {"qwen3-0.6b": QWEN3_0_6B}
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # fixed, so glibc does not raise it as blocks are freed


def _narrow_head(weight, vocab: int):
    """The tied head's first `vocab` rows only: its gradient still has the whole weight's shape."""
    import torch

    class NarrowHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(h, self.weight[:vocab])

    return NarrowHead()


def _start_peak(device) -> int:
    """What is allocated now; the peak counts from here."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident set
    return _rss_bytes()


def _peak_since_start(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def measure_step(variant: str, *, model: str, layers: int, batch: int, seq: int, head_vocab: int, temperature: float,
                 dtype: str) -> dict[str, float]:
    """One GRPO micro-step on `model`'s shape with `layers` blocks; the head's output `head_vocab` wide."""
    import torch

    from workers.engine.config import GrpoConfig, OptimizerConfig
    from workers.engine.fused_head import fused_head_applies, head_logprobs
    from workers.engine.data_parallel import apply_update
    from workers.engine.losses import grpo_loss, token_logprobs
    from workers.engine.models.titan import build_decoder
    from workers.engine.training import build_optimizer, build_scheduler

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_config = {**MODELS[model], "num_hidden_layers": layers}
    vocab = hf_config["vocab_size"]
    net = build_decoder(hf_config, device=device, dtype=getattr(torch, dtype))
    if head_vocab < vocab:
        net.lm_head = _narrow_head(net.lm_head.weight, head_vocab)
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    optim_config, grpo = OptimizerConfig(), GrpoConfig()
    optimizer = build_optimizer(net, optim_config)
    scheduler = build_scheduler(optimizer, optim_config, total_steps=10)
    for p in net.parameters():  # AdamW allocates its state on its first step: make that happen before the baseline
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    inputs = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, head_vocab, (batch, seq), device=device)
    behaviour = torch.full((batch, seq), -float(torch.log(torch.tensor(float(head_vocab)))), device=device)
    advantages = torch.randn(batch, device=device)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    formula = _old_token_logprobs if variant == "old" else token_logprobs
    assert variant != "fused" or fused_head_applies(net)

    saved_vocab_wide: dict[int, int] = {}
    param_storages = {p.untyped_storage().data_ptr() for p in net.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.dim() >= 2 and t.shape[-1] == head_vocab and ptr not in param_storages:  # not the head's weight.T
            saved_vocab_wide[ptr] = t.untyped_storage().nbytes()
        return t

    baseline = _start_peak(device)
    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = (head_logprobs(net, inputs, targets, temperature, entropy_grad=False) if variant == "fused"
                             else formula(net(inputs), targets, temperature))
        loss, _ = grpo_loss(
            logprobs, behaviour, advantages, mask, clip_epsilon=grpo.clip_low, clip_epsilon_high=grpo.clip_high,
            dual_clip=grpo.dual_clip, loss=grpo.loss, aggregation=grpo.aggregation, entropy=entropy,
            normalizer=float(mask.sum()))
    loss.backward()
    backward_peak = _peak_since_start(device) - baseline
    apply_update(net, optimizer, scheduler, grad_clip=optim_config.grad_clip)
    peak = _peak_since_start(device) - baseline
    del logprobs, entropy  # alive until here, as in accumulate_gradients' loop
    tokens = batch * seq
    return {
        "device": device.type, "tokens": tokens, "baseline_mib": baseline / 2**20, "param_mib": param_bytes / 2**20,
        "peak_mib": peak / 2**20, "backward_peak_mib": backward_peak / 2**20, "saved_vocab_wide_mib": sum(saved_vocab_wide.values()) / 2**20,
        "logits_mib": tokens * head_vocab * torch.finfo(getattr(torch, dtype)).bits / 8 / 2**20,
    }


def _run_child(args: list[str], env: dict[str, str]) -> dict[str, float]:
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}).stdout
    return json.loads(out.strip().splitlines()[-1])


def _line(layers: list[int], values: list[float], at: int) -> float:
    """Least-squares straight line through (layers, values), evaluated at `at` layers."""
    n = len(layers)
    mean_x, mean_y = sum(layers) / n, sum(values) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(layers, values)) / sum((x - mean_x) ** 2 for x in layers)
    return mean_y + slope * (at - mean_x)


def model_main(args: argparse.Namespace) -> None:
    shape = {"model": args.model, "batch": args.batch, "seq": args.seq, "temperature": args.temperature,
             "dtype": args.dtype}
    vocab, full_layers = MODELS[args.model]["vocab_size"], MODELS[args.model]["num_hidden_layers"]
    runs: dict[tuple[str, int], dict[str, float]] = {}
    for layers in args.layers:
        for variant, head_vocab in (*((v, vocab) for v in MODEL_VARIANTS), ("control", args.control_vocab)):
            flags = [f"--{k}={v}" for k, v in {**shape, "layers": layers, "head_vocab": head_vocab}.items()]
            formula = "chunked" if variant == "control" else variant
            runs[variant, layers] = _run_child(["--variant", formula, *flags], CPU_MALLOC_ENV)
            print(f"  ran {variant} with {layers} layers: peak {runs[variant, layers]['peak_mib']:.0f} MiB", flush=True)
    first = runs[VARIANTS[0], args.layers[0]]
    print(f"{args.model} shape, B={args.batch} L={args.seq} ({first['tokens']} tokens), {args.dtype} weights, on "
          f"{first['device']}; logits {first['logits_mib']:.0f} MiB; control head {args.control_vocab} columns")
    print("peak: the step's peak above the baseline (parameters + AdamW state + batch; the gradients are in the peak)")
    print("vocab share: (peak - control peak) / peak, control = the same step with the head cut to the control width")
    print("fwd+bwd: the peak up to the end of backward, before the optimizer step (the step's peak may come after it)")
    print(f"{'variant':<9}{'layers':>7}{'params MiB':>12}{'baseline MiB':>14}{'peak MiB':>10}{'KiB/token':>11}"
          f"{'control MiB':>13}{'vocab MiB':>11}{'share':>7}{'saved [..V] MiB':>17}{'fwd+bwd MiB':>13}")
    fit = len(set(args.layers)) >= 2 and full_layers not in args.layers

    def at(variant: str, key: str, layers: int) -> float:
        if layers in args.layers:
            return runs[variant, layers][key]
        return _line(args.layers, [runs[variant, n][key] for n in args.layers], layers)

    shown = [*args.layers, full_layers] if fit else args.layers
    for variant in MODEL_VARIANTS:
        for layers in shown:
            peak, control = at(variant, "peak_mib", layers), at("control", "peak_mib", layers)
            label = str(layers) if layers in args.layers else f"~{layers}"
            print(f"{variant:<9}{label:>7}{at(variant, 'param_mib', layers):>12.0f}{at(variant, 'baseline_mib', layers):>14.0f}"
                  f"{peak:>10.0f}{peak * 1024 / first['tokens']:>11.0f}{control:>13.0f}{peak - control:>11.0f}"
                  f"{100 * (peak - control) / peak:>6.0f}%{runs[variant, args.layers[-1]]['saved_vocab_wide_mib']:>17.0f}"
                  f"{at(variant, 'backward_peak_mib', layers):>13.0f}")
    layers = shown[-1]
    old, new, control = (at(v, "peak_mib", layers) for v in (*VARIANTS, "control"))
    print(f"old / chunked at {'~' if fit else ''}{layers} layers: peak x{old / new:.2f}, "
          f"vocab part x{(old - control) / max(new - control, 1e-9):.2f}")
    fused = at("fused", "peak_mib", layers)
    print(f"chunked / fused at {'~' if fit else ''}{layers} layers: peak x{new / fused:.2f} ({new - fused:.0f} MiB less), "
          f"vocab share {100 * (new - control) / new:.0f}% -> {100 * (fused - control) / fused:.0f}%; fwd+bwd peak "
          f"{at('chunked', 'backward_peak_mib', layers):.0f} -> {at('fused', 'backward_peak_mib', layers):.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the head's, so the logits'")
    parser.add_argument("--variant", choices=MODEL_VARIANTS, help="measure one variant in this process and print its JSON")
    parser.add_argument("--model", choices=sorted(MODELS), help="a whole GRPO micro-step on this model's shape")
    parser.add_argument("--layers", type=int, nargs="+", default=[2], help="--model: decoder blocks; several: a fit")
    parser.add_argument("--control-vocab", type=int, default=128, help="--model: the control run's head width")
    parser.add_argument("--head_vocab", type=int, help=argparse.SUPPRESS)  # one child run's head width
    args = parser.parse_args()
    if args.model:
        if args.variant:
            print(json.dumps(measure_step(args.variant, model=args.model, layers=args.layers[0], batch=args.batch,
                                          seq=args.seq, head_vocab=args.head_vocab, temperature=args.temperature,
                                          dtype=args.dtype)))
        else:
            model_main(args)
        return
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
