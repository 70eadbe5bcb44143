"""Arithmetic and JSONL tasks, the resumable problem stream, and the reward registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engine.config import DataConfig
from workers.engine.rewards import REWARDS, CombinedReward, answer_format, exact_math, register_reward
from workers.engine.tasks.arithmetic import arithmetic_problem, arithmetic_task
from workers.engine.tasks.jsonl_chat import DataError, Needs, jsonl_task, read_jsonl_problems
from workers.engine.tasks.stream import ProblemStream


def _pairs(problems: list) -> set[str]:
    return {p.messages[-1]["content"] for p in problems}


def test_arithmetic_split_is_seeded_and_disjoint() -> None:
    task = arithmetic_task(max_operand=9, train_size=1000, eval_size=20, seed=0)
    assert len(task.held_out) == 20 and len(task.train) == 80  # 100 pairs in all
    assert not _pairs(task.train) & _pairs(task.held_out)
    again = arithmetic_task(max_operand=9, train_size=1000, eval_size=20, seed=0)
    other = arithmetic_task(max_operand=9, train_size=1000, eval_size=20, seed=1)
    assert _pairs(again.held_out) == _pairs(task.held_out) != _pairs(other.held_out)
    problem = arithmetic_problem(12, 7)
    assert problem.messages == [{"role": "user", "content": "12+7="}] and problem.answer == problem.response == "19"


def test_problem_stream_resumes_where_it_stopped() -> None:
    problems = arithmetic_task(max_operand=4, train_size=100, eval_size=5, seed=0).train
    stream = ProblemStream(problems, seed=3)
    first_epoch = stream.take(len(problems))
    assert sorted(_pairs(first_epoch)) == sorted(_pairs(problems))  # an epoch visits every problem once
    stream.take(7)
    state = stream.state_dict()
    expected = stream.take(30)
    resumed = ProblemStream(problems, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(30) == expected
    assert stream.epoch >= 2


def test_jsonl_chat_and_instruction_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt": "2+2=", "response": "4", "answer": 4},
        {"instruction": "say x", "output": "x"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    data = DataConfig(source="jsonl", path=str(path), eval_size=1)
    problems = read_jsonl_problems(path, data=data, needs=Needs(response="SFT trains on the reply"))
    assert [p.response for p in problems] == ["hello", "4", "x"]
    assert problems[0].messages == lines[0]["messages"][:2]
    assert problems[1].answer == "4" and problems[2].answer is None
    task = jsonl_task(data, seed=0, needs=Needs())
    assert len(task.train) == 2 and len(task.held_out) == 1


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "only a prompt"}]}), "line 2: 'response' is missing"),
    (json.dumps({"prompt": "p"}), "line 2: 'response' is missing"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}),
     "line 2: 'messages' message 0 needs a role"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "response": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        read_jsonl_problems(path, data=DataConfig(source="jsonl", path=str(path)), needs=Needs(response="SFT"))


@pytest.mark.parametrize("text, reward", [
    ("19", 1.0), (" 19 ", 1.0), ("so the answer is 19", 1.0), ("\\boxed{19} (not 20)", 1.0),
    ("18", 0.0), ("", 0.0), ("19 or 20", 0.0), ("1 9", 0.0),
])
def test_exact_math(text: str, reward: float) -> None:
    assert exact_math(arithmetic_problem(12, 7), text, True) == reward


def test_format_reward_wants_a_bare_number_and_a_stop() -> None:
    problem = arithmetic_problem(1, 1)
    assert answer_format(problem, "2", True) == 1.0
    assert answer_format(problem, "2", False) == 0.0
    assert answer_format(problem, "two", True) == 0.0


def test_combined_reward_and_registry() -> None:
    problem = arithmetic_problem(2, 3)
    combined = CombinedReward(["exact_math", "format"], [1.0, 0.5])
    score = combined(problem, "5", True)
    assert score.total == 1.5 and score.parts == {"exact_math": 1.0, "format": 1.0}
    assert combined(problem, "the sum is 5", False).total == 1.0
    with pytest.raises(ValueError, match="unknown reward"):
        CombinedReward(["nope"])
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_math")(exact_math)

    @register_reward("test_length")
    def length(problem, text, finished):  # type: ignore[no-untyped-def]
        return float(len(text))

    try:
        assert CombinedReward(["test_length"])(problem, "abc", True).total == 3.0
    finally:
        del REWARDS["test_length"]


def test_the_final_number_reads_thousands_separators_as_people_write_them():
    from workers.engine.rewards import extract_final_number

    assert extract_final_number("so the total is 1,042.") == "1042"
    assert extract_final_number("-1,000,000.5") == "-1000000.5"
    assert extract_final_number(r"\boxed{2,000} and then 7") == "2000"
    assert extract_final_number("3, 4") == "4"  # a list, not a separator
    assert extract_final_number("12,34") == "34"
    assert extract_final_number("no number") is None


def test_a_large_arithmetic_range_draws_only_the_pairs_the_run_uses():
    """max_operand 9999 (the Llama example) has 10^8 pairs: the task holds the 2256 the run uses, not all of them."""
    from workers.engine.tasks.arithmetic import arithmetic_task

    task = arithmetic_task(max_operand=9999, train_size=2000, eval_size=256, seed=3)  # (all 10^8: minutes, gigabytes)
    assert (len(task.train), len(task.held_out), task.rows) == (2000, 256, 10_000 ** 2)
    assert task.summary()["unused"] == 10_000 ** 2 - 2256
    prompts = [p.messages[-1]["content"] for p in task.train + task.held_out]
    assert len(set(prompts)) == 2256, "distinct pairs; held-out ones never trained on"
    for problem in task.train[:50]:
        a, b = problem.messages[-1]["content"].rstrip("=").split("+")
        assert problem.answer == str(int(a) + int(b)) and 0 <= int(a) <= 9999 and 0 <= int(b) <= 9999
    again = arithmetic_task(max_operand=9999, train_size=2000, eval_size=256, seed=3)
    assert [p.messages for p in again.held_out] == [p.messages for p in task.held_out], "seeded"
