"""Checkpoint folders on disk, without torch: which step folders are complete, which is newest, and which recipe
wrote one (its `checkpoint.json`), so preflight and the Monarch controller can refuse a resume before anything loads
it: of the other recipe's checkpoint, or of one whose checkpoint.json is missing or cannot be read. `checkpoint.py`
writes and loads what is inside them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.fields import ConfigError, FieldError

if TYPE_CHECKING:
    from workers.engine.config import RunConfig

STATE_FILE = "trainer.pt"
INFO_FILE = "checkpoint.json"  # {"recipe": "grpo" | "sft", "step": N}
INFO_MAX_BYTES = 4096  # what this engine writes there is a few dozen bytes
# What only a GRPO run's progress holds: how the progress a checkpoint loads with tells which recipe wrote it.
GRPO_PROGRESS_KEYS = ("generations", "buffer", "staleness")
A_RUN = {"grpo": "a GRPO run", "sft": "an SFT run"}  # each recipe's run, in a sentence
_STEP_FOLDER = re.compile(r"step_([0-9]+)")
_TEMP_FOLDER = re.compile(r"\.tmp_step_([0-9]+)")  # a save under way, or one a kill cut short: never a checkpoint


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def list_checkpoints(folder: str | Path) -> list[Path]:
    """The complete step_* folders, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step_*") if _STEP_FOLDER.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def temp_folder(folder: Path, step: int) -> Path:
    """Where a save of `step` is written before it is renamed to its step_* folder."""
    return folder / f".tmp_step_{step:06d}"


def leftover_saves(folder: Path, *, up_to: int) -> list[Path]:
    """The temp folders of saves of steps up to `up_to` that never finished (a later step's may be another run's,
    being written now)."""
    return [path for path in folder.glob(".tmp_step_*")
            if (match := _TEMP_FOLDER.fullmatch(path.name)) and int(match.group(1)) <= up_to]


def resolve_checkpoint(path: str | Path) -> Path:
    """A step_* folder as given, or the newest one inside a checkpoints folder (an unfinished save's temp folder is
    neither)."""
    path = Path(path)
    if _TEMP_FOLDER.fullmatch(path.name):
        raise FileNotFoundError(f"{path} is a save that never finished, not a checkpoint")
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return found[-1]


def latest_checkpoint(config: RunConfig) -> Path | None:
    """With checkpoint.resume_latest, the newest complete checkpoint in checkpoint.folder (None: it holds none, or the
    switch is off). As torchtitan's checkpoint.folder over its initial_load_path: a run's own checkpoints win over
    checkpoint.resume_from, which only starts a folder that holds none (a warm start), so a restarted or requeued run
    goes on from where it stopped whatever its first attempt started from."""
    if not config.checkpoint.resume_latest:
        return None
    found = list_checkpoints(config.checkpoint.folder)
    return found[-1] if found else None


def with_resume_point(config: RunConfig) -> RunConfig:
    """The config a recipe runs: checkpoint.resume_from the checkpoint it starts from (`latest_checkpoint` when there
    is one; else as given: a warm start, or None for step 0)."""
    latest = latest_checkpoint(config)
    if latest is None:
        return config
    return config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"resume_from": str(latest)})})


def resume_field(config: RunConfig) -> str:
    """The field that named the checkpoint a `with_resume_point` config starts from, which its refusal names:
    checkpoint.folder when checkpoint.resume_latest chose its newest checkpoint, else checkpoint.resume_from."""
    chosen = config.checkpoint.resume_from
    if config.checkpoint.resume_latest and chosen and Path(chosen).parent == Path(config.checkpoint.folder):
        return "checkpoint.folder"
    return "checkpoint.resume_from"


def write_checkpoint_info(folder: Path, *, recipe: str, step: int) -> None:
    (folder / INFO_FILE).write_text(json.dumps({"recipe": str(recipe), "step": step}))


class UnreadableInfo(ValueError):
    """A step folder's INFO_FILE is missing or does not say which recipe wrote it; the message says why."""


def checkpoint_recipe(folder: Path) -> str:
    """Which recipe wrote the step folder, as its INFO_FILE says; UnreadableInfo when it is missing or unusable (read
    no further than INFO_MAX_BYTES, and only when it is a regular file: a FIFO there would never end a read)."""
    info = folder / INFO_FILE
    try:
        if not info.exists():
            raise UnreadableInfo(f"{folder} has no {INFO_FILE}, which says which recipe wrote a checkpoint (it was "
                                 "written before checkpoints had one)")
        if not info.is_file():
            raise UnreadableInfo(f"{info} is not a file")
        with open(info, "rb") as file:
            raw = file.read(INFO_MAX_BYTES + 1)
    except OSError as exc:
        raise UnreadableInfo(f"cannot read {exc.filename or info} ({exc.strerror or exc})") from None
    if len(raw) > INFO_MAX_BYTES:
        raise UnreadableInfo(f"{info} is longer than {INFO_MAX_BYTES} bytes: not one this engine wrote")
    if b"\x00" in raw:
        raise UnreadableInfo(f"{info} holds a NUL byte: not one this engine wrote")
    try:
        info_data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UnreadableInfo(f"{info} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise UnreadableInfo(f"{info} is not JSON ({exc.msg})") from None
    except (ValueError, RecursionError):  # a number of over 4300 digits, arrays nested a thousand deep
        raise UnreadableInfo(f"{info} is not JSON this engine can read") from None
    if not isinstance(info_data, dict):
        raise UnreadableInfo(f"{info} is not a JSON object")
    recipe, step = info_data.get("recipe"), info_data.get("step")
    if not isinstance(recipe, str) or recipe not in A_RUN:
        raise UnreadableInfo(f"{info}: 'recipe' is {shown(recipe)}, not one of {', '.join(map(repr, A_RUN))}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UnreadableInfo(f"{info}: 'step' is {shown(step)}, not a whole number of steps (0 or more)")
    return recipe


def progress_recipe(progress: Mapping[str, Any]) -> str | None:
    """Which recipe's progress a checkpoint loaded with: only a GRPO run's has its generations, buffer, staleness."""
    if any(key in progress for key in GRPO_PROGRESS_KEYS):
        return "grpo"
    return "sft" if "data" in progress else None


def check_resume_recipe(path: str | Path, *, recipe: str, progress: Mapping[str, Any] | None = None,
                        field: str = "checkpoint.resume_from") -> None:
    """ConfigError on `field` (the one that named it: `resume_field`) unless the checkpoint at `path` says (its INFO_FILE) that this recipe
    wrote it: a resume continues the run that wrote it (its optimizer, schedule, data position and, for GRPO, its
    generations and replay buffer). Starting a run of one recipe from the other's weights is an export, then
    model.path. `progress`: what the checkpoint loaded with, which must be that recipe's too (an INFO_FILE written by
    hand can name the wrong one). FileNotFoundError when `path` holds no checkpoint."""
    folder = resolve_checkpoint(path)
    try:
        wrote = checkpoint_recipe(folder)
    except UnreadableInfo as exc:
        raise ConfigError([FieldError(field, f"{exc}: {_remedy(folder, recipe=recipe)}")]) from None
    holds = progress_recipe(progress) if progress is not None else None
    if wrote != recipe:
        problem = f"{folder} holds {A_RUN[wrote]}'s checkpoint"
    elif holds not in (None, recipe):
        problem = f"{folder / INFO_FILE} says {A_RUN[wrote]} wrote it, but it holds {A_RUN[holds]}'s progress"
    else:
        return
    raise ConfigError([FieldError(field, (
        f"{problem}, and {A_RUN[str(recipe)]} resumes only its own recipe's; to start it from these weights, "
        f"{_export(folder)}"))])


def _remedy(folder: Path, *, recipe: str) -> str:
    """What to do with a step folder whose INFO_FILE does not say which recipe wrote it."""
    match = _STEP_FOLDER.fullmatch(folder.name)
    info = json.dumps({"recipe": recipe, "step": int(match.group(1)) if match else "<its step>"})
    return (f"if {A_RUN[recipe]} wrote it, write {folder / INFO_FILE} as {info} and resume again; otherwise start "
            f"from its weights: {_export(folder)}")


def _export(folder: Path) -> str:
    return (f"export them (python -m workers.engine export --checkpoint {folder} --out DIR) and set model.path to DIR "
            "(on the platform: model.artifact=run:<id>@step:<step>)")


def shown(value: object) -> str:
    """A value read from a file, as JSON (what JSON cannot write, by its type's name), cut short: it may be anything up
    to INFO_MAX_BYTES, or a checkpoint's."""
    text = json.dumps(value, default=lambda other: type(other).__name__)
    return text if len(text) <= 40 else f"{text[:37]}..."
