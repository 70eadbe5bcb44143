"""`a+b=` prompts with an exactly checkable answer."""

from __future__ import annotations

from workers.engine.tasks.problem import Problem, Task, split_by_seed


def arithmetic_problem(a: int, b: int) -> Problem:
    answer = str(a + b)
    return Problem(messages=[{"role": "user", "content": f"{a}+{b}="}], response=answer, answer=answer)


def arithmetic_pairs(max_operand: int) -> int:
    return (max_operand + 1) ** 2


def arithmetic_task(*, max_operand: int, train_size: int, eval_size: int, seed: int) -> Task:
    """Every pair 0 <= a, b <= max_operand, split by seed: held-out pairs never appear in training."""
    pairs = [arithmetic_problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    train, held_out = split_by_seed(pairs, eval_size=eval_size, train_size=train_size, seed=seed)
    return Task(name="arithmetic", source="arithmetic", train=train, held_out=held_out, rows=len(pairs))
