"""The run's task from its config, and the data check preflight runs before anything loads."""

from __future__ import annotations

from workers.engine.config import FieldError, Recipe, RunConfig
from workers.engine.tasks.arithmetic import arithmetic_pairs, arithmetic_problem, arithmetic_task
from workers.engine.tasks.jsonl_chat import Needs, jsonl_task, numbered_jsonl_problems
from workers.engine.tasks.problem import DataError, Problem, Task


def needs_of(config: RunConfig) -> Needs:
    """What every row must carry for this run's recipe and reward."""
    if config.recipe == Recipe.SFT:
        return Needs(response="SFT trains on the reply")
    return Needs(answer="GRPO needs an answer for its reward" if config.reward.needs_answer else None)


def build_task(config: RunConfig) -> Task:
    data, seed = config.data, config.trainer.seed
    if data.source == "arithmetic":
        limit = data.train_limit
        assert limit is not None  # a generated task always has a size
        return arithmetic_task(max_operand=data.max_operand, train_size=limit, eval_size=data.eval_size, seed=seed)
    return jsonl_task(data, seed=seed, needs=needs_of(config))


def data_errors(config: RunConfig) -> list[FieldError]:
    """The first problem with the run's data, as a field error; reads a JSONL file whole, generates nothing."""
    data = config.data
    if data.source == "arithmetic":
        pairs = arithmetic_pairs(data.max_operand)
        if pairs <= data.eval_size:
            return [FieldError("data.eval_size", f"max_operand {data.max_operand} gives {pairs} problems: none left "
                                                 f"for training after holding out {data.eval_size}")]
        return []
    try:
        jsonl_task(data, seed=config.trainer.seed, needs=needs_of(config))
    except DataError as exc:
        return [FieldError(exc.field, str(exc))]
    except OSError as exc:
        return [FieldError("data.path", f"cannot read {data.path}: {exc.strerror or exc}")]
    return []


def prompts_to_check(config: RunConfig) -> list[tuple[str, Problem]]:
    """(where it comes from, problem) of the prompts that bound the run's prompt length: every row of a JSONL file (the
    data check has passed), or the arithmetic problem with the longest text."""
    data = config.data
    if data.source == "arithmetic":
        top = data.max_operand
        return [(f"data.max_operand {top}: '{top}+{top}='", arithmetic_problem(top, top))]
    assert data.path is not None  # the config validator requires it
    return [(f"data.path line {line}", problem)
            for line, problem in numbered_jsonl_problems(data.path, data=data, needs=needs_of(config))]
