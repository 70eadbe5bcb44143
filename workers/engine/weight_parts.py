"""A policy's weights as parts, one per trainer rank, each one flat byte buffer a generator reads whole.

Every rank serves a part, so no rank sends the whole model and none gathers it first:
- a sharded (FSDP) rank serves its own shard of every tensor (dim-0 rows, in rank order: the full tensor is the
  pieces concatenated along dim 0);
- a replicated rank serves a share of the whole tensors (the same balanced split on every rank, by bytes).
A tied weight (a Qwen3's LM head is its embedding) travels once: its second name is a piece with no bytes.

`part_layout` places a rank's pieces in its part and `copy_into` writes them there (`actors/weight_outbox.py` keeps
one part's memory, registered for RDMA reads, from one publication to the next; `stage_part` does both into new
memory); `assemble` turns the parts a generator read back into a state dict under the unsharded names. Pure torch:
the trainer's side, the generator's side and the GPU benchmark share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

ALIGN = 64  # every piece starts at a multiple of this, so its bytes view as any dtype


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes in a part: all of it, or (`rows_of` set) this rank's dim-0 rows of a sharded tensor."""

    name: str
    index: int  # its place in the trainer's state dict
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]  # the piece's own shape
    offset: int  # bytes from the part's start
    nbytes: int
    rows_of: tuple[int, ...] | None = None  # sharded: the full tensor's shape
    same_as: str | None = None  # a tied weight: the earlier piece whose tensor this is (it has no bytes of its own)


@dataclass(frozen=True)
class PartLayout:
    rank: int
    nbytes: int
    pieces: tuple[Piece, ...]


def balanced_owners(sizes: dict[str, int], *, ranks: int) -> dict[str, int]:
    """Which replicated rank serves each whole tensor: largest first, each to the rank with the fewest bytes so far
    (ties to the lower rank), so every rank computes the same split from the same model."""
    load = [0] * ranks
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


def _local_piece(tensor: torch.Tensor, *, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...] | None]:
    """(the bytes this rank serves of a sharded model's `tensor`, the full shape when they are dim-0 rows of it); None:
    rank 0 serves it whole (a buffer every rank holds, a DTensor not sharded on dim 0 over one mesh dimension)."""
    if not isinstance(tensor, DTensor):
        return (tensor if rank == 0 else None), None
    if len(tensor.placements) == 1 and tensor.placements[0] == Shard(0):
        return tensor.to_local(), tuple(tensor.shape)
    full = tensor.full_tensor()  # a collective: every rank takes part in the same order
    return (full, None) if rank == 0 else (None, None)


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name whose tensor it is, for the tied weights in `state` (a state dict holds a tied
    parameter under each of its names)."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, tensor in state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            continue
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(),
               local.dtype)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def rank_pieces(state: dict[str, torch.Tensor], *, rank: int, world: int, sharded: bool,
                tied: dict[str, str]) -> list[tuple[int, str, torch.Tensor, tuple[int, ...] | None]]:
    """(index, name, tensor, full shape if sharded rows) of what `rank` serves, in the state dict's order; a tied name
    (`tied_names`) is served by the rank that serves the name it is tied to."""
    if sharded:
        local = {name: _local_piece(tensor, rank=rank) for name, tensor in state.items() if name not in tied}
        served = []
        for index, name in enumerate(state):
            piece, rows_of = local[tied.get(name, name)]
            if piece is not None:
                served.append((index, name, piece, rows_of))
        return served
    owners = balanced_owners({name: t.numel() * t.element_size() for name, t in state.items() if name not in tied},
                             ranks=world)
    return [(index, name, tensor, None) for index, (name, tensor) in enumerate(state.items())
            if owners[tied.get(name, name)] == rank]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def part_layout(state: dict[str, torch.Tensor], *, rank: int, world: int, sharded: bool,
                dtype: torch.dtype | None = None) -> tuple[PartLayout, list[torch.Tensor]] | None:
    """Where this rank's pieces go in its part, and the tensors they hold; None when it serves none. `dtype`: the
    floating-point tensors are served in it (the generators' weight dtype: a float32 trainer in mixed precision
    serves bfloat16, half the bytes); None: as they are."""
    tied = tied_names(state)
    served = rank_pieces(state, rank=rank, world=world, sharded=sharded, tied=tied)
    if not served:
        return None
    pieces, offset = [], 0
    placed: dict[str, Piece] = {}
    for index, name, tensor, rows_of in served:
        if name in tied:
            original = placed[tied[name]]
            pieces.append(Piece(name=name, index=index, dtype=original.dtype, shape=original.shape,
                                offset=original.offset, nbytes=0, rows_of=rows_of, same_as=original.name))
            continue
        served_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * served_dtype.itemsize
        placed[name] = Piece(name=name, index=index, dtype=str(served_dtype).removeprefix("torch."),
                             shape=tuple(tensor.shape), offset=offset, nbytes=nbytes, rows_of=rows_of)
        pieces.append(placed[name])
        offset = _aligned(offset + nbytes)
    return PartLayout(rank=rank, nbytes=max(offset, 1), pieces=tuple(pieces)), [tensor for _, _, tensor, _ in served]


def copy_into(flat: torch.Tensor, layout: PartLayout, tensors: list[torch.Tensor]) -> None:
    """Write the tensors where `layout` puts them in `flat` (a uint8 CPU tensor of `layout.nbytes`), cast to each
    piece's dtype on the way."""
    with torch.no_grad():
        for piece, tensor in zip(layout.pieces, tensors, strict=True):
            if piece.nbytes:
                piece_tensor(flat, piece).copy_(tensor.detach().reshape(piece.shape))


def staging_memory(layout: PartLayout, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A part's flat bytes on the host: pinned when the weights are on a GPU, so the copy out of it runs at the
    link's speed."""
    pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
    return torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin)


def stage_part(state: dict[str, torch.Tensor], *, rank: int, world: int, sharded: bool,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, PartLayout] | None:
    """This rank's part in new memory: one flat uint8 CPU tensor holding its pieces (floating-point ones in `dtype`
    when given), and their layout; None when it serves none."""
    planned = part_layout(state, rank=rank, world=world, sharded=sharded, dtype=dtype)
    if planned is None:
        return None
    layout, tensors = planned
    flat = staging_memory(layout, tensors)
    copy_into(flat, layout, tensors)
    return flat, layout


def piece_tensor(flat: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's tensor, a view into the part's bytes."""
    dtype = getattr(torch, piece.dtype)
    return flat[piece.offset:piece.offset + piece.nbytes].view(dtype).view(piece.shape)


def assemble(parts: list[tuple[torch.Tensor, PartLayout]]) -> dict[str, torch.Tensor]:
    """The state dict the parts make, in the trainer's order: a sharded tensor is its rows from every rank, in rank
    order; a tied name the very tensor of the name it is tied to. ValueError when a sharded tensor's rows do not add
    up to its full shape."""
    whole: dict[str, torch.Tensor] = {}
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    full_shapes: dict[str, tuple[int, ...]] = {}
    index: dict[str, int] = {}
    tied: dict[str, str] = {}
    for flat, layout in parts:
        for piece in layout.pieces:
            index[piece.name] = piece.index
            if piece.same_as is not None:
                tied[piece.name] = piece.same_as
            elif piece.rows_of is None:
                whole[piece.name] = piece_tensor(flat, piece)
            else:
                rows.setdefault(piece.name, []).append((layout.rank, piece_tensor(flat, piece)))
                full_shapes[piece.name] = piece.rows_of
    for name, pieces in rows.items():
        tensor = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=0)
        if tuple(tensor.shape) != full_shapes[name]:
            raise ValueError(f"the parts hold {tuple(tensor.shape)} of {name}, whose full shape is "
                             f"{full_shapes[name]}: a rank's part is missing")
        whole[name] = tensor
    for name, original in tied.items():
        whole[name] = whole[original]
    return {name: whole[name] for name in sorted(whole, key=index.__getitem__)}
