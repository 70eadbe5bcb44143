from __future__ import annotations

from typing import Any

from monarch.actor import Actor, endpoint

from workers.engine.replay_buffer import ReplayBuffer, RolloutBatchRecord


class ReplayBufferActor(Actor):
    def __init__(self, capacity: int, max_policy_age: int):
        self.buffer = ReplayBuffer(capacity=capacity, max_policy_age=max_policy_age)

    @endpoint
    def put(self, record: RolloutBatchRecord) -> int:
        self.buffer.put(record)
        return len(self.buffer)

    @endpoint
    def take(self, current_version: int) -> tuple[RolloutBatchRecord | None, dict[str, int]]:
        """(the oldest batch within the age bound, None when there is none; the stats after taking it)."""
        return self.buffer.take(current_version), self.counts()

    @endpoint
    def stats(self) -> dict[str, int]:
        return self.counts()

    def counts(self) -> dict[str, int]:
        return {"batches": len(self.buffer), "rollouts": self.buffer.rollouts,
                "dropped_stale": self.buffer.dropped_stale, "evicted": self.buffer.evicted}

    @endpoint
    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    @endpoint
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)
