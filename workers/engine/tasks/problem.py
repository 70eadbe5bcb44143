"""What every task yields: a chat prompt, its reference reply, and the answer a reward checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class Problem:
    messages: list[Message]
    response: str | None  # reference assistant reply (SFT target); GRPO rows may have none
    answer: str | None = None  # what a verifiable reward compares against
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    source: str
    train: list[Problem]
    held_out: list[Problem]
    rows: int  # examples the source gave, before the split

    @property
    def verifiable(self) -> bool:
        """Every held-out problem carries an answer, so its greedy completions can be scored."""
        return all(p.answer is not None for p in self.held_out)

    def summary(self) -> dict[str, Any]:
        """How much of the data the run uses: the fields of its `dataset` event."""
        return {"source": self.source, "task": self.name, "rows": self.rows, "train": len(self.train),
                "held_out": len(self.held_out), "unused": self.rows - len(self.train) - len(self.held_out)}


class DataError(ValueError):
    """A data set this run cannot use, reported against a config field (a row's problem: data.path, with its line)."""

    def __init__(self, message: str, *, field: str = "data.path", line: int | None = None):
        self.field = field
        self.line = line
        super().__init__(f"line {line}: {message}" if line is not None else message)


def split_by_seed(items: list[Problem], *, eval_size: int, train_size: int | None,
                  seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): a seeded shuffle, the first eval_size held out, the next train_size (None: all the rest)
    for training."""
    if len(items) <= eval_size:
        raise DataError(f"{len(items)} examples cannot leave any for training after holding out {eval_size}",
                        field="data.eval_size")
    order = list(items)
    random.Random(seed).shuffle(order)
    end = None if train_size is None else eval_size + train_size
    return order[eval_size:end], order[:eval_size]
