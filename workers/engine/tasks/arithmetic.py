"""`a+b=` prompts with an exactly checkable answer."""

from __future__ import annotations

import random

from workers.engine.tasks.problem import Problem, Task, split_by_seed


def arithmetic_problem(a: int, b: int) -> Problem:
    answer = str(a + b)
    return Problem(messages=[{"role": "user", "content": f"{a}+{b}="}], response=answer, answer=answer)


def arithmetic_pairs(max_operand: int) -> int:
    return (max_operand + 1) ** 2


# Up to this many pairs every one is built and shuffled; above it (max_operand 9999 has 10^8) only the pairs the run
# uses are drawn, by index, so the task stays as small as the run.
MAX_ENUMERATED_PAIRS = 1_000_000


def arithmetic_task(*, max_operand: int, train_size: int, eval_size: int, seed: int) -> Task:
    """Pairs 0 <= a, b <= max_operand, split by seed: held-out pairs never appear in training."""
    count = arithmetic_pairs(max_operand)
    if count <= MAX_ENUMERATED_PAIRS:
        pairs = [arithmetic_problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        train, held_out = split_by_seed(pairs, eval_size=eval_size, train_size=train_size, seed=seed)
        return Task(name="arithmetic", source="arithmetic", train=train, held_out=held_out, rows=count)
    drawn = random.Random(seed).sample(range(count), min(count, eval_size + train_size))
    problems = [arithmetic_problem(*divmod(index, max_operand + 1)) for index in drawn]
    return Task(name="arithmetic", source="arithmetic", train=problems[eval_size:], held_out=problems[:eval_size],
                rows=count)
