"""Pluggable reward functions.

A reward function scores one completion of one problem: `fn(problem, text, finished)`,
where `text` is the decoded completion without special tokens and `finished` says it
ended with an end-of-sequence token. Register new ones with `@register_reward("name")`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.engine.tasks.problem import Problem

RewardFn = Callable[[Problem, str, bool], float]

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return register


# Thousands separators as people write them ("1,042"); a comma not followed by three digits ends the number.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def extract_final_number(text: str) -> str | None:
    """The content of the last \\boxed{...} if any, else the last number in the text."""
    boxed = _BOXED.findall(text)
    candidates = _NUMBER.findall(boxed[-1]) if boxed else _NUMBER.findall(text)
    return candidates[-1].replace(",", "") if candidates else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip() == b.strip()


@register_reward("exact_math")
def exact_math(problem: Problem, text: str, finished: bool) -> float:
    """1 when the completion's final number equals the problem's answer."""
    if problem.answer is None:
        raise ValueError("exact_math needs problems with an answer")
    found = extract_final_number(text)
    return 1.0 if found is not None and _same_number(found, problem.answer) else 0.0


@register_reward("format")
def answer_format(problem: Problem, text: str, finished: bool) -> float:
    """1 when the completion is a bare number and the model stopped by itself."""
    return 1.0 if finished and _NUMBER.fullmatch(text.strip()) else 0.0


@dataclass
class RewardScore:
    total: float
    parts: dict[str, float]


class CombinedReward:
    """Weighted sum of registered reward functions."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None):
        unknown = [n for n in names if n not in REWARDS]
        if unknown:
            raise ValueError(f"unknown reward functions {unknown}; registered: {sorted(REWARDS)}")
        self.names = list(names)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.names)

    def __call__(self, problem: Problem, text: str, finished: bool) -> RewardScore:
        parts = {name: REWARDS[name](problem, text, finished) for name in self.names}
        return RewardScore(total=sum(w * parts[n] for n, w in zip(self.names, self.weights)), parts=parts)
