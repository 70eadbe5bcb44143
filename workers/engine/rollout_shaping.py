"""DAPO's rollout shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
the soft overlong punishment (eq. 13) and dynamic sampling (groups whose rewards are all equal are dropped and the
batch refilled from more prompts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from workers.engine.replay_buffer import RolloutBatchRecord, concat_records

T = TypeVar("T")


def overlong_penalty(length: int, *, max_new_tokens: int, penalty_tokens: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `factor`: 0 up to max_new_tokens -
    penalty_tokens, then falling linearly to -factor at max_new_tokens (a cut-off response), -factor beyond."""
    expected = max_new_tokens - penalty_tokens
    if length <= expected:
        return 0.0
    if length <= max_new_tokens:
        return (expected - length) / penalty_tokens * factor
    return -factor


def groups_with_spread(record: RolloutBatchRecord, *, group_size: int) -> list[bool]:
    """Per group (group_size consecutive rows): whether its rewards differ, i.e. its advantages are not all zero."""
    rewards = record.rewards
    return [max(rewards[start: start + group_size]) > min(rewards[start: start + group_size])
            for start in range(0, len(rewards), group_size)]


def select_groups(record: RolloutBatchRecord, groups: list[int], *, group_size: int) -> RolloutBatchRecord:
    """The record of the chosen groups (indices into the record's groups, in the order given)."""
    rows = [g * group_size + i for g in groups for i in range(group_size)]
    pick = partial(_at, rows)
    return RolloutBatchRecord(
        prompts=pick(record.prompts), responses=pick(record.responses), logprobs=pick(record.logprobs),
        rewards=pick(record.rewards), advantages=pick(record.advantages), policy_version=record.policy_version,
        prompt_texts=pick(record.prompt_texts), response_texts=pick(record.response_texts),
        reward_parts={name: pick(values) for name, values in record.reward_parts.items()},
        sample_ids=[record.sample_ids[g] for g in groups] if record.sample_ids else [],
        truncated=pick(record.truncated) if record.truncated else [],
    )


def _at(rows: list[int], values: list[T]) -> list[T]:
    return [values[r] for r in rows]


@dataclass
class BatchFilling:
    """One buffered batch being filled over generation rounds (DAPO's dynamic sampling): each round's groups with a
    reward spread are kept until `batch_size` groups are, or `max_rounds` rounds are done. `max_rounds` None: no
    filtering, the first round is the batch."""

    batch_size: int  # groups
    group_size: int
    max_rounds: int | None
    rounds: int = 0
    dropped: int = 0  # zero-spread groups discarded
    _kept: list[RolloutBatchRecord] = field(default_factory=list)
    _kept_groups: int = 0
    _last: RolloutBatchRecord | None = None

    @property
    def done(self) -> bool:
        if self.max_rounds is None:
            return self.rounds >= 1
        return self._kept_groups >= self.batch_size or self.rounds >= self.max_rounds

    def add(self, record: RolloutBatchRecord) -> None:
        """One round's scored record (trainer.batch_size groups)."""
        if self.done:
            raise ValueError("the batch is already filled")
        self.rounds += 1
        self._last = record
        if self.max_rounds is None:
            self._kept.append(record)
            self._kept_groups += len(record) // self.group_size
            return
        spread = groups_with_spread(record, group_size=self.group_size)
        self.dropped += spread.count(False)
        chosen = [g for g, informative in enumerate(spread) if informative][: self.batch_size - self._kept_groups]
        if chosen:
            self._kept.append(select_groups(record, chosen, group_size=self.group_size))
            self._kept_groups += len(chosen)

    def record(self) -> RolloutBatchRecord:
        """The filled batch: at most batch_size groups; with no informative group at all, the last round's."""
        if not self.done or self._last is None:
            raise ValueError("the batch is not filled yet")
        if not self._kept:
            return self._last
        return self._kept[0] if len(self._kept) == 1 else concat_records(self._kept)

    @property
    def discarded(self) -> int:
        """Zero-spread groups left out of the batch (the last round's are trained on when nothing else was kept)."""
        if self._kept or self._last is None:
            return self.dropped
        return self.dropped - len(self._last) // self.group_size


class DynamicSampler:
    """Fills every buffered batch through a BatchFilling and totals, per training step, what the fillings did:
    `sampling/rounds`, `sampling/groups_dropped` and `sampling/groups_short` (batch_size minus the trained groups)."""

    def __init__(self, *, batch_size: int, group_size: int, max_rounds: int | None):
        self.batch_size, self.group_size, self.max_rounds = batch_size, group_size, max_rounds
        self._rounds = 0
        self._dropped = 0

    @property
    def enabled(self) -> bool:
        return self.max_rounds is not None

    def start(self) -> BatchFilling:
        return BatchFilling(batch_size=self.batch_size, group_size=self.group_size, max_rounds=self.max_rounds)

    def finish(self, filling: BatchFilling) -> RolloutBatchRecord:
        """The filled batch, its rounds and discarded groups counted towards this step's metrics."""
        record = filling.record()
        self._rounds += filling.rounds
        self._dropped += filling.discarded
        return record

    def step_metrics(self, trained: RolloutBatchRecord) -> dict[str, float]:
        """This step's totals (since the last call) and the trained batch's shortfall; empty when off."""
        if not self.enabled:
            return {}
        metrics = {"sampling/rounds": float(self._rounds), "sampling/groups_dropped": float(self._dropped),
                   "sampling/groups_short": float(self.batch_size - len(trained) // self.group_size)}
        self._rounds = self._dropped = 0
        return metrics
