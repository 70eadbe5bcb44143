"""The trainer's own weights at the policy versions a buffered batch may still come from.

A rollout correction compares the generator's log-probs (mu) with the trainer's under the same weights (pi_old).
In async mode the trainer has moved on by the batch's policy age, so pi_old is computed with the weights it had
at the batch's version, kept here: max_policy_age + 1 copies of the parameters on their own device (the
current version's too, for the batches still to come from it). Only async runs with grpo.rollout_correction
keep any.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from workers.engine.sharding import reshard


class BehaviourWeights:
    def __init__(self, *, max_policy_age: int):
        self.max_policy_age = max_policy_age
        self._saved: dict[int, list[torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._saved)

    @torch.no_grad()
    def record(self, model: nn.Module, *, version: int) -> None:
        """Keep the weights of `version` (the model's now), dropping versions no batch can still come from."""
        if self.max_policy_age == 0:
            return
        self._saved[version] = [p.detach().clone() for p in model.parameters()]
        for old in [v for v in self._saved if v < version - self.max_policy_age]:
            del self._saved[old]

    def has(self, version: int) -> bool:
        return version in self._saved

    @contextmanager
    def weights_of(self, model: nn.Module, *, version: int) -> Iterator[None]:
        """The model holds `version`'s weights inside the block and its own again after it (also on an error)."""
        saved = self._saved.get(version)
        if saved is None:
            raise KeyError(f"no weights kept for policy version {version}")
        params = list(model.parameters())
        with torch.no_grad():
            reshard(model)  # FSDP: a gathered copy from an earlier forward would not see the shards change
            current = [p.detach().clone() for p in params]
            for param, value in zip(params, saved):
                param.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                reshard(model)
                for param, value in zip(params, current):
                    param.copy_(value)
