"""Local JSONL chat / instruction data.

Each line is one of:
  {"messages": [{"role": ..., "content": ...}, ..., {"role": "assistant", "content": reply}]}
  {"prompt": "...", "response": "..."}            (also "instruction"/"output")
and may carry "answer" for a verifiable reward. The last assistant message is the reply
that SFT trains on; the messages before it are the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.engine.tasks.problem import Problem, Task, split_by_seed

_ROLES = {"system", "user", "assistant", "tool"}


class DataError(ValueError):
    pass


def _problem_from_record(record: Any, line: int) -> Problem:
    if not isinstance(record, dict):
        raise DataError(f"line {line}: expected a JSON object")
    answer = record.get("answer")
    answer = None if answer is None else str(answer)
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"line {line}: messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise DataError(f"line {line}: each message needs a role in {sorted(_ROLES)} and string content")
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise DataError(f"line {line}: the last message must be the assistant's reply, after a prompt")
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        return Problem(messages=prompt, response=messages[-1]["content"], answer=answer)
    prompt = record.get("prompt", record.get("instruction"))
    response = record.get("response", record.get("output", record.get("completion")))
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise DataError(f"line {line}: needs 'messages', or string 'prompt' and 'response'")
    return Problem(messages=[{"role": "user", "content": prompt}], response=response, answer=answer)


def read_jsonl_problems(path: str | Path) -> list[Problem]:
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"line {number}: not JSON ({exc.msg})") from None
            problems.append(_problem_from_record(record, number))
    if not problems:
        raise DataError(f"{path} holds no examples")
    return problems


def jsonl_task(path: str | Path, *, train_size: int, eval_size: int, seed: int) -> Task:
    train, held_out = split_by_seed(read_jsonl_problems(path), eval_size=eval_size, train_size=train_size, seed=seed)
    return Task(name=Path(path).stem, train=train, held_out=held_out)
