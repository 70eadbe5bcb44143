"""Scored rollout batches waiting for the trainer, tagged with the policy version that made them.

`take(current_version)` hands out the oldest batch whose policy age (current version minus
the version that generated it) is within `max_policy_age`, and drops older ones: the
bound holds however far the generator runs ahead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RolloutBatchRecord:
    """One training step's rollouts: batch_size prompts x group_size completions, group after group."""

    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]  # generator's tempered log-prob of each response token
    rewards: list[float]
    advantages: list[float]
    policy_version: int
    prompt_texts: list[str]
    response_texts: list[str]
    reward_parts: dict[str, list[float]]
    sample_ids: list[str] = field(default_factory=list)  # one per prompt (group), as the dataset handed them out
    truncated: list[bool] = field(default_factory=list)  # per completion: cut off at generator.max_new_tokens

    def __len__(self) -> int:
        return len(self.prompts)


def concat_records(records: list[RolloutBatchRecord]) -> RolloutBatchRecord:
    """One step's record from its chunks (pipelined mode), in order; they share one policy version."""
    versions = {r.policy_version for r in records}
    if len(versions) != 1:
        raise ValueError(f"chunks of one step come from policy versions {sorted(versions)}")
    return RolloutBatchRecord(
        prompts=[p for r in records for p in r.prompts], responses=[x for r in records for x in r.responses],
        logprobs=[x for r in records for x in r.logprobs], rewards=[x for r in records for x in r.rewards],
        advantages=[x for r in records for x in r.advantages], policy_version=versions.pop(),
        prompt_texts=[x for r in records for x in r.prompt_texts], response_texts=[x for r in records for x in r.response_texts],
        reward_parts={key: [x for r in records for x in r.reward_parts[key]] for key in records[0].reward_parts},
        sample_ids=[x for r in records for x in r.sample_ids], truncated=[x for r in records for x in r.truncated],
    )


class ReplayBuffer:
    def __init__(self, *, capacity: int, max_policy_age: int):
        self.capacity = capacity  # rollouts (sequences), not batches
        self.max_policy_age = max_policy_age
        self._batches: deque[RolloutBatchRecord] = deque()
        self.dropped_stale = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def rollouts(self) -> int:
        return sum(len(b) for b in self._batches)

    def put(self, batch: RolloutBatchRecord) -> None:
        self._batches.append(batch)
        while self.rollouts > self.capacity and len(self._batches) > 1:
            self._batches.popleft()
            self.evicted += 1

    def take(self, current_version: int) -> RolloutBatchRecord | None:
        while self._batches:
            batch = self._batches.popleft()
            if current_version - batch.policy_version <= self.max_policy_age:
                return batch
            self.dropped_stale += 1
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"batches": [asdict(b) for b in self._batches], "dropped_stale": self.dropped_stale, "evicted": self.evicted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._batches = deque(RolloutBatchRecord(**b) for b in state["batches"])
        self.dropped_stale = state["dropped_stale"]
        self.evicted = state["evicted"]
