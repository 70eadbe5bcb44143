"""Files the engine reads from a place a user names or can write (a checkpoint, a model folder, a data file): each
damaged or hostile form is a ConfigError on the field that named it, with the reason, never a traceback, and nothing
is loaded from it."""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.engine.test_checkpoint_data_only import _monarch_recovery
from workers.engine.checkpoint import check_plain_data, load_checkpoint, save_checkpoint
from workers.engine.cli import main as cli_main
from workers.engine.config import ConfigError, OptimizerConfig
from workers.engine.models.hf_folder import read_hf_config
from workers.engine.models.titan import build_decoder
from workers.engine.sharding import full_model_state, full_optimizer_state
from workers.engine.training import build_optimizer, build_scheduler


def _model_and_state(model_folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = build_decoder(read_hf_config(model_folder))
    optimizer = build_optimizer(model, OptimizerConfig())
    return model, optimizer, build_scheduler(optimizer, OptimizerConfig(), total_steps=10)


@pytest.fixture(scope="module")
def written(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step folder an SFT run of the tiny Qwen3 wrote after one optimizer step."""
    model, optimizer, scheduler = _model_and_state(tiny_qwen3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    scheduler.step()
    return save_checkpoint(tmp_path_factory.mktemp("written"), step=1, recipe="sft",
                           model_state=full_model_state(model), optimizer_state=full_optimizer_state(model, optimizer),
                           scheduler_state=scheduler.state_dict(), progress={"step": 1, "data": {"epoch": 0, "index": 0}},
                           model_folder=tiny_qwen3, keep_last=1)


def _member_offset(state_file: Path, name: str) -> int:
    """Where a member's bytes start in the zip (after its local header)."""
    with zipfile.ZipFile(state_file) as archive:
        member = archive.getinfo(name)
    raw = state_file.read_bytes()
    start = member.header_offset
    return start + 30 + int.from_bytes(raw[start + 26:start + 28], "little") + int.from_bytes(raw[start + 28:start + 30],
                                                                                               "little")


def _flipped(state_file: Path, member: str) -> None:
    raw = bytearray(state_file.read_bytes())
    raw[_member_offset(state_file, member) + 3] ^= 0xFF
    state_file.write_bytes(bytes(raw))


def _rezipped(state_file: Path, keep: Callable[[str], bool], rename: Callable[[str], str] = lambda name: name) -> None:
    with zipfile.ZipFile(state_file) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            if keep(name):
                archive.writestr(rename(name), data)
    state_file.write_bytes(buffer.getvalue())


def _replaced(state_file: Path, make: Callable[[Path], object]) -> None:
    state_file.unlink()
    make(state_file)


def _recompressed(state_file: Path) -> None:
    with zipfile.ZipFile(state_file) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    state_file.write_bytes(buffer.getvalue())


# each damaged form: how to make it from a whole trainer.pt, and how the refusal starts after the file's path
DAMAGED: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty": (lambda f: f.write_bytes(b""), "is not a checkpoint this engine wrote (the zip torch.save writes, and it "
                                            "is empty)"),
    "cut short": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
                  "is damaged (a zip that ends before its directory: a copy or a save cut short?)"),
    "NUL bytes": (lambda f: f.write_bytes(b"\0" * 4096), "is not a checkpoint this engine wrote (the zip torch.save "
                                                         "writes, and it is not a zip)"),
    "a byte of a weight flipped": (lambda f: _flipped(f, "trainer/data/0"),
                                   "is damaged (its member trainer/data/0 does not match its checksum"),
    "a byte of its pickle flipped": (lambda f: _flipped(f, "trainer/data.pkl"),
                                     "is damaged (its member trainer/data.pkl does not match its checksum"),
    "other members": (lambda f: _rezipped(f, keep=lambda name: True, rename=lambda name: f"x{name}.txt"),
                      "is not a checkpoint this engine wrote (the zip torch.save writes, with a data.pkl and a version "
                      "in one folder"),
    "no version": (lambda f: _rezipped(f, keep=lambda name: not name.endswith("/version")),
                   "is not a checkpoint this engine wrote (the zip torch.save writes, with a data.pkl and a version"),
    "a weight's member missing": (lambda f: _rezipped(f, keep=lambda name: name != "trainer/data/0"),
                                  "is damaged (torch cannot read it: PytorchStreamReader failed locating file data/0"),
    "compressed": (_recompressed,
                   "is not a checkpoint this engine wrote (the zip torch.save writes, and its member trainer/data.pkl "
                   "is compressed)"),
}
NOT_A_FILE: dict[str, Callable[[Path], object]] = {  # a step folder whose trainer.pt is not a file holds no checkpoint
    "a folder": lambda f: f.mkdir(),
    "a dangling symlink": lambda f: os.symlink(f.parent / "gone", f),
}


def _copy(written: Path, tmp_path: Path) -> Path:
    step = tmp_path / "theirs" / written.name
    shutil.copytree(written, step)
    return step


def _state_before(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _refused_load(step: Path, model_folder: Path, *, field: str = "checkpoint.folder") -> str:
    """The message of load_checkpoint's refusal, on `field`, having changed none of the objects it was given."""
    model, optimizer, scheduler = _model_and_state(model_folder)
    before, schedule = _state_before(model), scheduler.state_dict()
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler, recipe="sft", field=field)
    [error] = refused.value.errors
    assert error.field == field
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before), "the model was changed"
    assert optimizer.state_dict()["state"] == {} and scheduler.state_dict() == schedule
    return error.message


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_trainer_pt_is_refused_naming_its_field_by_every_reader(
        written: Path, tiny_qwen3: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    # it was torch's RuntimeError (PytorchStreamReader ...), OSError (a seek past the end), EOFError, a KeyError, or,
    # for a flipped byte in a weight, a checkpoint that loaded with that weight wrong
    step = _copy(written, tmp_path)
    make, problem = DAMAGED[damage]
    make(step / "trainer.pt")
    refusal = f"{step / 'trainer.pt'} {problem}"
    assert _refused_load(step, tiny_qwen3).startswith(refusal)
    assert "it is not loaded: name another checkpoint" in _refused_load(step, tiny_qwen3)

    with pytest.raises(ConfigError) as refused:  # a Monarch run's controller, before its ranks load it
        check_plain_data(step, field="checkpoint.resume_from")
    assert [(e.field, e.message.startswith(refusal)) for e in refused.value.errors] == [("checkpoint.resume_from", True)]

    out = tmp_path / "exported"  # the platform's export runs the command line and shows the last lines it printed
    assert cli_main(["export", "--checkpoint", str(step), "--out", str(out)]) == 2
    printed = capsys.readouterr().err
    assert "Traceback" not in printed and printed.splitlines()[-1].strip().startswith(f"checkpoint: {refusal}")
    assert not (out / "model.safetensors").exists()


def test_a_monarch_controller_refuses_a_damaged_trainer_pt_before_its_ranks_load_it(written: Path,
                                                                                     tmp_path: Path) -> None:
    step = tmp_path / "theirs" / written.name
    shutil.copytree(written, step)
    (step / "checkpoint.json").write_text('{"recipe": "grpo", "step": 1}')
    _flipped(step / "trainer.pt", "trainer/data/0")
    recovery, load = _monarch_recovery(tmp_path, f"{{resume_from: '{step}', folder: '{tmp_path / 'own'}'}}")
    with pytest.raises(ConfigError) as refused:
        recovery.load(str(step))
    assert [(e.field, "is damaged (its member trainer/data/0 does not match its checksum" in e.message)
            for e in refused.value.errors] == [("checkpoint.resume_from", True)]
    assert load.calls == [], "refused before the ranks are asked to load it"


@pytest.mark.parametrize("form", NOT_A_FILE)
def test_a_step_folder_whose_trainer_pt_is_not_a_file_holds_no_checkpoint(
        written: Path, tiny_qwen3: Path, tmp_path: Path, form: str, capsys: pytest.CaptureFixture[str]) -> None:
    # it was a FileNotFoundError traceback from the export, and from a load that preflight had not checked
    step = _copy(written, tmp_path)
    _replaced(step / "trainer.pt", NOT_A_FILE[form])
    refusal = f"no checkpoint in {step} (a step_N folder that holds a trainer.pt file, or a folder of them)"
    assert _refused_load(step, tiny_qwen3) == refusal
    with pytest.raises(ConfigError) as refused:
        check_plain_data(step, field="checkpoint.resume_from")
    assert [str(e) for e in refused.value.errors] == [f"checkpoint.resume_from: {refusal}"]
    assert cli_main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "exported")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].strip() == f"checkpoint: {refusal}"


def _saved_with(step: Path, change: Callable[[dict], object]) -> None:
    """trainer.pt written again (whole, plain data): what `change` makes of the state it holds."""
    torch.save(change(torch.load(step / "trainer.pt", weights_only=True)), step / "trainer.pt")


def _with(state: dict, part: str, **changes: object) -> dict:
    """`state` with its `part` (a dict) updated by `changes`; a change of None removes that key."""
    changed = {**state[part], **changes}
    return {**state, part: {key: value for key, value in changed.items() if value is not None}}


# each form of states the run cannot take: what it makes of the saved state, and what the refusal says of it
MISFIT: dict[str, tuple[Callable[[dict], object], str]] = {
    "a list": (lambda state: [state], "holds states this run cannot take (a list, not a dict of model, optimizer, "
                                      "scheduler, rng, progress)"),
    "no progress": (lambda state: {key: value for key, value in state.items() if key != "progress"},
                    "holds states this run cannot take (no progress)"),
    "a model that is a list": (lambda state: {**state, "model": [1]}, "holds states this run cannot take (model is a "
                                                                      "list, not a dict)"),
    "a weight that is a string": (lambda state: _with(state, "model", **{"tok_embeddings.weight": "x"}),
                                  "holds states this run cannot take (model's tok_embeddings.weight is not a tensor)"),
    "another model's weight": (lambda state: _with(state, "model", **{"norm.weight": torch.zeros(3, 3)}),
                               "holds the weights of another model than model.path's (norm.weight of [3, 3], where it "
                               "has ["),
    "a weight missing": (lambda state: _with(state, "model", **{"norm.weight": None}),
                         "holds the weights of another model than model.path's (no norm.weight)"),
    "a weight it does not have": (lambda state: _with(state, "model", extra=torch.zeros(1)),
                                  "holds the weights of another model than model.path's (extra, which it does not "
                                  "have)"),
    "a Python RNG state of another version": (lambda state: _with(state, "rng", python=(1, (), None)),
                                              "holds states this run cannot take (rng.python is not a Python random "
                                              "state)"),
    "a torch RNG state of the wrong size": (lambda state: _with(state, "rng", torch=torch.zeros(3, dtype=torch.uint8)),
                                           "holds states this run cannot take (rng.torch is not torch's random state"),
    "an optimizer without param_groups": (lambda state: _with(state, "optimizer", param_groups=None),
                                          "holds states this run cannot take (optimizer is not a dict of state and "
                                          "param_groups, each with its params)"),
    "an optimizer of other parameters": (lambda state: _with(state, "optimizer", param_groups=[]),
                                         "holds states this run cannot take (optimizer's param_groups hold [] "
                                         "parameters, where this run's hold ["),
    "a schedule that sets other attributes": (lambda state: _with(state, "scheduler", optimizer=5),
                                              "holds states this run cannot take (scheduler's optimizer is not one of "
                                              "this run's schedule's)"),
}


@pytest.mark.parametrize("misfit", MISFIT)
def test_a_trainer_pt_of_states_the_run_cannot_take_is_refused_before_any_is_loaded(
        written: Path, tiny_qwen3: Path, tmp_path: Path, misfit: str) -> None:
    # each was a traceback (TypeError, KeyError, RuntimeError from load_state_dict, ValueError from setstate), some
    # after the model's weights were loaded; a schedule's unknown key was set on the scheduler as an attribute
    step = _copy(written, tmp_path)
    change, problem = MISFIT[misfit]
    _saved_with(step, change)
    assert _refused_load(step, tiny_qwen3, field="checkpoint.resume_from").startswith(f"{step / 'trainer.pt'} {problem}")


def test_a_whole_checkpoint_loads(written: Path, tiny_qwen3: Path) -> None:
    model, optimizer, scheduler = _model_and_state(tiny_qwen3)
    assert load_checkpoint(written, model=model, optimizer=optimizer, scheduler=scheduler, recipe="sft") == \
        {"step": 1, "data": {"epoch": 0, "index": 0}}
    assert optimizer.state_dict()["state"] != {} and scheduler.last_epoch == 1
    check_plain_data(written, field="checkpoint.resume_from")
