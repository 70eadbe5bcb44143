"""Local JSONL chat / instruction data, one example a line, under the keys `data.fields` names.

A row gives its prompt as
  {"messages": [{"role": ..., "content": ...}, ...]}   a conversation; a final assistant message is the reply
  {"prompt": "..."}                                     one user message (also "instruction")
  {"prompt": [{"role": ..., "content": ...}, ...]}      a conversation, as with "messages"
and may carry "response" (the reply SFT trains on; also "output", "completion") and "answer" (what a
verifiable reward checks; `data.answer_extractor` says how to read it). What a row must carry depends on
the recipe (`Needs`): SFT a reply, GRPO with exact_math an answer. The first row that cannot be used is a
DataError naming its line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine.config import DataConfig, DataFields
from workers.engine.tasks.problem import DataError, Message, Problem, Task, split_by_seed

__all__ = ["DataError", "Needs", "extract_answer", "jsonl_task", "numbered_jsonl_problems", "problem_from_row",
           "read_jsonl_problems"]

_ROLES = {"system", "user", "assistant", "tool"}
# read too when data.fields keeps the conventional key
_ALIASES = {"prompt": ("instruction",), "response": ("output", "completion")}


@dataclass(frozen=True)
class Needs:
    """What every row must carry, each with the reason an error gives; None: optional."""

    response: str | None = None
    answer: str | None = None


def _keys(fields: DataFields, part: str) -> tuple[str, ...]:
    key = getattr(fields, part)
    return (key, *_ALIASES.get(part, ())) if key == part else (key,)


def _first_present(record: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((key for key in keys if record.get(key) is not None), None)


def _conversation(value: Any, key: str, line: int) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"'{key}' must be a non-empty list of {{role, content}} messages", line=line)
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"'{key}' message {i} needs a role in {sorted(_ROLES)} and string content", line=line)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def extract_answer(value: Any, *, key: str, extractor: str | None, line: int) -> str:
    """The answer a reward compares against, from a row's answer field."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"'{key}' must be a string or a number, not {type(value).__name__}", line=line)
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity, or a number too large for a float
        raise DataError(f"'{key}' must be a finite number, not {value}", line=line)
    if not isinstance(value, str):
        return str(value)
    if extractor == "gsm8k":
        if "####" not in value:
            raise DataError(f"'{key}' has no '#### <answer>' (data.answer_extractor: gsm8k)", line=line)
        value = value.rsplit("####", 1)[1].strip().replace(",", "")
    if not value.strip():
        raise DataError(f"'{key}' is empty", line=line)
    return value


def problem_from_row(record: Any, *, line: int, data: DataConfig, needs: Needs) -> Problem:
    if not isinstance(record, dict):
        raise DataError("expected a JSON object", line=line)
    fields = data.fields
    response_key = _first_present(record, _keys(fields, "response"))
    response = None if response_key is None else record[response_key]
    if response is not None and not isinstance(response, str):
        raise DataError(f"'{response_key}' must be a string, not {type(response).__name__}", line=line)

    if record.get(fields.messages) is not None:
        prompt_key = fields.messages
        conversation = _conversation(record[prompt_key], prompt_key, line)
    else:
        prompt_key = _first_present(record, _keys(fields, "prompt"))
        if prompt_key is None:
            raise DataError(f"'{fields.prompt}' is missing (the prompt; or give '{fields.messages}')", line=line)
        value = record[prompt_key]
        conversation = ([{"role": "user", "content": value}] if isinstance(value, str)
                        else _conversation(value, prompt_key, line))
    prompt = conversation
    if conversation[-1]["role"] == "assistant":
        if response is not None:
            raise DataError(f"both '{prompt_key}' ending with the assistant's reply and '{response_key}': keep one",
                            line=line)
        prompt, response = conversation[:-1], conversation[-1]["content"]
        if not prompt:
            raise DataError(f"'{prompt_key}' has only the assistant's reply: no prompt before it", line=line)
    if response is None and needs.response:
        raise DataError(f"'{fields.response}' is missing ({needs.response}" +
                        ("" if isinstance(record[prompt_key], str) else
                         f"; or end '{prompt_key}' with the assistant's reply") + ")", line=line)

    answer = None
    if record.get(fields.answer) is not None:
        answer = extract_answer(record[fields.answer], key=fields.answer, extractor=data.answer_extractor, line=line)
    elif needs.answer:
        raise DataError(f"'{fields.answer}' is missing ({needs.answer})", line=line)
    return Problem(messages=prompt, response=response, answer=answer)


def read_jsonl_problems(path: str | Path, *, data: DataConfig, needs: Needs) -> list[Problem]:
    return [problem for _, problem in numbered_jsonl_problems(path, data=data, needs=needs)]


def numbered_jsonl_problems(path: str | Path, *, data: DataConfig, needs: Needs) -> list[tuple[int, Problem]]:
    """(line number, problem) of every row that is not blank."""
    problems = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError("not UTF-8 text", line=number) from None
            if number == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"not JSON ({exc.msg})", line=number) from None
            except RecursionError:
                raise DataError("nested too deeply", line=number) from None
            except ValueError:  # what Python refuses to read as a number: one of over 4300 digits
                raise DataError("a number of more than 4300 digits", line=number) from None
            problems.append((number, problem_from_row(record, line=number, data=data, needs=needs)))
    if not problems:
        raise DataError("no rows: every line is blank")
    return problems


def jsonl_task(data: DataConfig, *, seed: int, needs: Needs, problems: list[Problem] | None = None) -> Task:
    """The file's rows split by seed; `problems`: its rows already read (by preflight), else it is read here."""
    assert data.path is not None  # the config validator requires it
    if problems is None:
        problems = read_jsonl_problems(data.path, data=data, needs=needs)
    available = len(problems) - data.eval_size
    if data.train_size is not None and 0 < available < data.train_size:
        raise DataError(f"{data.train_size} asked, but {data.path} has {available} rows left after holding out "
                        f"{data.eval_size} (data.eval_size); unset it to train on all of them", field="data.train_size")
    train, held_out = split_by_seed(problems, eval_size=data.eval_size, train_size=data.train_size, seed=seed)
    return Task(name=Path(data.path).stem, source="jsonl", train=train, held_out=held_out, rows=len(problems))
