"""Checkpoint folders on disk, without torch: which step folders are complete, which is newest, and which recipe
wrote one (its `checkpoint.json`), so preflight and the Monarch controller can refuse a resume of the other recipe's
checkpoint before anything loads it. `checkpoint.py` writes and loads what is inside them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.engine.fields import ConfigError, FieldError

STATE_FILE = "trainer.pt"
INFO_FILE = "checkpoint.json"  # {"recipe": "grpo" | "sft", "step": N}
# What only a GRPO run's progress holds: how a checkpoint written before INFO_FILE existed is told apart.
GRPO_PROGRESS_KEYS = ("generations", "buffer", "staleness")
A_RUN = {"grpo": "a GRPO run", "sft": "an SFT run"}  # each recipe's run, in a sentence


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def list_checkpoints(folder: str | Path) -> list[Path]:
    """The complete step_* folders, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step_*") if p.name.removeprefix("step_").isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step_* folder as given, or the newest one inside a checkpoints folder."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return found[-1]


def write_checkpoint_info(folder: Path, *, recipe: str, step: int) -> None:
    (folder / INFO_FILE).write_text(json.dumps({"recipe": str(recipe), "step": step}))


def checkpoint_recipe(folder: Path, *, progress: Mapping[str, Any] | None = None) -> str | None:
    """Which recipe wrote the step folder: its INFO_FILE, else (a checkpoint written before there was one) what its
    `progress` holds; None when neither tells."""
    try:
        recipe = json.loads((folder / INFO_FILE).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        recipe = None
    if recipe in A_RUN:
        return recipe
    if progress is None:
        return None
    if any(key in progress for key in GRPO_PROGRESS_KEYS):
        return "grpo"
    return "sft" if "data" in progress else None


def check_resume_recipe(path: str | Path, *, recipe: str, progress: Mapping[str, Any] | None = None) -> None:
    """ConfigError on checkpoint.resume_from when the checkpoint at `path` was written by the other recipe: a resume
    continues the run that wrote it (its optimizer, schedule, data position and, for GRPO, its generations and replay
    buffer). Starting a run of one recipe from the other's weights is an export, then model.path."""
    folder = resolve_checkpoint(path)
    wrote = checkpoint_recipe(folder, progress=progress)
    if wrote is None or wrote == recipe:
        return
    raise ConfigError([FieldError("checkpoint.resume_from", (
        f"{folder} holds {A_RUN[wrote]}'s checkpoint, and {A_RUN[str(recipe)]} resumes only its own recipe's; to "
        f"start it from these weights, export them (python -m workers.engine export --checkpoint {folder} --out DIR) "
        "and set model.path to DIR (on the platform: model.artifact=run:<id>@step:<step>)"))])
