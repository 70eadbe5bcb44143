from __future__ import annotations

from workers.engine.config import DataConfig
from workers.engine.tasks.arithmetic import arithmetic_task
from workers.engine.tasks.jsonl_chat import jsonl_task
from workers.engine.tasks.problem import Task


def build_task(config: DataConfig, *, seed: int) -> Task:
    if config.source == "arithmetic":
        return arithmetic_task(max_operand=config.max_operand, train_size=config.train_size, eval_size=config.eval_size, seed=seed)
    assert config.path is not None  # the config validator requires it
    return jsonl_task(config.path, train_size=config.train_size, eval_size=config.eval_size, seed=seed)
