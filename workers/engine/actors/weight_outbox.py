"""The trainer ranks' side of a weight sync: every rank stages its part of the policy (`weight_parts.py`) in one
flat buffer, registered with Monarch's RDMA as a few chunks (ibverbs where the hosts have it, its TCP transport where
not), and each generator's inbox reads every rank's part itself, all chunks at once (`weight_inbox.py`).

The bytes go from the ranks' memory to the generators' without passing through the controller, without a rank
sending the model once per replica, and without waiting on the trainer actor: a read is served by the proc's RDMA
manager while the rank trains. A rank's cost on the step's path is one copy of its part.

Every staging is a numbered publication. The controller waits for every inbox's read of a publication before it asks
for the next (`controller/trainer.py`'s `PendingFetches`), so a rank stages the next one into the same registered
memory (a fresh allocation's page faults cost more than the copy); only after a read that did not end (a failed or
hung replica, which might still be reading) does it stage into new memory.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.weight_parts import PartLayout, assemble, copy_into, part_layout, staging_memory

CHUNK_BYTES = 4 << 20  # a part is registered as chunks of at least this, read side by side: over Monarch's TCP
MAX_CHUNKS = 32        # transport 16 reads of 4 MiB took half as long as one of 60 MiB


def chunk_bounds(nbytes: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of a part of `nbytes`."""
    size = max(CHUNK_BYTES, -(-nbytes // MAX_CHUNKS))
    return [(start, min(nbytes, start + size)) for start in range(0, nbytes, size)]


@dataclass(frozen=True)
class WeightPart:
    """What an inbox needs to read one rank's part: its RDMA handles and layout."""

    buffers: tuple[Any, ...]  # a monarch.rdma.RDMABuffer over each of `chunk_bounds(layout.nbytes)`
    layout: PartLayout


@dataclass(frozen=True)
class WeightPublication:
    """A policy version as numbered publication: one part per rank that serves some of it, and how long a reader waits
    for the parts (the run's `failover.weight_read_s`: ranks stopped or dead never answer)."""

    number: int
    version: int
    parts: tuple[WeightPart, ...]
    read_timeout_s: float

    @property
    def nbytes(self) -> int:
        return sum(part.layout.nbytes for part in self.parts)


def rdma_buffers(flat: torch.Tensor) -> tuple[Any, ...]:
    from monarch.rdma import RDMABuffer

    with warnings.catch_warnings():  # on hosts without ibverbs Monarch warns once per buffer that it uses TCP
        warnings.simplefilter("ignore")
        return tuple(RDMABuffer(flat[start:end]) for start, end in chunk_bounds(flat.numel()))


class WeightOutbox:
    """A trainer rank's staged part: its layout, flat bytes and RDMA buffers."""

    def __init__(self) -> None:
        self.staged: tuple[PartLayout, torch.Tensor, tuple[Any, ...]] | None = None

    def stage(self, state: dict[str, torch.Tensor], *, rank: int, world: int, sharded: bool, reuse: bool,
              dtype: torch.dtype | None = None) -> WeightPart | None:
        """Stage this rank's part of `state` (floating-point tensors in `dtype` when given) in place of the one staged
        before (into its memory when `reuse` and the layout is the same); None when this rank serves no part."""
        planned = part_layout(state, rank=rank, world=world, sharded=sharded, dtype=dtype)
        if planned is None:
            self.drop()
            return None
        layout, tensors = planned
        if not (reuse and self.staged is not None and self.staged[0] == layout):
            self.drop()
            flat = staging_memory(layout, tensors)
            self.staged = (layout, flat, rdma_buffers(flat))
        _, flat, buffers = self.staged
        copy_into(flat, layout, tensors)
        return WeightPart(buffers=buffers, layout=layout)

    def drop(self) -> None:
        if self.staged is None:
            return
        _, _, buffers = self.staged
        self.staged = None
        try:
            for dropped in [buffer.drop() for buffer in buffers]:
                dropped.get(timeout=10)
        except Exception:  # noqa: BLE001 - the registrations are freed with the proc anyway
            pass


def start_reads(publication: WeightPublication) -> tuple[list[tuple[torch.Tensor, PartLayout]], list[Any]]:
    """Every chunk of every part of `publication` read at once: (each part's memory and layout, the reads' futures)."""
    received, reads = [], []
    timeout = max(1, int(publication.read_timeout_s))  # whole seconds, Monarch's unit
    for part in publication.parts:
        flat = torch.empty(part.layout.nbytes, dtype=torch.uint8)
        received.append((flat, part.layout))
        for (first, end), buffer in zip(chunk_bounds(part.layout.nbytes), part.buffers, strict=True):
            reads.append(buffer.read_into(flat[first:end], timeout=timeout))
    return received, reads


def read_publication(publication: WeightPublication) -> tuple[dict[str, torch.Tensor], float]:
    """Read `publication` and assemble its state dict; the seconds the reads took."""
    start = time.perf_counter()
    received, reads = start_reads(publication)
    for read in reads:
        read.get()
    return assemble(received), time.perf_counter() - start


async def read_publication_async(publication: WeightPublication) -> tuple[dict[str, torch.Tensor], float]:
    """`read_publication` on an actor's event loop, which serves other messages while the reads run."""
    start = time.perf_counter()
    received, reads = start_reads(publication)
    for read in reads:
        await read
    return assemble(received), time.perf_counter() - start
