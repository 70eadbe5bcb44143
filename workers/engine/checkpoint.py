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

import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.serialization import get_unsafe_globals_in_checkpoint

from workers.engine.checkpoint_folders import (
    STATE_FILE, check_resume_recipe, checkpoint_step, leftover_saves, list_checkpoints, resolve_checkpoint,
    temp_folder, write_checkpoint_info,
)
from workers.engine.fields import ConfigError, FieldError
from workers.engine.sharding import load_full_state

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json", "config.json")


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
    """Load states into the given objects, sharded (FSDP2) or not; return the recipe's progress dict.

    `recipe`: the resuming run's; a checkpoint its checkpoint.json does not say this recipe wrote is a ConfigError,
    before anything is loaded (and one whose progress is the other recipe's, before a state is). A trainer.pt that
    is not plain data is a ConfigError before anything in it is built (weights_only refuses it as it meets it).
    Either names `field`: the one that named the checkpoint (`checkpoint_folders.resume_field`)."""
    folder = resolve_checkpoint(path)
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe, field=field)
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # what weights_only refuses: a global it does not allow, an opcode it does not read
        raise _not_plain_data(folder, field=field) from None
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe, progress=state["progress"], field=field)
    load_full_state(model, optimizer, model_state=state["model"], optimizer_state=state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"])
    return state["progress"]


def check_plain_data(path: str | Path, *, field: str) -> None:
    """ConfigError on `field` unless the checkpoint's trainer.pt is plain data, told from its pickle without loading
    anything (what a Monarch run's controller checks before its trainer ranks load it)."""
    folder = resolve_checkpoint(path)
    try:
        unsafe = get_unsafe_globals_in_checkpoint(folder / STATE_FILE)
    except ValueError:  # not the zip torch.save writes: an older format, or not torch's at all
        raise ConfigError([FieldError(field, f"{folder / STATE_FILE} is not a checkpoint this engine wrote (the zip "
                                             "torch.save writes)")]) from None
    except (pickle.UnpicklingError, EOFError):  # an opcode torch.save never writes
        raise _not_plain_data(folder, field=field, unsafe=[]) from None
    if unsafe:
        raise _not_plain_data(folder, field=field, unsafe=unsafe)


def _not_plain_data(folder: Path, *, field: str, unsafe: list[str] | None = None) -> ConfigError:
    """The refusal, naming the types it would have built (`unsafe`; None: read them from the file, where it can)."""
    state_file = folder / STATE_FILE
    if unsafe is None:
        try:
            unsafe = get_unsafe_globals_in_checkpoint(state_file)
        except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError):  # not a torch.save zip, or beyond reading
            unsafe = []
    named = f" ({', '.join(sorted(unsafe))})" if unsafe else ""
    return ConfigError([FieldError(field, (
        f"{state_file} holds objects that are not plain data{named}, and checkpoints load as data only (tensors, "
        "numbers, strings, lists, dicts): this engine never wrote it, and it is not loaded; name a checkpoint a run "
        "of this engine wrote"))])
