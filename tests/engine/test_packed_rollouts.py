"""grpo.packing: a micro-batch's rollouts packed into fewer rows (each group's prompt once, its responses after it
seeing the prompt and themselves, units of them packed first-fit) give the padded layout's per-token log-probs on the
response, and so the same loss and gradients, for every loss."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.engine.conftest import ARITHMETIC
from workers.engine.batching import SHARED_PROMPT_POSITIONS, RolloutBatch, collate_rollouts, pack_rollouts
from workers.engine.config import GrpoConfig, RolloutCorrection
from workers.engine.data_parallel import RankShare
from workers.engine.grpo_math import accumulate_gradients, loss_normalizer, micro_batch_logprobs, sequence_logprobs
from workers.engine.grpo_metrics import update_metrics
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.recipes.grpo import train_grpo
from workers.engine.sharding import shard_model

PROMPT_LENGTHS = (3, 9, 5, 14, 2, 7, 4, 6)
RESPONSE_LENGTHS = (6, 2, 11, 3, 1, 8, 2, 5)
GROUPS = (3, 1, 2, 2)  # _grouped_batch: consecutive samples sharing a prompt (a GRPO group each)
MAX_NEW_TOKENS = 12


def _batch(*, groups: tuple[int, ...] | None = None) -> RolloutBatch:
    """Eight samples of varied lengths; with `groups`, consecutive samples take the first one's prompt."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    if groups is not None:
        firsts = [sum(groups[:i]) for i in range(len(groups))]
        prompts = [prompts[first] for first, size in zip(firsts, groups) for _ in range(size)]
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in RESPONSE_LENGTHS]
    logprobs = [(-3.0 * torch.rand(n, generator=gen)).tolist() for n in RESPONSE_LENGTHS]
    advantages = torch.randn(len(prompts), generator=gen).tolist()
    return collate_rollouts(prompts, responses, logprobs, advantages, pad_id=0)


def _grouped_batch() -> RolloutBatch:
    return _batch(groups=GROUPS)


@pytest.fixture(scope="module")
def models(tiny_qwen3: Path, tiny_llama3: Path) -> dict[str, nn.Module]:
    return {"qwen3": load_pretrained(tiny_qwen3).model.train(), "llama3": load_pretrained(tiny_llama3).model.train()}


def _response_targets(batch: RolloutBatch) -> torch.Tensor:
    """[B, T] True at each response token's target (what pack_rollouts reads), whatever the response mask says."""
    index = torch.arange(batch.inputs.shape[1])[None]
    return (index >= batch.prompt_lengths[:, None] - 1) & (index < batch.lengths[:, None])


def test_samples_are_packed_first_fit_into_fewer_rows_with_their_own_positions_and_mask() -> None:
    batch = _batch()
    packed = pack_rollouts(batch)
    samples, width = batch.inputs.shape
    assert batch.lengths.tolist() == [p + r - 1 for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    assert len(packed.inputs) < samples and packed.inputs.shape[1] <= width
    real = int(batch.lengths.sum())
    assert packed.inputs.numel() - real == packed.padding_positions < batch.inputs.numel() - real  # less padding
    # every response target is read once, from a position of its own that holds its input token and position
    responses = _response_targets(batch)
    assert len(packed.source) == len(set(packed.read.tolist())) == int(responses.sum()) == sum(RESPONSE_LENGTHS)
    assert torch.equal(packed.inputs.reshape(-1)[packed.read], batch.inputs.reshape(-1)[packed.source])
    assert torch.equal(packed.targets, batch.targets.reshape(-1)[packed.source])
    assert torch.equal(packed.positions.reshape(-1)[packed.read], packed.source % width)
    starts = (packed.positions == 0).sum(dim=1)
    assert int(starts.max()) > 1  # some row holds several samples
    row = int(starts.argmax())
    second = int((packed.positions[row] == 0).nonzero()[1])
    mask = packed.attention_mask[row, 0]
    assert mask[second, second] and not mask[second, second - 1]  # a sample's first token sees nothing before it
    assert mask[second - 1, : second].all()  # the first sample stays causal over itself
    unpacked = packed.unpack(packed.positions.reshape(-1)[packed.read].float())
    assert torch.equal(unpacked[responses], torch.arange(width).expand(samples, width)[responses].float())
    assert (unpacked[~responses] == 0).all()


def test_a_group_holds_its_prompt_once_and_each_response_sees_the_prompt_and_itself() -> None:
    batch = collate_rollouts([[1, 2, 3]] * 3, [[4, 5], [6, 7, 8], [9]], [[-1.0] * 2, [-1.0] * 3, [-1.0]],
                             [1.0, 0.0, -1.0], pad_id=0)
    packed = pack_rollouts(batch)
    # one row: the prompt, then each response but its last token (a target only): 3 + 1 + 2 + 0 positions
    assert packed.inputs.tolist() == [[1, 2, 3, 4, 6, 7]] and packed.padding_positions == 0
    assert packed.positions.tolist() == [[0, 1, 2, 3, 3, 4]]  # each response continues from the prompt's end
    mask = packed.attention_mask[0, 0]
    assert mask[3, :4].all() and mask[4, :3].all() and not mask[4, 3]  # the second response skips the first
    assert mask[5, [0, 1, 2, 4, 5]].all() and not mask[5, 3]
    assert not mask[:3, 3:].any()  # the prompt sees no response
    # the prompt's last position predicts every response's first token
    assert packed.read.tolist() == [2, 3, 2, 4, 5, 2]
    assert packed.targets.tolist() == [4, 5, 6, 7, 8, 9]
    assert packed.source.tolist() == [2, 3, 7, 8, 9, 12]  # into the padded [3, 5] layout


def test_a_group_wider_than_the_unit_limit_is_split_into_units_that_each_hold_the_prompt() -> None:
    response = [5] * 600
    batch = collate_rollouts([[1, 2]] * 8, [response] * 8, [[-1.0] * 600] * 8, [0.0] * 8, pad_id=0)
    packed = pack_rollouts(batch)
    assert 2 + 599 * 3 <= SHARED_PROMPT_POSITIONS < 2 + 599 * 4  # a prompt and 3 responses fit a unit, 4 do not
    assert packed.inputs.shape == (3, 2 + 599 * 3)  # units of 3, 3 and 2 responses, one a row
    assert int((packed.positions == 0).sum()) == 3 + 1  # a prompt starting each unit, and the last row's padding
    assert len(packed.source) == 8 * 600


def test_padding_of_a_row_wider_than_the_padded_layout_keeps_to_its_positions() -> None:
    # a group of long responses packs two a unit (rows of 1980 positions); a group of one-token responses, a row of
    # its own, is padded to that width. Its padding's positions once ran to 1915, past a 1024-position model's rope
    # (generator.max_new_tokens=960 with data.max_prompt_tokens 64 failed its first train step).
    long, short = [5] * 959, [5]
    batch = collate_rollouts([[1] * 64] * 8 + [[2] * 64] * 8, [long] * 8 + [short] * 8,
                             [[-1.0] * 959] * 8 + [[-1.0]] * 8, [0.0] * 16, pad_id=0)
    packed = pack_rollouts(batch)
    assert packed.inputs.shape[1] > batch.inputs.shape[1] and packed.padding_positions > batch.inputs.shape[1]
    assert int(packed.positions.max()) == batch.inputs.shape[1] - 1


def test_an_empty_response_has_no_target_and_its_group_still_packs() -> None:
    batch = collate_rollouts([[1, 2, 3], [1, 2, 3], [4, 5]], [[], [6, 7], []], [[], [-1.0, -1.0], []],
                             [0.0, 0.0, 0.0], pad_id=0)
    packed = pack_rollouts(batch)
    assert packed.inputs.tolist() == [[1, 2, 3, 6], [4, 5, 0, 0]]
    assert packed.read.tolist() == [2, 3] and packed.source.tolist() == [6, 7] and packed.targets.tolist() == [6, 7]
    assert packed.padding_positions == 2


def test_rows_of_one_sample_each_need_no_mask() -> None:
    batch = collate_rollouts([[1, 2, 3], [1, 2, 4], [2, 2, 3]], [[4, 5], [6, 7, 8], [9]],
                             [[-1.0] * 2, [-1.0] * 3, [-1.0]], [1.0, 0.0, -1.0], pad_id=0)
    packed = pack_rollouts(batch)
    assert packed.attention_mask is None and packed.inputs.shape == batch.inputs.shape
    assert torch.equal(pack_rollouts(batch.rows(2, 3)).inputs, batch.inputs[2:3, :3])  # trimmed to its longest


def _step(model: nn.Module, batch: RolloutBatch, grpo: GrpoConfig, *, share: RankShare | None = None,
          micro_batch_size: int = 3) -> tuple[float, list[dict[str, float]], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    mine, _ = (share or RankShare()).rows(batch, micro_batch_size)
    loss, parts = accumulate_gradients(
        model, mine, grpo=grpo, temperature=0.8, micro_batch_size=micro_batch_size,
        normalizer=loss_normalizer(batch, grpo.aggregation, max_new_tokens=MAX_NEW_TOKENS), sync=True)
    return loss, parts, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _with_reference_and_pi_old(model: nn.Module, *, packing: bool, groups: tuple[int, ...] | None) -> RolloutBatch:
    """The batch with the log-probs of a moved copy as the reference and of another as pi_old."""
    batch = _batch(groups=groups)
    moved = [copy.deepcopy(model) for _ in range(2)]
    for seed, other in enumerate(moved):
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    batch.ref_logprobs = sequence_logprobs(moved[0], batch, micro_batch_size=3, temperature=0.8, packing=packing)
    batch.old_logprobs = sequence_logprobs(moved[1], batch, micro_batch_size=3, temperature=0.8, packing=packing)
    return batch


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["distinct_prompts", "groups"])
@pytest.mark.parametrize(("family", "loss"), [
    ("qwen3", "grpo"), ("qwen3", "dr_grpo"), ("qwen3", "gspo"), ("qwen3", "cispo"), ("llama3", "dapo")])
def test_packed_logprobs_loss_and_gradients_are_the_padded_ones(models: dict[str, nn.Module], family: str,
                                                                loss: str, groups: tuple[int, ...] | None) -> None:
    model = models[family]
    padded_batch, packed_batch = (_with_reference_and_pi_old(model, packing=p, groups=groups) for p in (False, True))
    responses = _response_targets(padded_batch)
    assert torch.equal(responses, padded_batch.response_mask)
    for name in ("ref_logprobs", "old_logprobs"):
        padded, packed = getattr(padded_batch, name), getattr(packed_batch, name)
        assert torch.allclose(padded[responses], packed[responses], atol=1e-5) and (packed[~responses] == 0).all(), name
    with torch.no_grad():
        padded_lp, padded_entropy, padded_positions, _ = micro_batch_logprobs(model, padded_batch, temperature=0.8,
                                                                              packing=False)
        packed_lp, packed_entropy, packed_positions, _ = micro_batch_logprobs(model, packed_batch, temperature=0.8,
                                                                              packing=True)
    assert torch.allclose(padded_lp[responses], packed_lp[responses], atol=1e-5)
    assert torch.allclose(padded_entropy[responses], packed_entropy[responses], atol=1e-5)
    assert packed_positions < padded_positions

    # KL in the loss, an entropy bonus, dual clip (on by default) and the rollout correction's pi_old and weights
    grpo = GrpoConfig(loss=loss, kl_coef=0.1, entropy_coef=0.01, rollout_correction=RolloutCorrection(threshold=1.5))
    padded_loss, padded_parts, padded_grads = _step(model, padded_batch, grpo)
    packed_loss, packed_parts, packed_grads = _step(model, packed_batch, grpo.model_copy(update={"packing": True}))
    assert packed_loss == pytest.approx(padded_loss, abs=1e-5) and abs(padded_loss) > 1e-4
    assert padded_grads.keys() == packed_grads.keys() and len(padded_grads) == len(list(model.parameters()))
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0 and torch.allclose(packed_grads[name], grad, atol=1e-5), name
    padded_metrics, packed_metrics = update_metrics(padded_parts), update_metrics(packed_parts)
    for key in ("ratio/mean", "clip_fraction", "kl", "entropy", "mismatch/is_weight_mean"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], abs=1e-5), key


def test_padding_share_of_the_update_in_either_layout(models: dict[str, nn.Module]) -> None:
    batch = _batch()
    real = int(batch.lengths.sum())
    shares = {}
    for packing in (False, True):
        _, parts, _ = _step(models["qwen3"], batch, GrpoConfig(packing=packing))
        metrics = update_metrics(parts)
        positions = metrics["data/forward_positions"]
        assert metrics["data/padding_share"] == pytest.approx((positions - real) / positions)
        shares[packing] = metrics["data/padding_share"]
    assert shares[False] == pytest.approx(1 - real / batch.inputs.numel())  # every row as wide as the longest
    assert 0.0 <= shares[True] < shares[False]


def test_the_shared_prompt_share_counts_the_positions_a_groups_prompt_spared(models: dict[str, nn.Module]) -> None:
    batch = _grouped_batch()
    _, parts, _ = _step(models["qwen3"], batch, GrpoConfig(packing=True), micro_batch_size=8)
    metrics = update_metrics(parts)
    # each group after its first sample repeats the prompt's positions; those are the ones the forward did not run
    firsts = [sum(GROUPS[:i]) for i in range(len(GROUPS))]
    spared = sum(PROMPT_LENGTHS[first] * (size - 1) for first, size in zip(firsts, GROUPS))
    assert metrics["data/shared_prompt_share"] == pytest.approx(spared / int(batch.lengths.sum()))
    assert metrics["data/forward_positions"] * (1 - metrics["data/padding_share"]) == pytest.approx(
        int(batch.lengths.sum()) - spared)


def test_two_ranks_of_a_packed_batch_sum_to_one_process(models: dict[str, nn.Module]) -> None:
    """A rank's share is whole samples: each rank packs its own micro-batches, and the summed gradients are the
    single process's (packed or padded)."""
    model, batch = models["qwen3"], _batch()
    grpo = GrpoConfig(packing=True)
    _, _, whole = _step(model, batch, grpo, micro_batch_size=2)
    _, _, padded = _step(model, batch, GrpoConfig(), micro_batch_size=2)
    _, first_parts, first = _step(model, batch, grpo, share=RankShare(rank=0, world=2), micro_batch_size=2)
    _, second_parts, second = _step(model, batch, grpo, share=RankShare(rank=1, world=2), micro_batch_size=2)
    assert len(first_parts) == len(second_parts) == 2
    for name, grad in whole.items():
        assert grad.abs().max() > 0 and torch.allclose(first[name] + second[name], grad, atol=1e-5), name
        assert torch.allclose(padded[name], grad, atol=1e-5), name


def test_a_sharded_model_trains_on_packed_rows_and_its_zero_weighted_passes_add_nothing(tiny_qwen3: Path,
                                                                                         tmp_path: Path) -> None:
    """FSDP (one rank here): the unfused head's path takes the packed rows' positions and mask, and passes beyond a
    rank's rows (a zero-weighted pass on a padded filler row) leave its gradients as they are."""
    batch, grpo = _batch(), GrpoConfig(packing=True)
    _, _, expected = _step(load_pretrained(tiny_qwen3).model.train(), batch, grpo)
    model = load_pretrained(tiny_qwen3).model.train()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_model(model, mixed_precision="off")
        accumulate_gradients(model, batch, grpo=grpo, temperature=0.8, micro_batch_size=3, passes=5,
                             filler=batch.rows(0, 1), normalizer=loss_normalizer(batch, grpo.aggregation), sync=True)
        for name, param in model.named_parameters():
            assert torch.allclose(param.grad.full_tensor(), expected[name], atol=1e-5), name
    finally:
        dist.destroy_process_group()


def test_a_packed_grpo_run_records_its_padding_share_and_matches_the_padded_loss(sft_warm_start: tuple[Path, float],
                                                                                make_config) -> None:
    folder, _ = sft_warm_start
    runs = {}
    for packing in (False, True):
        sink = MemorySink()
        config = make_config("grpo", folder, *ARITHMETIC, "trainer.steps=2", "trainer.batch_size=4",
                             "trainer.micro_batch_size=4", "grpo.group_size=4", "eval.every_steps=0",
                             f"grpo.packing={str(packing).lower()}")
        runs[packing] = (train_grpo(config, Recorder([sink])), sink)
    (padded, padded_sink), (packed, packed_sink) = runs[False], runs[True]
    assert packed.losses[0] == pytest.approx(padded.losses[0], abs=1e-5)
    for sink in (padded_sink, packed_sink):
        assert len(sink.series("data/padding_share")) == 2 and 0.0 <= sink.last("data/padding_share") < 1.0
    first = {packing: dict(sink.series("data/padding_share"))[1] for packing, (_, sink) in runs.items()}
    assert first[True] <= first[False] and first[False] > 0.0  # the same first batch, packed or padded
    assert dict(packed_sink.series("data/train_tokens"))[1] == dict(padded_sink.series("data/train_tokens"))[1]
    # groups of 4 share their prompt: the forwards ran well under the samples' own positions
    assert padded_sink.last("data/shared_prompt_share") == 0.0 and packed_sink.last("data/shared_prompt_share") > 0.2
