"""What every task yields: a chat prompt, its reference reply, and the answer a reward checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

Message = dict[str, str]


@dataclass(frozen=True)
class Problem:
    messages: list[Message]
    response: str  # reference assistant reply (SFT target)
    answer: str | None = None  # what a verifiable reward compares against
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    train: list[Problem]
    held_out: list[Problem]


def split_by_seed(items: list[Problem], *, eval_size: int, train_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): a seeded shuffle, the first eval_size held out, the next train_size for training."""
    if len(items) <= eval_size:
        raise ValueError(f"{len(items)} examples cannot leave any for training after holding out {eval_size}")
    order = list(items)
    random.Random(seed).shuffle(order)
    return order[eval_size: eval_size + train_size], order[:eval_size]
