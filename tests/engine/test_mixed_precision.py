"""trainer.mixed_precision: bf16 on a trainer that is not sharded (`workers/engine/precision.py`): float32 weights,
gradients and optimizer state, forwards in bfloat16; the generator holds bfloat16 weights and takes float32 syncs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.batching import collate_rollouts
from workers.engine.fused_head import head_logprobs, model_logprobs
from workers.engine.losses import token_logprobs
from workers.engine.metrics import Recorder
from workers.engine.models.attention import EngineAttention
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.precision import AutocastForward, apply_mixed_precision, compute_dtype
from workers.engine.recipes.grpo import train_grpo
from workers.engine.sampler import SamplingParams, TorchSampler


def _batch(folder: Path, rows: int = 6):
    loaded = load_pretrained(folder)
    sampler = TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids, pad_id=loaded.tokenizer.pad_id)
    prompts = [loaded.tokenizer.encode_prompt([{"role": "user", "content": f"{a}+{2 * a}="}]) for a in range(rows)]
    completions = sampler.generate(prompts, SamplingParams(max_new_tokens=6), seed=1)
    return collate_rollouts(prompts, [c.token_ids for c in completions], [c.logprobs for c in completions],
                            [1.0] * rows, pad_id=loaded.tokenizer.pad_id)


def test_mixed_precision_computes_in_bf16_and_keeps_float32_weights_and_gradients(sft_warm_start: tuple[Path, float]) -> None:
    folder, _ = sft_warm_start
    batch = _batch(folder)
    full = load_pretrained(folder).model.train()
    mixed = apply_mixed_precision(copy.deepcopy(full), mixed_precision="bf16")
    assert compute_dtype(mixed) == torch.bfloat16 and compute_dtype(full) is None
    assert apply_mixed_precision(mixed, mixed_precision="bf16").forward.forward.__self__ is mixed  # wrapped once
    assert apply_mixed_precision(full, mixed_precision="off").forward == full.forward  # off: the model's own forward

    assert mixed(batch.inputs).dtype == torch.bfloat16  # the forward ran in bf16
    gradients = []
    for model in (full, mixed):
        logprobs, _ = model_logprobs(model, batch.inputs, batch.targets)
        assert logprobs.dtype == torch.float32
        (logprobs * batch.response_mask).sum().backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    exact, rounded = model_logprobs(full, batch.inputs, batch.targets)[0], model_logprobs(mixed, batch.inputs, batch.targets)[0]
    gap = ((exact - rounded) * batch.response_mask).abs().max()
    assert 1e-6 < gap < 0.1  # rounded, but the same distribution
    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    whole = cosine(torch.cat([g.flatten() for g in gradients[0].values()]),
                   torch.cat([g.flatten() for g in gradients[1].values()]))
    assert whole > 0.99
    for name, grad in gradients[0].items():
        # a norm's weight gradient is a sum over every position with much cancellation: bf16 rounding shows most there
        assert cosine(grad, gradients[1][name]) > (0.98 if grad.dim() > 1 else 0.95), name


def test_the_fused_head_under_mixed_precision_is_the_autocast_head(sft_warm_start: tuple[Path, float]) -> None:
    """The fused head computes the logits in the body's bf16, as an autocast nn.Linear would, forward and backward."""
    folder, _ = sft_warm_start
    batch = _batch(folder)
    fused = apply_mixed_precision(load_pretrained(folder).model.train(), mixed_precision="bf16")
    plain = copy.deepcopy(fused)
    fused_lp, fused_entropy = head_logprobs(fused, batch.inputs, batch.targets, 0.7, entropy_grad=False)
    plain_lp, plain_entropy = token_logprobs(plain(batch.inputs), batch.targets, 0.7)
    assert torch.allclose(fused_lp, plain_lp, atol=1e-5) and torch.allclose(fused_entropy, plain_entropy, atol=1e-5)
    (fused_lp * batch.response_mask).sum().backward()
    (plain_lp * batch.response_mask).sum().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=2e-3, rtol=2e-2), name


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_attention_on_a_cpu_matches_float32(masked: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 40, 4, 32) for _ in range(3))
    mask = torch.ones(3, 1, 40, 40, dtype=torch.bool).tril() if masked else None
    attention = EngineAttention()
    exact = attention(q, k, v, attention_masks=mask)
    rounded = attention(*(t.bfloat16() for t in (q, k, v)), attention_masks=mask)
    assert rounded.dtype == torch.bfloat16
    assert (rounded.float() - exact).abs().max() < 0.05


def test_grpo_in_mixed_precision_learns_with_a_bf16_generator(sft_warm_start: tuple[Path, float], make_config) -> None:
    """A single-process run: the generator's bf16 log-probs and the trainer's autocast ones stay close, the trainer's
    weights stay float32, and the held-out reward rises as in the float32 runs (test_recipes.py). On this tiny
    model bf16's rounding slows the learning: at the float32 runs' 70 steps it rose 0.367 -> 0.430 (float32: 0.500),
    so this run takes 100."""
    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *ARITHMETIC, "trainer.batch_size=16", "trainer.micro_batch_size=128",
                         "grpo.group_size=8", "trainer.steps=100", "eval.every_steps=100", "trainer.optimizer.lr=5e-4",
                         "trainer.mixed_precision=bf16")
    assert config.rollout_dtype == "bfloat16"
    result = train_grpo(config, Recorder())
    start, end = result.first_eval.reward_mean, result.eval.reward_mean
    print(f"mixed precision: held-out reward {start:.3f} -> {end:.3f} ({result.seconds:.1f} s)")
    assert end >= start + 0.1
    gaps = [m["mismatch/abs_mean"] for m in result.metrics]
    assert all(0.0 < gap < 0.05 for gap in gaps)  # bf16 generator vs autocast trainer: rounding, not a different policy
    assert all(abs(m["ratio/mean"] - 1.0) < 0.02 for m in result.metrics)


def test_autocast_forward_is_what_apply_installs() -> None:
    model = torch.nn.Linear(4, 3)
    apply_mixed_precision(model, mixed_precision="bf16")
    assert isinstance(model.forward, AutocastForward)
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and model.weight.dtype == torch.float32
