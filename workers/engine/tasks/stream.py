"""An endless, seeded, resumable walk over the training problems (reshuffled every epoch)."""

from __future__ import annotations

import random
from typing import Any

from workers.engine.tasks.problem import Problem


class ProblemStream:
    def __init__(self, problems: list[Problem], *, seed: int):
        if not problems:
            raise ValueError("no training problems")
        self.problems = problems
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Problem]:
        batch = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.problems[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._shuffled(self.epoch)
