"""A policy split into one part per trainer rank and put back together by a generator (`weight_parts.py`)."""

from __future__ import annotations

import pytest
import torch

from workers.engine.weight_parts import ALIGN, PartLayout, Piece, assemble, balanced_owners, stage_part


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(10, 4, generator=g), "layer.w": torch.randn(4, 4, generator=g),
            "layer.b": torch.randn(4, generator=g).to(torch.bfloat16), "norm": torch.ones(4),
            "steps": torch.tensor(3, dtype=torch.int64), "head": torch.randn(6, 4, generator=g)}


def test_replicated_ranks_split_whole_tensors_by_bytes_the_same_way_on_every_rank() -> None:
    # 40, 24 and 16 bytes: the largest to rank 0, then each to the lighter rank (ties to the lower one)
    assert balanced_owners({"a": 40, "b": 24, "c": 16}, ranks=2) == {"a": 0, "b": 1, "c": 1}
    assert balanced_owners({"a": 40, "b": 24, "c": 16}, ranks=4) == {"a": 0, "b": 1, "c": 2}
    assert balanced_owners({"b": 24, "a": 40, "c": 16}, ranks=2) == {"a": 0, "b": 1, "c": 1}, "not by dict order"


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_parts_of_replicated_ranks_make_the_state_dict_exactly(world: int) -> None:
    state = _state()
    staged = [stage_part(state, rank=rank, world=world, sharded=False) for rank in range(world)]
    parts = [part for part in staged if part is not None]
    assert len(parts) == min(world, len(state)), "a rank with no tensor to serve stages nothing"
    names = [piece.name for _, layout in parts for piece in layout.pieces]
    assert sorted(names) == sorted(state), "every tensor in exactly one part"
    rebuilt = assemble(parts)
    assert list(rebuilt) == list(state), "in the trainer's order"
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name], tensor), name
    for _, layout in parts:
        assert all(piece.offset % ALIGN == 0 for piece in layout.pieces)
    if world == 2:
        sizes = [sum(p.nbytes for p in layout.pieces) for _, layout in parts]
        assert max(sizes) - min(sizes) <= 160, sizes  # the 160-byte embedding is the largest tensor


@pytest.mark.parametrize("world", [1, 2])
def test_a_mixed_precision_trainer_serves_its_floats_in_the_generators_bf16(world: int) -> None:
    """trainer.mixed_precision: float32 weights staged as bfloat16 (half the bytes to read), the same values a bf16
    generator would round them to on load; an integer buffer stays as it is."""
    state = _state()
    parts = [p for p in (stage_part(state, rank=r, world=world, sharded=False, dtype=torch.bfloat16)
                         for r in range(world)) if p is not None]
    rebuilt = assemble(parts)
    assert list(rebuilt) == list(state)
    for name, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert rebuilt[name].dtype == expected.dtype and torch.equal(rebuilt[name], expected), name
    as_is = [p for p in (stage_part(state, rank=r, world=world, sharded=False) for r in range(world)) if p is not None]
    served = sum(piece.nbytes for _, layout in parts for piece in layout.pieces)
    whole = sum(piece.nbytes for _, layout in as_is for piece in layout.pieces)
    assert served == whole - sum(t.numel() * 2 for t in state.values() if t.dtype == torch.float32)


def test_sharded_rows_from_every_rank_concatenate_in_rank_order_even_when_uneven() -> None:
    """FSDP's dim-0 chunks of a 10-row tensor over 3 ranks: 4, 4 and 2 rows; the parts may arrive in any order."""
    full = torch.randn(10, 4)
    chunks = torch.chunk(full, 3)
    parts = []
    for rank, rows in enumerate(chunks):
        flat = rows.contiguous().view(-1).view(torch.uint8).clone()
        piece = Piece(name="w", index=0, dtype="float32", shape=tuple(rows.shape), offset=0, nbytes=flat.numel(),
                      rows_of=(10, 4))
        parts.append((flat, PartLayout(rank=rank, nbytes=flat.numel(), pieces=(piece,))))
    assert torch.equal(assemble(parts[::-1])["w"], full)
    with pytest.raises(ValueError, match=r"the parts hold \(6, 4\) of w, whose full shape is \(10, 4\)"):
        assemble(parts[:1] + parts[2:])


def test_a_part_is_one_copy_later_updates_do_not_reach() -> None:
    state = _state()
    flat, layout = stage_part(state, rank=0, world=1, sharded=False)
    state["embed"].add_(1.0)
    assert not torch.equal(assemble([(flat, layout)])["embed"], state["embed"])


def test_a_part_is_read_in_chunks_that_cover_it_exactly() -> None:
    from workers.engine.actors.weight_outbox import CHUNK_BYTES, MAX_CHUNKS, chunk_bounds

    assert chunk_bounds(100) == [(0, 100)]
    assert chunk_bounds(10 * 2**20) == [(0, CHUNK_BYTES), (CHUNK_BYTES, 2 * CHUNK_BYTES), (2 * CHUNK_BYTES, 10 * 2**20)]
    big = 2**30 + 5
    bounds = chunk_bounds(big)
    assert len(bounds) == MAX_CHUNKS and bounds[0][0] == 0 and bounds[-1][1] == big
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))


def test_a_sharded_models_plain_tensors_are_served_by_rank_0_alone() -> None:
    """A sharded model's state dict holds DTensors and the buffers every rank keeps whole (not DTensors)."""
    state = {"steps": torch.tensor(3), "norm": torch.ones(4)}
    assert stage_part(state, rank=1, world=2, sharded=True) is None
    flat, layout = stage_part(state, rank=0, world=2, sharded=True)
    assert [p.rows_of for p in layout.pieces] == [None, None]
    assert torch.equal(assemble([(flat, layout)])["norm"], state["norm"])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_tied_weight_travels_once_and_comes_back_under_both_names(world: int) -> None:
    """A state dict holds a tied parameter under each name (a Qwen3's embedding and LM head): the parts carry its
    bytes once, and the generator's state dict has both names, one tensor, the trainer's order."""
    embed = torch.nn.Parameter(torch.randn(10, 4))
    state = {"embed": embed.detach(), "layer.w": torch.randn(4, 4), "norm": torch.ones(4), "head": embed.detach()}
    parts = [p for p in (stage_part(state, rank=r, world=world, sharded=False, dtype=torch.bfloat16)
                         for r in range(world)) if p is not None]
    pieces = {piece.name: (layout.rank, piece) for _, layout in parts for piece in layout.pieces}
    assert pieces["head"][1].same_as == "embed" and pieces["head"][1].nbytes == 0
    assert pieces["head"][0] == pieces["embed"][0], "served by the rank that serves what it is tied to"
    assert sum(piece.nbytes for _, piece in pieces.values()) == (40 + 16 + 4) * 2  # bf16, the embedding once
    rebuilt = assemble(parts)
    assert list(rebuilt) == list(state)
    assert rebuilt["head"] is rebuilt["embed"] and torch.equal(rebuilt["embed"], embed.detach().to(torch.bfloat16))
    untied = {**state, "head": embed.detach().clone()}  # equal values, its own memory: sent as itself
    layout = stage_part(untied, rank=0, world=1, sharded=False)[1]
    assert all(piece.same_as is None for piece in layout.pieces) and layout.pieces[-1].nbytes == 160
