"""Checkpoints: everything a run needs to continue exactly, and export as an HF folder.

A checkpoint is a folder `<checkpoint.folder>/step_NNNNNN/` holding
  trainer.pt       model (torchtitan names), optimizer, scheduler, RNG states, and the
                   recipe's own progress (step, data position, policy version, buffer, ...), all plain
                   data (dicts, lists, tuples, numbers, strings, tensors): it loads with torch.load's
                   weights_only, which builds no other object, so a trainer.pt written by anyone who
                   can write where a config may point runs no code in the engine
  checkpoint.json  which recipe wrote it, readable without torch: a run of the other recipe
                   refuses to resume it, and so does every run when it is missing (`checkpoint_folders.py`)
  config.json      + tokenizer files: the HF description of the model, so the folder can be
                   exported (or read by `hf_folder.export_hf`) without the original model folder.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.serialization import get_unsafe_globals_in_checkpoint

from workers.engine.checkpoint_checks import (
    SETTINGS, checked_state, fit_problem, model_misfit, refusal, values_problem,
)
from workers.engine.checkpoint_folders import (
    STATE_FILE, check_resume_recipe, checkpoint_step, leftover_saves, list_checkpoints, resolve_checkpoint,
    temp_folder, write_checkpoint_info,
)
from workers.engine.fields import ConfigError, FieldError
from workers.engine.sharding import load_full_state

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json", "config.json")
# the key `load_checkpoint` adds to the progress it returns when the checkpoint's optimizer settings are not the run's
# config's (`_optimizer_differences`): the progress dict is what every caller gets, on Monarch too (a rank's `load`
# endpoint returns it), and no caller saves it again
OPTIMIZER_FROM_CHECKPOINT = "optimizer_from_checkpoint"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    folder: str | Path,
    *,
    step: int,
    recipe: str,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    progress: dict[str, Any],
    model_folder: str | Path,
    keep_last: int,
) -> Path:
    """Write step_NNNNNN atomically (temp folder, then rename) and prune to this run's newest keep_last.

    This run's checkpoints are the ones at or before `step`: a folder can also hold later steps of an
    older run (a rerun, or a resume into the same folder), and those are neither counted nor deleted.
    So the one just written is always the newest kept and the returned path always exists. The temp
    folders of this run's saves that a kill cut short (steps up to `step`) go too.
    The states are full (unsharded): `sharding.full_model_state` / `full_optimizer_state`. A state
    that is not plain data is a TypeError here, not a checkpoint that no run can resume.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:06d}"
    tmp = temp_folder(folder, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(
        {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler_state,
            "rng": rng_state(),
            "progress": progress,
        },
        tmp / STATE_FILE,
    )
    if unsafe := get_unsafe_globals_in_checkpoint(tmp / STATE_FILE):
        shutil.rmtree(tmp)
        raise TypeError(f"the checkpoint of step {step} holds objects that are not plain data ({', '.join(sorted(unsafe))})"
                        ": no run could load it; save them as dicts, lists, numbers, strings and tensors")
    write_checkpoint_info(tmp, recipe=recipe, step=step)
    for name in _TOKENIZER_FILES:
        source = Path(model_folder) / name
        if source.is_file():
            shutil.copyfile(source, tmp / name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    this_run = [path for path in list_checkpoints(folder) if checkpoint_step(path) <= step]
    for old in this_run[:-keep_last]:
        shutil.rmtree(old)
    for leftover in leftover_saves(folder, up_to=step):
        shutil.rmtree(leftover, ignore_errors=True)  # a save of another run's may be removing it too
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
    recipe: str | None = None,
    field: str = "checkpoint.resume_from",
) -> dict[str, Any]:
    """Load states into the given objects, sharded (FSDP2) or not; return the recipe's progress dict, and in it
    OPTIMIZER_FROM_CHECKPOINT when the loaded optimizer state holds other settings than the ones this run's optimizer
    and scheduler were built with from its config (`_optimizer_differences`). The checkpoint's win, as torch's loaders
    keep them: a resumed run goes on exactly as the run that saved it would have.

    `recipe`: the resuming run's; a checkpoint its checkpoint.json does not say this recipe wrote is a ConfigError,
    before anything is loaded (and one whose progress is the other recipe's, before a state is). A trainer.pt that
    is not plain data is a ConfigError before anything in it is built (weights_only refuses it as it meets it), and so
    is one that is damaged, holds states these objects cannot take or values no run can train from (`checkpoint_checks`:
    `checked_state`, `model_misfit`, `fit_problem`, `values_problem`: NaN or infinite weights), before any of them is
    changed. Each names `field`: the one that named the checkpoint (`checkpoint_folders.resume_field`)."""
    folder = find_checkpoint(path, field=field)
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe, field=field)
    state = checked_state(folder, field=field, weights=True)
    if problem := model_misfit(state["model"], model):
        raise refusal(folder, field=field, problem=f"holds the weights of another model than model.path's ({problem})",
                      remedy="resume it with model.path the model its run trained")
    if problem := fit_problem(state, optimizer=optimizer, scheduler=scheduler):
        raise refusal(folder, field=field, problem=f"holds states this run cannot take ({problem})")
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe, progress=state["progress"], field=field)
    if problem := values_problem(state, optimizer=optimizer):
        raise refusal(folder, field=field, problem=f"holds states no run can train from ({problem})")
    configured = _optimizer_settings(optimizer, scheduler) if optimizer is not None else {}
    try:
        load_full_state(model, optimizer, model_state=state["model"], optimizer_state=state["optimizer"])
    except (ValueError, KeyError, TypeError) as exc:  # the optimizer's state, which torch's loader checks as it goes
        raise refusal(folder, field=field, problem=f"holds an optimizer state this run cannot take ({exc})") from None
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"])
    loaded = _optimizer_settings(optimizer, scheduler) if optimizer is not None else {}
    if differences := _optimizer_differences(checkpoint=loaded, config=configured):
        return {**state["progress"], OPTIMIZER_FROM_CHECKPOINT: differences}
    return state["progress"]


def _optimizer_settings(optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> dict[str, Any]:
    """The settings a step of `optimizer` reads (`SETTINGS`) as plain numbers (betas a list), from its first
    param_group (`training.build_optimizer` builds one); lr is the schedule's base lr (the group's lr is the
    schedule's value at its step): the scheduler's, or the one a scheduler left in the group (a checkpoint's)."""
    group = optimizer.param_groups[0]
    settings = {name: _plain(group[name]) for name in SETTINGS.get(type(optimizer), ()) if name in group}
    if scheduler is not None and scheduler.base_lrs:
        settings["lr"] = _plain(scheduler.base_lrs[0])
    elif "initial_lr" in group:
        settings["lr"] = _plain(group["initial_lr"])
    return settings


def _plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _optimizer_differences(*, checkpoint: dict[str, Any], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each setting whose checkpoint's value is not the config's, as {"setting", "checkpoint", "config"}."""
    return [{"setting": name, "checkpoint": value, "config": config[name]}
            for name, value in checkpoint.items() if name in config and value != config[name]]


def check_plain_data(path: str | Path, *, field: str) -> None:
    """ConfigError on `field` unless the checkpoint's trainer.pt is whole (but for its weights' checksums) and plain
    data, told from its pickle before anything is built, and holds the parts a run loads (`checkpoint_checks.
    checked_state`; whether they fit the model, optimizer and schedule, which it does not have, the ranks' load
    checks): what a Monarch run's controller checks before its trainer ranks load it. The tensors are mapped from the
    file, not read: their checksums (a read of the whole file) are the ranks' load's to check, whose refusal ends the
    run as this one does."""
    checked_state(find_checkpoint(path, field=field), field=field, weights=False)


def find_checkpoint(path: str | Path, *, field: str) -> Path:
    """`resolve_checkpoint`, with a path that holds no checkpoint a ConfigError on `field`."""
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError as exc:
        raise ConfigError([FieldError(field, f"{exc} (a step_N folder that holds a {STATE_FILE} file, or a folder "
                                             "of them)")]) from None
