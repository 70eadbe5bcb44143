"""The KV-cache sampler: greedy equals a cache-free loop; recorded log-probs equal the trainer's."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from workers.engine.batching import collate_rollouts, collate_sft
from workers.engine.losses import token_logprobs
from workers.engine.models.hf_folder import LoadedModel, load_pretrained
from workers.engine import sampler as sampler_module
from workers.engine.sampler import SamplingParams, TorchSampler, draw_in_nucleus, draw_tokens, token_at

# float32: the cached decode and the full forward differ only in summation order.
LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["tiny_qwen3", "tiny_llama3"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    return load_pretrained(request.getfixturevalue(request.param))


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    # different lengths: the batch is left-padded
    texts = ["1+2=", "13+17=", "a longer prompt, to pad the others"]
    return [loaded.tokenizer.encode_prompt([{"role": "user", "content": t}]) for t in texts]


def _sampler(loaded: LoadedModel) -> TorchSampler:
    return TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids, pad_id=loaded.tokenizer.pad_id)


def test_greedy_equals_cache_free_loop(loaded: LoadedModel) -> None:
    prompts = _prompts(loaded)
    completions = _sampler(loaded).generate(prompts, SamplingParams(max_new_tokens=10, greedy=True), seed=0)
    for prompt, completion in zip(prompts, completions):
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(10):
                token = int(loaded.model(torch.tensor([ids]))[0, -1].argmax())
                ids.append(token)
                expected.append(token)
                if token in loaded.tokenizer.eos_token_ids:
                    break
        assert completion.token_ids == expected
        assert completion.finished == (expected[-1] in loaded.tokenizer.eos_token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_trainer_logprobs(loaded: LoadedModel, temperature: float) -> None:
    prompts = _prompts(loaded)
    completions = _sampler(loaded).generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature), seed=3)
    batch = collate_rollouts(
        [c.prompt_ids for c in completions], [c.token_ids for c in completions],
        [c.logprobs for c in completions], [0.0] * len(completions), pad_id=loaded.tokenizer.pad_id,
    )
    with torch.no_grad():
        trainer_logprobs, _ = token_logprobs(loaded.model(batch.inputs), batch.targets, temperature)
    assert batch.response_mask.sum() == sum(len(c.token_ids) for c in completions)
    gap = ((trainer_logprobs - batch.behaviour_logprobs) * batch.response_mask).abs().max().item()
    assert gap < LOGPROB_TOLERANCE


def test_sampling_is_seeded_and_temperature_matters(loaded: LoadedModel) -> None:
    prompts = _prompts(loaded)
    sampler = _sampler(loaded)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    first = sampler.generate(prompts, params, seed=7)
    again = sampler.generate(prompts, params, seed=7)
    other = sampler.generate(prompts, params, seed=8)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    cold = sampler.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1e-3), seed=7)
    greedy = sampler.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True), seed=0)
    assert [c.token_ids for c in cold] == [c.token_ids for c in greedy]


def test_top_p_keeps_only_the_nucleus(loaded: LoadedModel) -> None:
    prompts = _prompts(loaded)[:1] * 16
    sampler = _sampler(loaded)
    tiny_nucleus = sampler.generate(prompts, SamplingParams(max_new_tokens=4, top_p=1e-6), seed=1)
    greedy = sampler.generate(prompts[:1], SamplingParams(max_new_tokens=4, greedy=True), seed=0)[0]
    assert all(c.token_ids == greedy.token_ids for c in tiny_nucleus)


def test_a_draw_takes_the_first_token_whose_cumulative_mass_exceeds_it_and_never_one_without_mass() -> None:
    cumulative = torch.tensor([[0.0, 0.3, 0.3, 1.0, 1.0], [2.0, 2.0, 4.0, 4.0, 4.0]])
    def at(*uniform: float) -> list[int]:
        return token_at(cumulative, torch.tensor(uniform)[:, None]).tolist()
    assert at(0.0, 0.0) == [1, 0], "a draw of 0 takes the first token with mass"
    assert at(0.3, 0.49) == [3, 0] and at(0.29, 0.5) == [1, 2]
    assert at(1.0, 1.0) == [3, 2], "a draw that rounds up to the total takes the last token with mass"


def test_drawn_tokens_follow_the_probabilities_and_a_broken_row_is_refused() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(40_000, 1)
    tokens = draw_tokens(probs, torch.Generator().manual_seed(0))
    share = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert share[1] == 0 and torch.allclose(share, probs[0].double(), atol=0.01), share
    unnormalised = torch.tensor([[3.0, 1.0]]).repeat(40_000, 1)
    assert abs(draw_tokens(unnormalised, torch.Generator().manual_seed(1)).double().mean() - 0.25) < 0.01
    for broken in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="inf or nan"):
            draw_tokens(torch.tensor([[0.5, broken]]), torch.Generator().manual_seed(0))


def test_a_nucleus_draw_keeps_the_smallest_most_likely_set_reaching_top_p_in_proportion() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).repeat(40_000, 1)
    tokens = draw_in_nucleus(probs, 0.7, torch.Generator().manual_seed(0))
    share = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert share[0] == share[2] == 0, "0.5 + 0.3 reach 0.7: nothing less likely is drawn"
    assert abs(share[1] - 0.5 / 0.8) < 0.01 and abs(share[3] - 0.3 / 0.8) < 0.01, share
    with pytest.raises(ValueError, match="inf or nan"):
        draw_in_nucleus(torch.tensor([[0.5, float("nan"), 0.1]]), 0.9, torch.Generator().manual_seed(0))


def test_rows_drawn_from_their_top_candidates_or_from_a_whole_sort_get_the_same_token(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(3)
    peaked = torch.softmax(torch.randn(32, 1000, generator=generator) * 12, dim=-1)
    flat = torch.softmax(torch.randn(32, 1000, generator=generator) * 0.5, dim=-1)
    probs = torch.cat([peaked, flat])[torch.randperm(64, generator=generator)]
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 16)
    assert 0 < int((probs.topk(16, dim=-1).values.sum(-1) >= 0.9).sum()) < 64, "some rows take each way"
    mixed = draw_in_nucleus(probs, 0.9, torch.Generator().manual_seed(11))
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 1000)
    sorted_whole = draw_in_nucleus(probs, 0.9, torch.Generator().manual_seed(11))
    assert torch.equal(mixed, sorted_whole)
    ranks = (probs > probs.gather(1, mixed[:, None])).sum(-1)  # tokens more likely than the drawn one
    mass_before = (probs * (probs > probs.gather(1, mixed[:, None]))).sum(-1)
    assert bool((mass_before < 0.9).all()) and int(ranks.max()) > 16, "drawn inside each nucleus, some past 16"


def test_packed_examples_get_the_logprobs_they_get_alone(loaded: LoadedModel) -> None:
    prompts = _prompts(loaded)
    examples = [(p, [40 + i, 41 + i, loaded.tokenizer.eos_token_ids[0]]) for i, p in enumerate(prompts)]
    packed = collate_sft(examples, seq_len=256, pad_id=loaded.tokenizer.pad_id, packing=True)
    alone = collate_sft(examples, seq_len=256, pad_id=loaded.tokenizer.pad_id, packing=False)
    assert packed.inputs.shape[0] == 1 and alone.inputs.shape[0] == 3
    assert packed.positions[0].tolist().count(0) == 3  # each example restarts at position 0
    with torch.no_grad():
        lp_packed, _ = token_logprobs(loaded.model(packed.inputs, positions=packed.positions, attention_masks=packed.attention_mask), packed.targets)
        lp_alone, _ = token_logprobs(loaded.model(alone.inputs, positions=alone.positions), alone.targets)
    assert packed.loss_mask.sum() == alone.loss_mask.sum() == 3 * 3
    assert (lp_packed[packed.loss_mask] - lp_alone[alone.loss_mask]).abs().max() < LOGPROB_TOLERANCE


def test_a_weight_sync_that_does_not_fit_raises_naming_the_weights_and_keeps_the_version(loaded: LoadedModel) -> None:
    sampler = TorchSampler(copy.deepcopy(loaded.model), eos_token_ids=loaded.tokenizer.eos_token_ids,
                           pad_id=loaded.tokenizer.pad_id, policy_version=3)
    good = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    before = {name: tensor.clone() for name, tensor in sampler.model.state_dict().items()}
    first = next(iter(good))
    broken = [
        ({k: v for k, v in good.items() if k != first}, f"missing: {first}"),
        ({**good, "extra.weight": torch.zeros(1)}, "unexpected: extra.weight"),
        ({**good, first: torch.zeros(1)}, f"mis-shaped: {first} (1,)"),
    ]
    for state, named in broken:
        with pytest.raises(ValueError, match=re.escape(named)):
            sampler.load_weights(state, version=4)
        assert sampler.policy_version == 3
        assert all(torch.equal(tensor, before[name]) for name, tensor in sampler.model.state_dict().items())
    sampler.load_weights(good, version=4)
    assert sampler.policy_version == 4



def test_a_group_prefilled_once_decodes_as_each_prompt_alone(loaded: LoadedModel) -> None:
    """A prompt several rows share (a GRPO group) is prefilled once and its cache fanned out to the rows: greedy, each
    row decodes what its prompt decodes alone; sampled, the rows draw their own tokens and each recorded log-prob is
    the trainer's for that row."""
    first, second, third = _prompts(loaded)
    grouped = [first, first, first, second, third, third]
    sampler, greedy = _sampler(loaded), SamplingParams(max_new_tokens=12, greedy=True)
    for row, completion in enumerate(sampler.generate(grouped, greedy, seed=0)):
        alone = sampler.generate([grouped[row]], greedy, seed=0)[0]
        assert completion.prompt_ids == grouped[row] and completion.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(alone.logprobs), atol=LOGPROB_TOLERANCE)

    sampled = sampler.generate(grouped, SamplingParams(max_new_tokens=12, temperature=0.9), seed=5)
    assert len({tuple(c.token_ids) for c in sampled[:3]}) > 1  # one cache, each row its own draws
    batch = collate_rollouts([c.prompt_ids for c in sampled], [c.token_ids for c in sampled],
                             [c.logprobs for c in sampled], [0.0] * len(sampled), pad_id=loaded.tokenizer.pad_id)
    with torch.no_grad():
        trainer_logprobs, _ = token_logprobs(loaded.model(batch.inputs), batch.targets, 0.9)
    mask = batch.response_mask
    assert torch.allclose(trainer_logprobs[mask], batch.behaviour_logprobs[mask], atol=LOGPROB_TOLERANCE)
