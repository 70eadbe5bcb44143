"""The LM head fused into the chunked log-probs (fused_head.py) against the unfused path, model(inputs) then
losses.token_logprobs, on tiny Qwen3 models with and without tied embeddings: values, every parameter's gradient,
what is kept for backward, and the GRPO step's use of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from workers.engine.batching import collate_rollouts
from workers.engine.config import GrpoConfig
from workers.engine.fused_head import fused_head_applies, fused_token_logprobs, head_logprobs
from workers.engine.grpo_math import accumulate_gradients, loss_normalizer, micro_batch_loss, sequence_logprobs
from workers.engine.losses import grpo_loss, token_logprobs
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.models.tiny import VOCAB_SIZE, make_tiny_model
from workers.engine.sharding import shard_model

B, T = 3, 11  # B * T = 33 positions: chunks of 5 or 7 leave a short last one; no shape is VOCAB_SIZE by accident


@pytest.fixture(scope="module")
def tiny_tied_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-tied"), family="qwen3", tie_word_embeddings=True,
                           init_scale=3.0)


@pytest.fixture(params=["untied", "tied"])
def model(request: pytest.FixtureRequest) -> nn.Module:
    folder = request.getfixturevalue("tiny_qwen3" if request.param == "untied" else "tiny_tied_qwen3")
    loaded = load_pretrained(folder).model
    tied = loaded.lm_head.weight is loaded.tok_embeddings.weight
    assert tied == (request.param == "tied")
    return loaded


def _case(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "inputs": torch.randint(0, VOCAB_SIZE, (B, T), generator=gen),
        "targets": torch.randint(0, VOCAB_SIZE, (B, T), generator=gen),
        "behaviour": -5.0 * torch.rand(B, T, generator=gen),
        "advantages": torch.randn(B, generator=gen),
        "mask": torch.rand(B, T, generator=gen) > 0.3,
    }


def _step(model: nn.Module, case: dict[str, torch.Tensor], *, fused: bool, temperature: float, entropy_coef: float,
          chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(log-probs, entropy, every parameter's gradient) of a GRPO loss's forward and backward."""
    model.zero_grad(set_to_none=True)
    entropy_grad = entropy_coef > 0.0
    if fused:
        logprobs, entropy = head_logprobs(model, case["inputs"], case["targets"], temperature,
                                          entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)
    else:
        logprobs, entropy = token_logprobs(model(case["inputs"]), case["targets"], temperature,
                                           entropy_grad=entropy_grad)
    assert entropy.requires_grad == entropy_grad
    loss, _ = grpo_loss(logprobs, case["behaviour"], case["advantages"], case["mask"], clip_epsilon=0.2,
                        entropy=entropy, entropy_coef=entropy_coef)
    loss.backward()
    return logprobs.detach(), entropy.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("temperature", "entropy_coef", "chunk_tokens"), [(1.0, 0.0, 256), (0.7, 0.05, 7), (1.6, 0.0, 5),
                                                                          (1.3, 0.1, 1)])
def test_fused_head_matches_the_unfused_path_in_values_and_every_gradient(
        model: nn.Module, temperature: float, entropy_coef: float, chunk_tokens: int) -> None:
    case = _case()
    logprobs, entropy, grads = _step(model, case, fused=False, temperature=temperature, entropy_coef=entropy_coef,
                                     chunk_tokens=chunk_tokens)
    fused_logprobs, fused_entropy, fused_grads = _step(model, case, fused=True, temperature=temperature,
                                                       entropy_coef=entropy_coef, chunk_tokens=chunk_tokens)
    assert fused_logprobs.shape == (B, T) and fused_entropy.shape == (B, T)
    assert torch.allclose(fused_logprobs, logprobs, atol=1e-5) and torch.allclose(fused_entropy, entropy, atol=1e-5)
    head_name = next(name for name, p in model.named_parameters() if p is model.lm_head.weight)
    assert grads.keys() == fused_grads.keys() and head_name in grads  # a tied head's weight is the embedding's
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name  # every parameter takes part in the loss
        assert torch.allclose(fused_grads[name], grad, atol=1e-6, rtol=1e-4), name
    assert model._skip_lm_head is False


def test_the_tied_weight_gradient_is_the_sum_of_the_head_and_the_embedding(tiny_tied_qwen3: Path) -> None:
    model = load_pretrained(tiny_tied_qwen3).model
    weight, case = model.lm_head.weight, {**_case(1), "mask": torch.ones(B, T, dtype=torch.bool)}
    assert weight is model.tok_embeddings.weight
    _, _, grads = _step(model, case, fused=True, temperature=0.9, entropy_coef=0.05, chunk_tokens=4)
    tied = next(grads[name] for name, p in model.named_parameters() if p is weight)
    model._skip_lm_head = True
    hidden = model(case["inputs"]).detach()
    model._skip_lm_head = False
    logprobs, entropy = fused_token_logprobs(hidden, weight, case["targets"], 0.9, chunk_tokens=4, entropy_grad=True)
    loss, _ = grpo_loss(logprobs, case["behaviour"], case["advantages"], case["mask"], clip_epsilon=0.2,
                        entropy=entropy, entropy_coef=0.05)
    (head_only,) = torch.autograd.grad(loss, weight)
    embedding_part = tied - head_only
    used = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    used[case["inputs"].unique()] = True
    # every position's entropy bonus counts: each input token's row takes a part from the embedding
    assert (embedding_part[used].abs().amax(dim=1) > 0).all()
    assert torch.allclose(embedding_part[~used], torch.zeros(()), atol=1e-7)  # and no other row does


def test_the_head_is_restored_after_an_error(model: nn.Module) -> None:
    with pytest.raises((RuntimeError, IndexError)):
        head_logprobs(model, torch.full((B, T), VOCAB_SIZE + 5), torch.zeros(B, T, dtype=torch.long), 1.0,
                      entropy_grad=False)  # token ids beyond the embedding
    assert model._skip_lm_head is False
    assert model(_case()["inputs"]).shape == (B, T, VOCAB_SIZE)  # the model's own forward has its head back


def _vocab_wide_saved(model: nn.Module, run) -> list[torch.Size]:
    """Shapes of the tensors autograd saves for backward during `run()` that have the vocabulary in their shape,
    the parameters (the head's weight) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if VOCAB_SIZE in t.shape and t.untyped_storage().data_ptr() not in params:
            found.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return found


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_fused_path_keeps_nothing_vocabulary_wide_for_backward(model: nn.Module, entropy_grad: bool) -> None:
    case = _case()
    fused = _vocab_wide_saved(model, lambda: head_logprobs(model, case["inputs"], case["targets"], 0.8,
                                                           entropy_grad=entropy_grad, chunk_tokens=8))
    unfused = _vocab_wide_saved(model, lambda: token_logprobs(model(case["inputs"]), case["targets"], 0.8,
                                                              entropy_grad=entropy_grad))
    assert fused == []
    assert (B, T, VOCAB_SIZE) in unfused  # the unfused path keeps its logits: the hook sees them


def test_fused_head_applies_to_an_unsharded_decoder_only(tiny_qwen3: Path, tmp_path: Path) -> None:
    model = load_pretrained(tiny_qwen3).model
    assert fused_head_applies(model)
    assert not fused_head_applies(nn.Linear(4, 4))
    other = load_pretrained(tiny_qwen3).model
    other.lm_head = nn.Identity()  # not a linear head: nothing to fuse
    assert not fused_head_applies(other)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_model(model, mixed_precision="off")
        assert not fused_head_applies(model)  # FSDP reshards the head's weight after the forward
    finally:
        dist.destroy_process_group()


def test_the_grpo_step_runs_the_fused_head_and_matches_the_unfused_gradients(tiny_trainable_qwen3: Path) -> None:
    model = load_pretrained(tiny_trainable_qwen3).model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 5, 4)]
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 2, 4)]
    batch = collate_rollouts(prompts, responses, [(-3.0 * torch.rand(len(r), generator=gen)).tolist() for r in responses],
                             [1.0, -0.5, 0.3], pad_id=0)
    grpo = GrpoConfig(entropy_coef=0.05)
    normalizer = loss_normalizer(batch, grpo.aggregation)

    model.zero_grad(set_to_none=True)
    saved = _vocab_wide_saved(model, lambda: accumulate_gradients(
        model, batch, grpo=grpo, temperature=0.8, micro_batch_size=2, normalizer=normalizer, sync=True))
    assert saved == []  # the step took the fused path
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    for start in (0, 2):
        micro = batch.rows(start, start + 2)
        logprobs, entropy = token_logprobs(model(micro.inputs), micro.targets, 0.8, entropy_grad=True)
        micro_batch_loss(micro, logprobs, entropy, grpo=grpo, normalizer=normalizer)[0].backward()
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0 and torch.allclose(fused[name], p.grad, atol=1e-6, rtol=1e-4), name

    expected = token_logprobs(model(batch.inputs), batch.targets, 0.8)[0].detach()
    assert torch.allclose(sequence_logprobs(model, batch, micro_batch_size=2, temperature=0.8), expected, atol=1e-5)


def test_bf16_weights_keep_their_dtype_and_stay_close(tiny_qwen3: Path) -> None:
    model = load_pretrained(tiny_qwen3, dtype="bfloat16").model
    case = _case()
    logprobs, entropy, grads = _step(model, case, fused=False, temperature=0.8, entropy_coef=0.05, chunk_tokens=7)
    fused_logprobs, fused_entropy, fused_grads = _step(model, case, fused=True, temperature=0.8, entropy_coef=0.05,
                                                       chunk_tokens=7)
    assert fused_logprobs.dtype == torch.float32 and fused_grads["lm_head.weight"].dtype == torch.bfloat16
    assert torch.allclose(fused_logprobs, logprobs, atol=0.1) and torch.allclose(fused_entropy, entropy, atol=0.1)
    head, fused_head = grads["lm_head.weight"].float(), fused_grads["lm_head.weight"].float()
    assert (fused_head - head).norm() <= 0.05 * head.norm()
