"""A trainer rank's weight outbox in a proc of its own, for the inbox tests (an actor class Monarch can import)."""

from __future__ import annotations

import os
from typing import Any

import torch
from monarch.actor import Actor, endpoint


def seeded_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(2560, 1024, generator=g), "norm": torch.randn(1024, generator=g).to(torch.bfloat16),
            "steps": torch.tensor(seed)}


class StagingRank(Actor):
    """A trainer rank's outbox in its own proc, staging a seeded state."""

    def __init__(self) -> None:
        from workers.engine.actors.weight_outbox import WeightOutbox

        self.outbox = WeightOutbox()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def stage(self, seed: int) -> Any:
        return self.outbox.stage(seeded_state(seed), rank=0, world=1, sharded=False, reuse=True)
