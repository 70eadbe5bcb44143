"""The engine's torch path in bf16 on one GPU (not a test): model, sampler, training step.

    python tests/bench/gpu_bf16.py            # a lent H100 or H200: Qwen3-1.7B-sized, random init, bf16, cuda (< 4 min)
    python tests/bench/gpu_bf16.py --smoke    # tiny float32 model on CPU, seconds (tests/engine/test_gpu_script.py)

Self-contained for the GPU machine (Python 3.12, torch with CUDA, transformers, triton; no
vLLM, no Monarch, no network, no checkpoint): the model is randomly initialised from a
config dict in this file, prompts and training rows are random token ids. Prints one JSON
object per line:

  {"kind": "env", ...}        interpreter, torch, device, which model path was used
  {"kind": "model", ...}      parameter count, build time
  {"kind": "generate", ...}   the engine's TorchSampler (KV cache, per-token log-probs):
                              batch 64 x prompt 128 -> 256 new tokens; tokens/s; twice: 64 distinct
                              prompts, then 8 prompts x 8 rows (GRPO groups: each prompt prefilled once)
  {"kind": "train", ...}      one engine training step (forward, GRPO or SFT loss from
                              workers/engine/losses.py, backward, grad clip, AdamW as in
                              training.build_optimizer), 8 x 1024 tokens (or the largest
                              micro-batch that fits, gradients accumulated); GRPO scores its
                              targets through the fused head where it applies, as policy_update
                              does (`logprobs`); tokens/s and MFU against the device's bf16 dense
                              peak (PEAK_TFLOPS by its name, or --peak-tflops)
  {"kind": "weight_sync", ...} a weight sync's cost on the trainer's path (`weight_parts.py`, what every trainer
                              rank does before the generators read its part over Monarch's RDMA): the
                              bf16 model's part of rank 0 of 1 and of 8 replicated ranks copied into its
                              host staging memory (pinned on a GPU), the first time and again into the
                              same memory; a generator's assembly of the parts into a state dict
  {"kind": "in_trainer", ...} generator.in_trainer's weight sync: a rank's rollout copy of its model
                              (`TorchSampler.copy_of`, made once at start-up) refreshed from the trainer's
                              weights in device memory (the rank's weight_load before the first request after
                              an optimizer step), and the device memory the copy holds
  {"kind": "summary", ...}    the headline numbers

Model path: the engine builds torchtitan's Qwen3 (`models/titan.build_decoder`). When
torchtitan is not importable (it is not installed on the lent GPU machines; it is pure
Python: carry `.venv/lib/python3.11/site-packages/torchtitan` and run with
`PYTHONPATH=.venv/lib/python3.11/site-packages`), or fails on that torch, the same Qwen3 architecture is built with
transformers' Qwen3ForCausalLM (random init, SDPA attention) and every line says
`"model_path": "transformers-fallback"`; the sampler, losses and optimizer are still the
engine's, through a thin adapter that maps the sampler's KV-cache calls onto HF's cache.
MFU counts 6 * parameters * tokens (the engine's `training.mfu`) and, separately, adds the
causal attention FLOPs (6 * layers * seq * heads * head_dim per token, forward+backward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from workers.engine.losses import grpo_loss, sft_loss, token_logprobs  # noqa: E402  (torch only)
from workers.engine.models.kv_cache import KVCache  # noqa: E402  (torch only)
from workers.engine.sampler import SamplingParams, TorchSampler  # noqa: E402  (torch only)
from workers.engine.weight_parts import assemble, copy_into, part_layout, staging_memory, tied_names  # noqa: E402  (torch only)

QWEN3_1_7B = {  # Qwen/Qwen3-1.7B's config.json shapes
    "model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "attention_bias": False,
}
TINY = {**QWEN3_1_7B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 512}


PEAK_TFLOPS = (  # bf16 dense, by a part of the device's name, the first that matches
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0), ("A100", 312.0),
)
DEFAULT_PEAK_TFLOPS = 989.0  # H100 SXM and H200


def peak_tflops_of(device_name: str) -> float:
    return next((tflops for part, tflops in PEAK_TFLOPS if part in device_name), DEFAULT_PEAK_TFLOPS)


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- model


def torchtitan_status() -> tuple[bool, str]:
    try:
        import torchtitan  # noqa: F401

        from workers.engine.models import titan  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the fallback
        return False, f"{type(exc).__name__}: {exc}"[:300]
    return True, getattr(sys.modules["torchtitan"], "__version__", "importable")


class HFQwen3ForEngine(nn.Module):
    """transformers' Qwen3ForCausalLM behind the engine's decoder call signature.

    `model(tokens)` -> logits; `model(tokens, positions=..., attention_masks=KVCache)` decodes,
    with the engine's cache object standing for an HF DynamicCache (its mask gives the
    padding mask: the last query row of a prefill, the only row of a decode step).
    """

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device):
        super().__init__()
        from transformers import Qwen3Config, Qwen3ForCausalLM

        fields = {k: v for k, v in hf_config.items() if k != "model_type"}
        config = Qwen3Config(**fields, attn_implementation="sdpa", use_cache=True)
        with torch.device(device):
            self.hf = Qwen3ForCausalLM(config)
        rope = {name: buffer.clone() for name, buffer in self.hf.named_buffers() if buffer.is_floating_point()}
        self.hf.to(dtype)
        for name, buffer in rope.items():  # RoPE's inverse frequencies stay float32, as the torchtitan model's do
            owner, _, leaf = name.rpartition(".")
            self.hf.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                attention_masks: KVCache | None = None) -> torch.Tensor:
        if attention_masks is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        from transformers import DynamicCache

        cache = attention_masks
        if not hasattr(cache, "hf_cache"):
            cache.hf_cache = DynamicCache()  # type: ignore[attr-defined]
            cache.on_select_rows.append(cache.hf_cache.batch_select_indices)  # a shared prompt's prefill, fanned out
        key_valid = cache.mask[:, 0, -1, :].long()  # [B, past + new]
        out = self.hf(input_ids=tokens, position_ids=positions, attention_mask=key_valid,
                      past_key_values=cache.hf_cache, use_cache=True, logits_to_keep=1)  # type: ignore[attr-defined]
        return out.logits


def build_model(hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device, force_fallback: bool) -> tuple[nn.Module, str]:
    ok, _ = torchtitan_status()
    if ok and not force_fallback:
        try:
            from workers.engine.models.titan import build_decoder

            model = build_decoder(hf_config, device=device, dtype=dtype)
            with torch.no_grad():  # fails fast if this torchtitan does not work with this torch
                model(torch.ones(1, 4, dtype=torch.long, device=device))
            return model, "engine-torchtitan"
        except Exception as exc:  # noqa: BLE001 - measure what can be measured, and say why
            emit("warning", message=f"the engine's torchtitan model failed, using transformers' Qwen3: "
                                    f"{type(exc).__name__}: {str(exc)[:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return HFQwen3ForEngine(hf_config, dtype, device), "transformers-fallback"


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied embedding counts once


# --------------------------------------------------------------------------- measurements

def measure_weight_sync(model: nn.Module, *, device: torch.device, repeats: int) -> dict[str, Any]:
    """Rank 0's staging of its part of the weights, with 1 and with 8 replicated ranks, and the reader's assembly."""
    state = model.state_dict()
    tied = tied_names(state)  # a tied embedding travels once
    total = sum(t.numel() * t.element_size() for name, t in state.items() if name not in tied)
    result: dict[str, Any] = {"model_bytes": total, "tied": sorted(tied)}
    for world in (1, 8):
        layout, tensors = part_layout(state, rank=0, world=world, sharded=False)
        t0 = time.perf_counter()
        flat = staging_memory(layout, tensors)
        copy_into(flat, layout, tensors)
        sync(device)
        first = time.perf_counter() - t0
        again = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy_into(flat, layout, tensors)
            sync(device)
            again.append(time.perf_counter() - t0)
        reuse = min(again)
        result[f"ranks{world}"] = {"part_bytes": layout.nbytes, "first_stage_s": round(first, 4),
                                   "stage_s": round(reuse, 5), "stage_gb_per_s": round(layout.nbytes / reuse / 1e9, 2),
                                   "pinned": flat.is_pinned()}
        if world == 1:
            t0 = time.perf_counter()
            rebuilt = assemble([(flat, layout)])
            result["assemble_s"] = round(time.perf_counter() - t0, 4)
            result["exact"] = all(torch.equal(rebuilt[k].to(device), v) for k, v in state.items())
        del flat
    return result


def measure_in_trainer(model: nn.Module, *, vocab: int, dtype: torch.dtype, device: torch.device,
                       repeats: int) -> dict[str, Any]:
    """generator.in_trainer: the rank's rollout copy made once, then refreshed from the trained weights in memory."""
    sync(device)
    t0 = time.perf_counter()
    rollout = TorchSampler.copy_of(model, dtype=dtype, eos_token_ids=[vocab], pad_id=0)
    sync(device)
    copy_s = time.perf_counter() - t0
    with torch.no_grad():  # stands for an optimizer step: the copy must follow the trained weights
        for parameter in model.parameters():
            parameter.mul_(0.5)
    refreshes = []
    for version in range(1, repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        rollout.load_weights(model.state_dict(), version)
        sync(device)
        refreshes.append(time.perf_counter() - t0)
    trained = dict(model.named_parameters())
    exact = all(torch.equal(tensor, trained[name].to(dtype)) for name, tensor in rollout.model.named_parameters())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(2.0)
    copy_bytes = sum(p.numel() * p.element_size() for p in rollout.model.parameters())
    del rollout
    return {"copy_s": round(copy_s, 4), "refresh_s": round(min(refreshes), 5),
            "refresh_gb_per_s": round(copy_bytes / min(refreshes) / 1e9, 2), "copy_bytes": copy_bytes, "exact": exact}


def measure_generation(model: nn.Module, *, vocab: int, batch: int, prompt_len: int, new_tokens: int,
                       device: torch.device, repeats: int, ragged: bool, forward, group: int = 1) -> dict[str, Any]:  # noqa: ANN001
    """`group` rows share each prompt (a GRPO group: the sampler prefills it once); 1: every prompt distinct."""
    model.eval()
    # eos is a token id the random model cannot produce: every row decodes all new_tokens
    sampler = TorchSampler(model, eos_token_ids=[vocab], pad_id=0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (batch // group, prompt_len), generator=gen).tolist()
    if ragged:  # left padding in the batch: rows of prompt_len, prompt_len - 1, ...
        prompts = [p[row % 3:] for row, p in enumerate(prompts)]
    prompts = [p for p in prompts for _ in range(group)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    sampler.generate(prompts, SamplingParams(max_new_tokens=min(8, new_tokens)), seed=0)  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, tokens = [], 0
    for r in range(repeats):
        sync(device)
        start = time.perf_counter()
        completions = sampler.generate(prompts, params, seed=1 + r)
        sync(device)
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for c in completions)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    # the recorded log-probs against a full forward of prompt + completion, row by row (no cache, no padding)
    diff = 0.0
    with torch.no_grad():
        for c in completions[:4]:
            seq = torch.tensor([c.prompt_ids + c.token_ids], device=device)
            logits = forward(seq[:, :-1])[:, len(c.prompt_ids) - 1:]
            recomputed, _ = token_logprobs(logits, seq[:, len(c.prompt_ids):], 1.0)
            diff = max(diff, float((recomputed[0].cpu() - torch.tensor(c.logprobs)).abs().max()))
    seconds = min(times)
    return {
        "batch": len(prompts), "group": group, "prompt_len": prompt_len, "new_tokens": new_tokens, "generated_tokens": tokens,
        "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_decode_step": round(1000 * seconds / new_tokens, 3),
        "all_seconds": [round(t, 4) for t in times],
        "logprob_max_abs_diff_vs_full_forward": float(f"{diff:.3g}"),
        "peak_memory_gib": round(peak, 2) if peak is not None else None,
    }


def _rows(vocab: int, rows: int, seq: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A rollout-shaped batch: prompt in the first quarter, response after it."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (rows, seq + 1), generator=gen)
    mask = torch.zeros(rows, seq, dtype=torch.bool)
    mask[:, seq // 4:] = True
    return {
        "inputs": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device), "mask": mask.to(device),
        "behaviour": (-math.log(vocab) + 0.1 * torch.randn(rows, seq, generator=gen)).to(device),
        "advantages": torch.randn(rows, generator=gen).to(device),
    }


def logprobs_path(model: nn.Module, model_path: str) -> str:
    """How GRPO scores its targets here, as the engine's policy_update does (fused_head.model_logprobs): the fused
    head, which never builds the [rows, seq, vocab] logits, where it applies (a torchtitan model), else the logits."""
    if model_path == "engine-torchtitan":
        from workers.engine.fused_head import fused_head_applies

        if fused_head_applies(model):
            return "fused_head"
    return "logits"


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rows: dict[str, torch.Tensor], *, loss: str,
               micro: int, forward, scoring: str) -> float:  # noqa: ANN001
    """The engine's policy_update / SFT step: micro-batches, one normaliser for the whole batch, clip, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    n = rows["inputs"].shape[0]
    normalizer = float(rows["mask"].sum())
    total = 0.0
    for start in range(0, n, micro):
        part = {k: v[start:start + micro] for k, v in rows.items()}
        if loss == "grpo":
            if scoring == "fused_head":
                from workers.engine.fused_head import model_logprobs

                logprobs, entropy = model_logprobs(model, part["inputs"], part["targets"])
            else:
                logprobs, entropy = token_logprobs(forward(part["inputs"]), part["targets"], 1.0)
            value, _ = grpo_loss(logprobs, part["behaviour"], part["advantages"], part["mask"], clip_epsilon=0.2,
                                 aggregation="token", entropy=entropy.detach(), normalizer=normalizer)
        else:
            value, _ = sft_loss(forward(part["inputs"]), part["targets"], part["mask"], normalizer=normalizer)
        value.backward()
        total += float(value.detach())
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    optimizer.step()
    return total


def measure_training(model: nn.Module, hf_config: dict[str, Any], *, loss: str, rows: int, seq: int, steps: int,
                     warmup: int, device: torch.device, peak_flops: float, n_params: int, forward,  # noqa: ANN001
                     scoring: str) -> dict[str, Any]:
    model.train()
    # training.build_optimizer: AdamW(lr, weight_decay, betas=(0.9, 0.95)) over trainable parameters
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95))
    batch = _rows(hf_config["vocab_size"], rows, seq, device, seed=1)
    micro = rows
    while True:  # the largest micro-batch that fits
        try:
            for _ in range(warmup):
                train_step(model, optimizer, batch, loss=loss, micro=micro, forward=forward, scoring=scoring)
            break
        except torch.cuda.OutOfMemoryError:
            if micro == 1:
                raise
        # outside the except: its traceback no longer holds the failed try's tensors, so their memory can go back
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        micro //= 2
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(train_step(model, optimizer, batch, loss=loss, micro=micro, forward=forward, scoring=scoring))
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    tokens = rows * seq
    flops_params = 6.0 * n_params * tokens
    # causal attention scores and values: 2 matmuls x 2 FLOPs x L^2/2 x heads x head_dim per layer and row, x3 with backward
    flops_attn = 6.0 * hf_config["num_hidden_layers"] * rows * seq * seq * hf_config["num_attention_heads"] * hf_config["head_dim"]
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    return {
        "loss": loss, "logprobs": scoring if loss == "grpo" else "logits", "rows": rows, "seq": seq,
        "micro_batch": micro, "tokens_per_step": tokens, "steps_timed": steps,
        "seconds_per_step": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
        "tflops_per_s": float(f"{(flops_params + flops_attn) / seconds / 1e12:.4g}"),
        "mfu": float(f"{flops_params / seconds / peak_flops:.4g}"),  # the engine's training.mfu: 6 * params * tokens
        "mfu_with_attention": float(f"{(flops_params + flops_attn) / seconds / peak_flops:.4g}"),
        "peak_flops": peak_flops, "losses_finite": all(math.isfinite(x) for x in losses),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny float32 model on CPU (the test's mode)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 with --smoke, else 4)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 dense peak of one device (default: by the device's name, PEAK_TFLOPS)")
    parser.add_argument("--gen-batch", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--group", type=int, default=None, help="rows a prompt in the grouped generate line (default 8)")
    parser.add_argument("--train-rows", type=int, default=None)
    parser.add_argument("--train-seq", type=int, default=None)
    parser.add_argument("--train-steps", type=int, default=None)
    parser.add_argument("--force-fallback", action="store_true", help="use transformers' Qwen3 even if torchtitan imports")
    args = parser.parse_args(argv)
    smoke = args.smoke
    torch.set_num_threads(args.threads or (1 if smoke else 4))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    device = torch.device(args.device or ("cpu" if smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        emit("error", message="CUDA is not available: run with --smoke (CPU) or on a GPU machine")
        return 2
    dtype = torch.float32 if smoke else torch.bfloat16
    hf_config = TINY if smoke else QWEN3_1_7B
    settings = {
        "gen_batch": args.gen_batch or (4 if smoke else 64), "prompt_len": args.prompt_len or (8 if smoke else 128),
        "new_tokens": args.new_tokens or (8 if smoke else 256), "train_rows": args.train_rows or (2 if smoke else 8),
        "train_seq": args.train_seq or (32 if smoke else 1024), "train_steps": args.train_steps or (2 if smoke else 5),
        "group": args.group or (2 if smoke else 8),
    }
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak_tflops = args.peak_tflops or peak_tflops_of(device_name)
    peak = peak_tflops * 1e12
    titan_ok, titan_info = torchtitan_status()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    emit("env", python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
         device=device_name, peak_tflops=peak_tflops,
         torchtitan=titan_info if titan_ok else None, torchtitan_error=None if titan_ok else titan_info,
         dtype=str(dtype).removeprefix("torch."), smoke=smoke, threads=torch.get_num_threads(), **settings)

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, model_path = build_model(hf_config, dtype=dtype, device=device, force_fallback=args.force_fallback)
    model.requires_grad_(True)
    sync(device)
    n_params = count_parameters(model)
    emit("model", model_path=model_path, params=n_params, build_s=round(time.perf_counter() - t0, 2),
         config={k: hf_config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")})

    forward = model if model_path == "engine-torchtitan" else (lambda x: model.hf(input_ids=x, use_cache=False).logits)
    generations = {}
    for group in (1, settings["group"]):  # distinct prompts, then GRPO groups (a prompt prefilled once a group)
        generations[group] = measure_generation(
            model, vocab=hf_config["vocab_size"], batch=settings["gen_batch"], prompt_len=settings["prompt_len"],
            new_tokens=settings["new_tokens"], device=device, repeats=1 if smoke else 2, ragged=smoke, forward=forward,
            group=group)
        emit("generate", model_path=model_path, sampler="workers.engine.sampler.TorchSampler", **generations[group])
    generation = generations[1]
    if device.type == "cuda":
        torch.cuda.empty_cache()

    trains = {}
    for loss in ("grpo", "sft"):
        result = measure_training(model, hf_config, loss=loss, rows=settings["train_rows"], seq=settings["train_seq"],
                                  steps=settings["train_steps"] if loss == "grpo" else max(1, settings["train_steps"] - 2),
                                  warmup=1, device=device, peak_flops=peak, n_params=n_params, forward=forward,
                                  scoring=logprobs_path(model, model_path))
        trains[loss] = result
        emit("train", model_path=model_path, **result)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    weight_sync = measure_weight_sync(model, device=device, repeats=1 if smoke else 3)
    emit("weight_sync", model_path=model_path, **weight_sync)
    in_trainer = measure_in_trainer(model, vocab=hf_config["vocab_size"], dtype=dtype, device=device,
                                    repeats=1 if smoke else 3)
    emit("in_trainer", model_path=model_path, **in_trainer)

    emit("summary", model_path=model_path, smoke=smoke, params=n_params,
         gen_tokens_per_s=generation["tokens_per_s"], gen_tokens_per_s_grouped=generations[settings["group"]]["tokens_per_s"],
         train_tokens_per_s=trains["grpo"]["tokens_per_s"], mfu=trains["grpo"]["mfu"],
         mfu_with_attention=trains["grpo"]["mfu_with_attention"],
         sft_train_tokens_per_s=trains["sft"]["tokens_per_s"], sft_mfu=trains["sft"]["mfu"],
         weight_stage_s=weight_sync["ranks1"]["stage_s"], weight_stage_s_8_ranks=weight_sync["ranks8"]["stage_s"],
         in_trainer_refresh_s=in_trainer["refresh_s"],
         peak_tflops=peak_tflops, total_s=round(time.perf_counter() - started, 1),
         imported_monarch="monarch" in sys.modules, imported_vllm="vllm" in sys.modules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
