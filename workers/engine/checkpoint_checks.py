"""The checks of a checkpoint's trainer.pt, each before anything in it is loaded (`checkpoint.load_checkpoint`,
`checkpoint.check_plain_data`): the file whole (its members' checksums), read as data only, holding the states
`checkpoint.save_checkpoint` writes in the forms a run reads them, and fitting the run's model, optimizer and schedule.
Each refusal is a ConfigError on the field that named the checkpoint, with the reason."""

from __future__ import annotations

import math
import pickle
import random
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.serialization import get_unsafe_globals_in_checkpoint

from workers.engine.checkpoint_folders import STATE_FILE, shown
from workers.engine.fields import ConfigError, FieldError

STATE_KEYS = ("model", "optimizer", "scheduler", "rng", "progress")  # what `save_checkpoint` writes in trainer.pt
_ANOTHER = "name another checkpoint (an earlier step_N folder of that run, say)"  # a refused trainer.pt's remedy


def refusal(folder: Path, *, field: str, problem: str, remedy: str = _ANOTHER) -> ConfigError:
    """The refusal of `folder`'s trainer.pt on `field`: what is wrong with it (`problem`), and what to do instead."""
    return ConfigError([FieldError(field, f"{folder / STATE_FILE} {problem}; it is not loaded: {remedy}")])


def checked_state(folder: Path, *, field: str, weights: bool) -> dict[str, Any]:
    """trainer.pt, whole (`_state_file_problem`; `weights` false: but for its tensors' checksums, and the tensors mapped
    from the file, not read), loaded as data only (a global weights_only does not allow is refused as it meets it),
    holding the parts `save_checkpoint` writes (`_state_problem`); else a ConfigError on `field`."""
    if problem := _state_file_problem(folder / STATE_FILE, weights=weights):
        raise refusal(folder, field=field, problem=problem)
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True, mmap=not weights)
    except pickle.UnpicklingError:  # what weights_only refuses: a global it does not allow, an opcode it does not read
        raise _not_plain_data(folder, field=field) from None
    except (RuntimeError, ValueError, OSError, EOFError) as exc:  # torch's reader refuses what Python's zip reader took
        raise refusal(folder, field=field, problem=f"is damaged (torch cannot read it: {_first_line(exc)})") from None
    if problem := _state_problem(state):
        raise refusal(folder, field=field, problem=f"holds states this run cannot take ({problem})")
    return state


def _first_line(exc: Exception) -> str:
    """What torch says went wrong: its first sentence (its messages go on about where to report it)."""
    text = str(exc).strip()
    return text.splitlines()[0].split(". ")[0].removesuffix(".") if text else type(exc).__name__


def _state_file_problem(state_file: Path, *, weights: bool) -> str | None:
    """Why `state_file` is not the zip torch.save writes (one folder's members, stored, holding data.pkl), whole: each
    member read through once and matched against its checksum, which torch's own reader never checks (a flipped byte
    in a tensor would load as a wrong weight); with `weights` false, all but the tensors' (its data/ members, nearly
    all of its bytes). None when it is."""
    not_ours = "is not a checkpoint this engine wrote (the zip torch.save writes"
    try:
        with open(state_file, "rb") as file:
            start = file.read(4)
        with zipfile.ZipFile(state_file) as archive:
            members = archive.infolist()
            top = members[0].filename.split("/", 1)[0] if members else ""
            names = {member.filename for member in members}
            if not {f"{top}/data.pkl", f"{top}/version"} <= names or any(not n.startswith(f"{top}/") for n in names):
                return f"{not_ours}: a data.pkl and a version in one folder; it holds {_first(sorted(names))})"
            if compressed := [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]:
                return f"{not_ours}, whose members are stored; its {compressed[0]} is compressed)"
            damaged = _unmatched(archive, [m for m in members if weights or not m.filename.startswith(f"{top}/data/")])
    except zipfile.BadZipFile:
        if start == b"PK\x03\x04":  # a zip's first member: one cut short before its directory, or damaged there
            return "is damaged (a zip that ends before its directory: a copy or a save cut short?)"
        return f"{not_ours}; it is {'empty' if not start else 'not a zip'})"
    except (zlib.error, EOFError, NotImplementedError, ValueError) as exc:
        return f"is damaged (its members cannot be read: {type(exc).__name__}: {exc})"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if damaged is not None:
        return f"is damaged (its member {damaged} does not match its checksum: a copy or a disk changed it?)"
    return None


def _unmatched(archive: zipfile.ZipFile, members: list[zipfile.ZipInfo]) -> str | None:
    """The first of `members` whose bytes do not match their checksum (read through, as ZipFile.testzip reads all)."""
    for member in members:
        try:
            with archive.open(member) as file:
                while file.read(1 << 20):
                    pass
        except zipfile.BadZipFile:
            return member.filename
    return None


def _state_problem(state: Any) -> str | None:
    """Why `state` (trainer.pt's, loaded) is not what `save_checkpoint` writes: the dict of `STATE_KEYS`, each a dict,
    the model's of tensors, a step, RNG states (whether they fit the run's model, optimizer and schedule:
    `model_misfit`, `fit_problem`). None when it is."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict of {', '.join(STATE_KEYS)}"
    if missing := [key for key in STATE_KEYS if key not in state]:
        return f"no {', '.join(missing)}"
    if not_dicts := [key for key in STATE_KEYS if not isinstance(state[key], dict)]:
        return f"{not_dicts[0]} is a {type(state[not_dicts[0]]).__name__}, not a dict"
    if not_tensors := [str(name) for name, value in state["model"].items() if not isinstance(value, torch.Tensor)]:
        return f"model's {_first(not_tensors)} is not a tensor"
    if hollow := [str(name) for name, value in state["model"].items() if value.is_meta or value.layout != torch.strided]:
        return f"model's {_first(hollow)} is not a dense tensor of values (a meta or sparse one)"
    step = state["progress"].get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"progress.step is {shown(step)}, not a whole number of steps (0 or more)"
    return _rng_problem(state["rng"])


def fit_problem(state: dict[str, Any], *, optimizer: torch.optim.Optimizer | None,
                scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> str | None:
    """Why `state`'s optimizer and scheduler states (of a state `_state_problem` passed) do not fit these (each
    checked when given). None when they do."""
    if optimizer is not None and (problem := _optimizer_problem(state["optimizer"], optimizer)):
        return problem
    if scheduler is not None and (unknown := [str(key) for key in state["scheduler"]
                                              if key not in scheduler.state_dict()]):
        return f"scheduler's {_first(unknown)} is not one of this run's schedule's"
    if scheduler is not None:
        return _schedule_problem(state["scheduler"], scheduler)
    return None


def values_problem(state: dict[str, Any], *, optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why `state`'s values (of a state `fit_problem` passed) are not ones a run can train from: a model weight, or an
    optimizer moment (when `optimizer` is given: the moments load only then), holding NaN or infinite values (a run
    that diverged saved it; the first step would train NaN from it), or AdamW's exp_avg_sq or max_exp_avg_sq a
    negative value (its step takes their square root). torch's loaders take them all. Each tensor is read once, by one
    reduction (`_extremes`). None when they are."""
    for name, weight in state["model"].items():
        if _extremes(weight) is None:
            return f"model's {name} holds NaN or infinite values: the run that saved it had diverged"
    if optimizer is None:
        return None
    for key, moments in state["optimizer"]["state"].items():
        for name, moment in moments.items():
            if name == "step" or not isinstance(moment, torch.Tensor):
                continue  # AdamW's step is `_moments_problem`'s (a finite count); SGD's momentum_buffer may be None
            extremes = _extremes(moment)
            if extremes is None:
                return f"optimizer's {name} of parameter {shown(key)} holds NaN or infinite values: the run that " \
                       "saved it had diverged"
            if name in _SQUARES and extremes[0] < 0:
                return f"optimizer's {name} of parameter {shown(key)} holds negative values, where " \
                       f"{type(optimizer).__name__}'s steps take its square root"
    return None


_SQUARES = ("exp_avg_sq", "max_exp_avg_sq")  # AdamW's moments of squared gradients: never negative


def _extremes(tensor: torch.Tensor) -> tuple[float, float] | None:
    """The least and the greatest of a tensor's values, None when it holds NaN or an infinite value (aminmax carries a
    NaN through): one pass over them, where torch.isfinite(tensor).all() takes some 30 times as long on a CPU. A tensor
    of no values, or of integers, holds neither: (0, 0)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0.0, 0.0
    low, high = (float(value) for value in torch.aminmax(tensor))
    return (low, high) if math.isfinite(low) and math.isfinite(high) else None


def _schedule_problem(saved: dict[str, Any], scheduler: torch.optim.lr_scheduler.LRScheduler) -> str | None:
    """Why a saved schedule's numbers (its base_lrs, last_epoch, step count, ...) are not of the form this run's schedule
    holds them in: a whole number, a number, a list of as many numbers (0 or more). torch's loader takes any value, and
    the schedule's next step fails on it. None when they are."""
    for key, own in scheduler.state_dict().items():
        if key not in saved or isinstance(own, bool):
            continue
        value = saved[key]
        if isinstance(own, int) and (isinstance(value, bool) or not isinstance(value, int)):
            return f"scheduler's {key} is {_shown_value(value)}, not a whole number"
        if isinstance(own, float) and _number(value, tensors=False) is None:
            return f"scheduler's {key} is {_shown_value(value)}, not a number"
        if isinstance(own, list) and own and all(isinstance(item, float) for item in own) and (
                not isinstance(value, list) or len(value) != len(own)
                or not all((number := _number(item, tensors=False)) is not None and number >= 0 for item in value)):
            return f"scheduler's {key} is {_shown_value(value)}, not a list of {len(own)} numbers (0 or more)"
    return None


def _optimizer_problem(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """Why `saved` is not an optimizer state `optimizer` can step from: its param_groups list as many parameters (each
    by an index or a name, once), each group holding the settings a step reads (`_group_problem`), and what it keeps of
    a parameter is what a step reads (`_moments_problem`). torch's loader takes nearly any of these values as they are,
    and the first step would fail on one it cannot use (or move the weights wrongly), after the weights were loaded.
    The saved groups' settings are the ones the run goes on with: the loader keeps all of a group but its params, and
    the run's config does not come back (the learning rate goes on from the schedule's saved base_lrs)."""
    groups = saved.get("param_groups")
    if not isinstance(saved.get("state"), dict) or not isinstance(groups, list) or \
            not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        return "optimizer is not a dict of state and param_groups, each with its params"
    counts, expected = [len(group["params"]) for group in groups], [len(g["params"]) for g in optimizer.param_groups]
    if counts != expected:
        return f"optimizer's param_groups hold {counts} parameters, where this run's hold {expected}"
    keys = [key for group in groups for key in group["params"]]
    if not all(isinstance(key, int | str) and not isinstance(key, bool) for key in keys):
        return "optimizer's param_groups name a parameter by something other than an index or a name"
    if twice := [key for index, key in enumerate(keys) if key in keys[:index]]:
        return f"optimizer's param_groups name parameter {shown(twice[0])} more than once"
    for index, (group, own) in enumerate(zip(groups, optimizer.param_groups)):
        if problem := _group_problem(group, own, optimizer=optimizer):
            return f"optimizer's param_groups[{index}]{problem}"
    params = {key: (param, own) for group, own in zip(groups, optimizer.param_groups)
              for key, param in zip(group["params"], own["params"])}
    for key, moments in saved["state"].items():
        if key not in params or not isinstance(moments, dict):
            return f"optimizer's state of {shown(key)} is not the moments of one of its param_groups' parameters"
        if problem := _moments_problem(moments, *params[key], optimizer=optimizer, of=f"parameter {shown(key)}"):
            return problem
    return None


# what a step of each optimizer `training.build_optimizer` builds reads of a param_group, and keeps for a parameter
# besides AdamW's step (AdamW's max_exp_avg_sq too with amsgrad): what torch's loader takes as it is
SETTINGS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"), torch.optim.SGD: ("lr", "momentum", "dampening",
                                                                                  "weight_decay")}
_MOMENTS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq"), torch.optim.SGD: ("momentum_buffer",)}


def _group_problem(group: dict[Any, Any], own: dict[str, Any], *, optimizer: torch.optim.Optimizer) -> str | None:
    """Why a saved param_group is not one `optimizer`'s step can read, told after the group's name: a setting
    `SETTINGS` names missing or not a number it takes, or a switch of how the optimizer steps (amsgrad, maximize,
    foreach, fused, ...: what its own group holds as True, False or None) other than this run's, which built it with
    none of them (the steps of a run with another amsgrad fail, one with maximize climbs the loss). None when it is."""
    kind = type(optimizer).__name__
    for name in SETTINGS.get(type(optimizer), ()):
        if name not in group:
            return f" has no {name} ({kind}'s steps read {', '.join(SETTINGS[type(optimizer)])})"
        value = group[name]
        if name == "betas":
            if not isinstance(value, list | tuple) or len(value) != 2 or \
                    not all((beta := _number(item, tensors=False)) is not None and 0 <= beta < 1 for item in value):
                return f".betas is {_shown_value(value)}, not two numbers from 0 up to 1"
        elif (number := _number(value, tensors=False)) is None or number < 0:
            return f".{name} is {_shown_value(value)}, not a number (0 or more)"
    for name, value in own.items():
        if (value is None or isinstance(value, bool)) and name in group and group[name] is not value:
            return f".{name} is {_shown_value(group[name])}, where this run's {kind} has {shown(value)}"
    return None


def _moments_problem(moments: dict[Any, Any], param: torch.Tensor, own: dict[str, Any], *,
                     optimizer: torch.optim.Optimizer, of: str) -> str | None:
    """Why the state saved `of` `param` (of this run's group `own`) is not one `optimizer`'s step can read: a moment
    `_MOMENTS` names missing (a parameter a step has reached keeps them all) or not a tensor of floating point of the
    parameter's shape (`_moment_problem`), AdamW's step not a count of steps, or anything else. None when it is."""
    kind = type(optimizer).__name__
    names = _MOMENTS.get(type(optimizer))
    if names is None:  # not an optimizer the engine builds: only the shapes of what it keeps
        return next((_moment_problem(name, value, param, of=of) for name, value in moments.items()
                     if isinstance(value, torch.Tensor) and value.ndim and value.shape != param.shape), None)
    stepped = isinstance(optimizer, torch.optim.AdamW)
    names = (*names, "max_exp_avg_sq") if stepped and own.get("amsgrad") else names
    if stepped and moments and (missing := [name for name in ("step", *names) if name not in moments]):
        return f"optimizer's state of {of} has no {missing[0]} ({kind} keeps {', '.join(('step', *names))} of a " \
               "parameter it has stepped)"
    for name, value in moments.items():
        if stepped and name == "step":
            if (count := _number(value)) is None or count < 0:
                return f"optimizer's step of {of} is {_shown_value(value)}, not a count of steps (a number, or a " \
                       "tensor of one, 0 or more)"
        elif name not in names:
            return f"optimizer's state of {of} holds {shown(name)}, which this run's {kind} does not keep"
        elif (value is not None or stepped) and (problem := _moment_problem(name, value, param, of=of)):
            return problem  # (SGD's momentum_buffer may be None: its next step makes one)
    return None


def _moment_problem(name: str, value: Any, param: torch.Tensor, *, of: str) -> str | None:
    moment = f"optimizer's {name} of {of}"
    if not isinstance(value, torch.Tensor):
        return f"{moment} is {_shown_value(value)}, not a tensor"
    if value.is_meta:
        return f"{moment} is a meta tensor, which holds no values"
    if value.layout != torch.strided:
        return f"{moment} is a {str(value.layout).removeprefix('torch.')} tensor, not a dense one"
    if not value.is_floating_point():
        return f"{moment} is a tensor of {str(value.dtype).removeprefix('torch.')}, not of floating point"
    if value.shape != param.shape:
        return f"{moment} is {list(value.shape)}, where the parameter is {list(param.shape)}"
    return None


def _number(value: Any, *, tensors: bool = True) -> float | None:
    """`value` as a float when it is a finite real number (not a bool), or (`tensors`) a tensor of one; else None."""
    if tensors and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or value.layout != torch.strided or value.is_quantized or \
                value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float: torch's loader and steps make floats of them
        return None
    return number if math.isfinite(number) else None


def _shown_value(value: Any) -> str:
    """A saved optimizer value as the refusal shows it: a tensor by its value (one of one) or its shape and type,
    anything else as JSON."""
    if not isinstance(value, torch.Tensor):
        return shown(value)
    if value.numel() == 1 and not value.is_meta and value.layout == torch.strided and not value.is_quantized:
        return f"a tensor of {shown(value.item())}"
    return f"a tensor of {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"


def _rng_problem(rng: dict[str, Any]) -> str | None:
    try:
        random.Random().setstate(rng["python"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return "rng.python is not a Python random state"
    expected = torch.get_rng_state()
    found = rng.get("torch")
    if not isinstance(found, torch.Tensor) or found.dtype != expected.dtype or found.shape != expected.shape:
        return f"rng.torch is not torch's random state (a {expected.dtype} tensor of {expected.numel()})"
    return None


def model_misfit(saved: dict[str, torch.Tensor], model: nn.Module) -> str | None:
    """How `saved` (a model state) does not fit `model`: the first names it lacks or does not have, or a shape it
    disagrees on. None when it fits."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if missing := [name for name in expected if name not in saved]:
        return f"no {_first(missing)}"
    if unexpected := [str(name) for name in saved if name not in expected]:
        return f"{_first(unexpected)}, which it does not have"
    for name, shape in expected.items():
        if tuple(saved[name].shape) != shape:
            return f"{name} of {list(saved[name].shape)}, where it has {list(shape)}"
    return None


def _first(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


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
