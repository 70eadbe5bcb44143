"""Checkpoints: everything a run needs to continue exactly, and export as an HF folder.

A checkpoint is a folder `<checkpoint.folder>/step_NNNNNN/` holding
  trainer.pt       model (torchtitan names), optimizer, scheduler, RNG states, and the
                   recipe's own progress (step, data position, policy version, buffer, ...)
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

from workers.engine.checkpoint_folders import (
    STATE_FILE, check_resume_recipe, checkpoint_step, list_checkpoints, resolve_checkpoint, write_checkpoint_info,
)
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
    So the one just written is always the newest kept and the returned path always exists.
    The states are full (unsharded): `sharding.full_model_state` / `full_optimizer_state`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:06d}"
    tmp = folder / f".tmp_step_{step:06d}"
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
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
    recipe: str | None = None,
) -> dict[str, Any]:
    """Load states into the given objects, sharded (FSDP2) or not; return the recipe's progress dict.

    `recipe`: the resuming run's; a checkpoint its checkpoint.json does not say this recipe wrote is a ConfigError,
    before anything is loaded (and one whose progress is the other recipe's, before a state is)."""
    folder = resolve_checkpoint(path)
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe)
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    if recipe is not None:
        check_resume_recipe(folder, recipe=recipe, progress=state["progress"])
    load_full_state(model, optimizer, model_state=state["model"], optimizer_state=state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"])
    return state["progress"]
