"""Training data: verifiable prompts for GRPO, chat examples for SFT."""

from workers.engine.tasks.problem import Problem, Task
from workers.engine.tasks.build import build_task

__all__ = ["Problem", "Task", "build_task"]
