"""The run's task from its config, and the data check preflight runs before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.config import FieldError, Recipe, RunConfig
from workers.engine.tasks.arithmetic import arithmetic_pairs, arithmetic_problem, arithmetic_task
from workers.engine.tasks.jsonl_chat import Needs, jsonl_task, numbered_jsonl_problems
from workers.engine.tasks.problem import DataError, Problem, Task


def needs_of(config: RunConfig) -> Needs:
    """What every row must carry for this run's recipe and reward."""
    if config.recipe == Recipe.SFT:
        return Needs(response="SFT trains on the reply")
    return Needs(answer="GRPO needs an answer for its reward" if config.reward.needs_answer else None)


def build_task(config: RunConfig, *, rows: list[tuple[int, Problem]] | None = None) -> Task:
    """`rows`: a JSONL file's rows as `check_data` read them, so the file is not read again; None: read it here."""
    data, seed = config.data, config.trainer.seed
    if data.source == "arithmetic":
        limit = data.train_limit
        assert limit is not None  # a generated task always has a size
        return arithmetic_task(max_operand=data.max_operand, train_size=limit, eval_size=data.eval_size, seed=seed)
    problems = None if rows is None else [problem for _, problem in rows]
    return jsonl_task(data, seed=seed, needs=needs_of(config), problems=problems)


@dataclass(frozen=True)
class CheckedData:
    """The run's data as preflight checked it: the first problem with it (`errors`), else a JSONL file's rows with
    their line numbers (None for generated data), handed on to the checks that count their tokens."""

    errors: list[FieldError]
    rows: list[tuple[int, Problem]] | None = None


def check_data(config: RunConfig) -> CheckedData:
    """Every row of a JSONL file read (once) and checked, and the split it allows; generated data: its size only."""
    data = config.data
    if data.source == "arithmetic":
        pairs = arithmetic_pairs(data.max_operand)
        if pairs <= data.eval_size:
            return CheckedData([FieldError("data.eval_size", f"max_operand {data.max_operand} gives {pairs} problems: "
                                                             "none left for training after holding out "
                                                             f"{data.eval_size}")])
        return CheckedData([])
    assert data.path is not None  # the config validator requires it
    try:
        rows = numbered_jsonl_problems(data.path, data=data, needs=needs_of(config))
        build_task(config, rows=rows)  # what the split refuses (too few rows for eval_size and train_size)
    except DataError as exc:
        return CheckedData([FieldError(exc.field, str(exc))])
    except OSError as exc:
        return CheckedData([FieldError("data.path", f"cannot read {data.path}: {exc.strerror or exc}")])
    return CheckedData([], rows=rows)


def data_errors(config: RunConfig) -> list[FieldError]:
    """The first problem with the run's data, as a field error; reads a JSONL file whole, generates nothing."""
    return check_data(config).errors


def prompts_to_check(config: RunConfig, *, rows: list[tuple[int, Problem]] | None) -> list[tuple[str, Problem]]:
    """(where it comes from, problem) of the prompts that bound the run's prompt length: every row of a JSONL file (as
    `check_data` read them), or the arithmetic problem with the longest text."""
    data = config.data
    if data.source == "arithmetic":
        top = data.max_operand
        return [(f"data.max_operand {top}: '{top}+{top}='", arithmetic_problem(top, top))]
    assert rows is not None  # the data check has passed
    return [(f"data.path line {line}", problem) for line, problem in rows]
