"""The trainer ranks' side of a weight sync: every rank stages its part of the policy (`weight_parts.py`) in one
flat buffer registered with Monarch's RDMA (ibverbs where the hosts have it, its TCP transport where not), and each
generator's inbox reads every rank's part itself (`weight_inbox.py`).

The bytes go from the ranks' memory to the generators' without passing through the controller, without a rank
sending the model once per replica, and without waiting on the trainer actor: a read is served by the proc's RDMA
manager while the rank trains. A rank's cost on the step's path is one copy of its part.

Every staging is a numbered publication. A rank keeps its buffer until it stages the next: the controller waits for
every inbox's read of a publication before it asks for the next (`controller/trainer.py`'s `PendingFetches`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.weight_parts import PartLayout, assemble, stage_part

MIN_READ_BYTES_PER_S = 20e6  # a read slower than this gives up (Monarch's TCP transport moved 0.2-0.4 GB/s here)
MIN_READ_TIMEOUT_S = 60


@dataclass(frozen=True)
class WeightPart:
    """What an inbox needs to read one rank's part: its RDMA handle and layout."""

    buffer: Any  # monarch.rdma.RDMABuffer over the rank's staged bytes
    layout: PartLayout


@dataclass(frozen=True)
class WeightPublication:
    """A policy version as numbered publication: one part per rank that serves some of it."""

    number: int
    version: int
    parts: tuple[WeightPart, ...]

    @property
    def nbytes(self) -> int:
        return sum(part.layout.nbytes for part in self.parts)


def read_timeout_s(nbytes: int) -> int:
    return max(MIN_READ_TIMEOUT_S, int(nbytes / MIN_READ_BYTES_PER_S))


def rdma_buffer(flat: torch.Tensor) -> Any:
    from monarch.rdma import RDMABuffer

    with warnings.catch_warnings():  # on hosts without ibverbs Monarch warns once per buffer that it uses TCP
        warnings.simplefilter("ignore")
        return RDMABuffer(flat)


class WeightOutbox:
    """A trainer rank's staged publication: its number, flat bytes and RDMA buffer."""

    def __init__(self) -> None:
        self.staged: tuple[int, torch.Tensor, Any] | None = None

    def stage(self, state: dict[str, torch.Tensor], *, publication: int, rank: int, world: int,
              sharded: bool) -> WeightPart | None:
        """Stage this rank's part of `state` as `publication` in place of the one staged before; None when this rank
        serves no part."""
        self.drop()
        staged = stage_part(state, rank=rank, world=world, sharded=sharded)
        if staged is None:
            return None
        flat, layout = staged
        buffer = rdma_buffer(flat)
        self.staged = (publication, flat, buffer)
        return WeightPart(buffer=buffer, layout=layout)

    def drop(self) -> None:
        if self.staged is None:
            return
        _, _, buffer = self.staged
        self.staged = None
        try:
            buffer.drop().get(timeout=10)
        except Exception:  # noqa: BLE001 - the registration is freed with the proc anyway
            pass


def read_publication(publication: WeightPublication) -> tuple[dict[str, torch.Tensor], float]:
    """Read every part of `publication` (all reads in flight at once) and assemble its state dict; the seconds
    the reads took."""
    start = time.perf_counter()
    reads = []
    for part in publication.parts:
        flat = torch.empty(part.layout.nbytes, dtype=torch.uint8)
        reads.append((flat, part, part.buffer.read_into(flat, timeout=read_timeout_s(part.layout.nbytes))))
    for _, _, read in reads:
        read.get()
    seconds = time.perf_counter() - start
    return assemble([(flat, part.layout) for flat, part, _ in reads]), seconds
