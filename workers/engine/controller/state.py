"""Where a Monarch GRPO run is: the step loop's counters, the generations in flight and the fault totals."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.engine.tasks import Problem


@dataclass(frozen=True)
class ScoredGeneration:
    """A generation's answers, scored: the rollout record, its generated tokens and its slowest replica's seconds."""

    record: Any  # a RolloutBatchRecord
    tokens: int
    seconds: float


@dataclass
class PendingGeneration:
    """One step's problems, sent to the generators and not yet buffered (scored already when `scored` is set)."""

    problems: list[Problem]
    prompts: list[list[int]]
    calls: list[Any]  # its requests (`generators.py`), in prompt order
    data_state: dict[str, Any]  # the dataset's position before these problems were taken
    generation: int  # index of this generation (its sampling seeds derive from it)
    spans: list[tuple[int, int]]  # the problems [first, last) each call generates
    scored: ScoredGeneration | None = None  # scored while the trainer trained (`GenerationPipeline.score_ahead`)


@dataclass
class FaultTotals:
    steps_lost: int = 0
    samples_dropped: int = 0
    migrations: int = 0
    trainer_recoveries: int = 0
    control_recoveries: int = 0


@dataclass
class TrainerDrain:
    """An operator drained a host of the trainer's (SFT): the trainer leaves it at the next checkpoint, or sooner in a
    recovery that places it elsewhere."""

    host: str
    from_hosts: list[str]  # the trainer's hosts when it was drained
    said_waiting: bool = False  # the run page was told that no undrained host can take the trainer


@dataclass
class RunState:
    step: int = 0
    policy_version: int = 0
    generations: int = 0  # generations launched so far
    generator_version: int = 0  # the policy version the generators hold; -1 after a restore (they hold newer weights)
    publications: int = 0  # weight sends to the generators so far (actors/weight_inbox.py); 0: the starting weights
    staleness: Counter[int] = field(default_factory=Counter)  # trained batches by policy age
    pending: deque[PendingGeneration] = field(default_factory=deque)  # launched ahead, oldest first
    last_checkpoint: str | None = None
    trainer_drain: TrainerDrain | None = None
    totals: FaultTotals = field(default_factory=FaultTotals)

    def trained(self, *, record_version: int) -> int:
        """Count a trained step on a batch generated at `record_version`; its policy age."""
        age = self.policy_version - record_version
        self.staleness[age] += 1
        self.policy_version += 1
        self.step += 1
        return age

    def progress(self, *, data_now: Callable[[], dict[str, Any]], buffer: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint saves besides the weights. Generations in flight are not saved: the position before the
        oldest one is, so a restore generates those problems again with the same seeds (`data_now`: the dataset's
        position, asked only when nothing is in flight)."""
        oldest = self.pending[0] if self.pending else None
        return {"step": self.step, "policy_version": self.policy_version,
                "generations": oldest.generation if oldest else self.generations,
                "data": oldest.data_state if oldest else data_now(), "buffer": buffer(),
                "staleness": dict(self.staleness)}

    def resume(self, progress: dict[str, Any]) -> None:
        self.step, self.policy_version = progress["step"], progress["policy_version"]
        self.generations = progress["generations"]
        self.staleness.clear()
        self.staleness.update({int(k): v for k, v in progress["staleness"].items()})
