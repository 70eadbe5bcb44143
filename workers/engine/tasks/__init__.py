"""Training data: verifiable prompts for GRPO, chat examples for SFT."""

from workers.engine.tasks.problem import DataError, Problem, Task
from workers.engine.tasks.build import CheckedData, build_task, check_data, data_errors, needs_of, prompts_to_check

__all__ = ["CheckedData", "DataError", "Problem", "Task", "build_task", "check_data", "data_errors", "needs_of",
           "prompts_to_check"]
