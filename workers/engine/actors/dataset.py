from __future__ import annotations

import dataclasses
from typing import Any

from monarch.actor import Actor, endpoint

from workers.engine.config import RunConfig
from workers.engine.tasks import Problem, build_task
from workers.engine.tasks.stream import ProblemStream


class DatasetActor(Actor):
    """Serves training problems in a seeded, resumable order, and the held-out set."""

    def __init__(self, config: RunConfig):
        self.task = build_task(config)
        self.stream = ProblemStream(self.task.train, seed=config.trainer.seed)

    @endpoint
    def take(self, n: int) -> tuple[dict[str, Any], list[Problem]]:
        """(the stream's position before them: what a checkpoint saves while they are in flight, the next n problems,
        each tagged with its position in the stream: meta sample_id "epoch:index")."""
        before, tagged = self.stream.state_dict(), []
        for _ in range(n):
            problem = self.stream.take(1)[0]
            sample_id = f"{self.stream.epoch}:{self.stream.index - 1}"
            tagged.append(dataclasses.replace(problem, meta={**problem.meta, "sample_id": sample_id}))
        return before, tagged

    @endpoint
    def held_out(self) -> list[Problem]:
        return self.task.held_out

    @endpoint
    def summary(self) -> dict[str, Any]:
        return self.task.summary()

    @endpoint
    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    @endpoint
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
