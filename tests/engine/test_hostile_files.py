"""Files the engine reads from a place a user names or can write (a checkpoint's trainer.pt and config.json, a model
folder's config.json and *.safetensors, an export's output folder; a data file's rows are test_datasets.py's): each
damaged or hostile form is a ConfigError on the field that named it, with the reason, never a traceback, and nothing
is loaded from it."""

from __future__ import annotations

import io
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.engine.test_checkpoint_data_only import _monarch_recovery
from workers.engine.checkpoint import check_plain_data, load_checkpoint, save_checkpoint
from workers.engine.cli import main as cli_main
from workers.engine.config import ConfigError, OptimizerConfig, load_config
from workers.engine.models.hf_folder import check_hf_folder, load_pretrained, read_hf_config
from workers.engine.models.titan import build_decoder
from workers.engine.preflight import preflight_errors
from workers.engine.sharding import full_model_state, full_optimizer_state, shard_model
from workers.engine.training import build_optimizer, build_scheduler


def _model_and_state(
        model_folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
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
    """Where a member's bytes start in the zip: after its local header, 30 bytes that end with the lengths of its name
    and of its extra field (2 bytes each, at 26 and 28), then those two."""
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
    "empty": (lambda f: f.write_bytes(b""), "is not a checkpoint this engine wrote (the zip torch.save writes; it is "
                                            "empty)"),
    "cut short": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
                  "is damaged (a zip that ends before its directory: a copy or a save cut short?)"),
    "NUL bytes": (lambda f: f.write_bytes(b"\0" * 4096), "is not a checkpoint this engine wrote (the zip torch.save "
                                                         "writes; it is not a zip)"),
    "a byte of a weight flipped": (lambda f: _flipped(f, "trainer/data/0"),
                                   "is damaged (its member trainer/data/0 does not match its checksum"),
    "a byte of its pickle flipped": (lambda f: _flipped(f, "trainer/data.pkl"),
                                     "is damaged (its member trainer/data.pkl does not match its checksum"),
    "other members": (lambda f: _rezipped(f, keep=lambda name: True, rename=lambda name: f"x{name}.txt"),
                      "is not a checkpoint this engine wrote (the zip torch.save writes: a data.pkl and a version in "
                      "one folder; it holds xtrainer/.data/serialization_id.txt"),
    "no version": (lambda f: _rezipped(f, keep=lambda name: not name.endswith("/version")),
                   "is not a checkpoint this engine wrote (the zip torch.save writes: a data.pkl and a version in "
                   "one folder; it holds trainer/.data/serialization_id"),
    "a weight's member missing": (lambda f: _rezipped(f, keep=lambda name: name != "trainer/data/0"),
                                  "is damaged (torch cannot read it: PytorchStreamReader failed locating file data/0"),
    "compressed": (_recompressed,
                   "is not a checkpoint this engine wrote (the zip torch.save writes, whose members are stored; its "
                   "trainer/data.pkl is compressed)"),
}
# read by the ranks' load only: a Monarch controller's check_plain_data reads no weight (test_monarch_sft: the ranks'
# refusal ends the run as the field's error)
IN_THE_WEIGHTS = {"a byte of a weight flipped"}
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

    if damage in IN_THE_WEIGHTS:
        check_plain_data(step, field="checkpoint.resume_from")  # passes: the ranks' load reads the weights
    else:
        with pytest.raises(ConfigError) as refused:  # a Monarch run's controller, before its ranks load it
            check_plain_data(step, field="checkpoint.resume_from")
        assert [(e.field, e.message.startswith(refusal)) for e in refused.value.errors] == \
            [("checkpoint.resume_from", True)]

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
    _flipped(step / "trainer.pt", "trainer/data.pkl")
    recovery, load = _monarch_recovery(tmp_path, f"{{resume_from: '{step}', folder: '{tmp_path / 'own'}'}}")
    with pytest.raises(ConfigError) as refused:
        recovery.load(str(step))
    assert [(e.field, "is damaged (its member trainer/data.pkl does not match its checksum" in e.message)
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


def _with(saved: dict, part: str, **changes: object) -> dict:
    """`saved` with its `part` (a dict) updated by `changes`; a change of None removes that key."""
    changed = {**saved[part], **changes}
    return {**saved, part: {key: value for key, value in changed.items() if value is not None}}


GONE = object()  # a change that removes the key


def _changed(values: dict, changes: dict[str, object]) -> dict:
    return {key: value for key, value in {**values, **changes}.items() if value is not GONE}


def _moments(saved: dict, of: int = 1, **changes: object) -> dict:
    """`saved` with the optimizer's state of parameter `of` (1: layer 0's wqkv, [128, 64]) updated by `changes`."""
    optimizer = saved["optimizer"]
    return _with(saved, "optimizer", state={**optimizer["state"], of: _changed(optimizer["state"][of], changes)})


def _settings(saved: dict, **changes: object) -> dict:
    """`saved` with the optimizer's (one) param_group updated by `changes`."""
    [group] = saved["optimizer"]["param_groups"]
    return _with(saved, "optimizer", param_groups=[_changed(group, changes)])


def _named_twice(saved: dict) -> dict:
    """q_norm's place in the param_group naming k_norm too (both [16]), q_norm's state dropped: torch's loader gave
    k_norm's moments to q_norm and started k_norm's again."""
    [group] = saved["optimizer"]["param_groups"]
    state = {key: moments for key, moments in saved["optimizer"]["state"].items() if key != 3}
    return _with(saved, "optimizer", state=state, param_groups=[{**group, "params": [*group["params"][:3], 4,
                                                                                     *group["params"][4:]]}])


def _spoiled(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """`tensor` with its last element `value`: what a run that diverged leaves in a weight or a moment."""
    spoiled = tensor.clone()
    spoiled.view(-1)[-1] = value
    return spoiled


WQ = "layers.0.attention.qkv_linear.wq.weight"
DIVERGED = "the run that saved it had diverged"
# each form of states the run cannot take: what it makes of the saved state, and what the refusal says of it
MISFIT: dict[str, tuple[Callable[[dict], object], str]] = {
    "a list": (lambda state: [state], "holds states this run cannot take (a list, not a dict of model, optimizer, "
                                      "scheduler, rng, progress)"),
    "no progress": (lambda state: {key: value for key, value in state.items() if key != "progress"},
                    "holds states this run cannot take (no progress)"),
    "a step that is a string": (lambda state: _with(state, "progress", step="1"),
                                "holds states this run cannot take (progress.step is \"1\", not a whole number of "
                                "steps (0 or more))"),
    "a step that is a tensor": (lambda state: _with(state, "progress", step=torch.ones(1)),
                                "holds states this run cannot take (progress.step is \"Tensor\", not a whole number"),
    "a model that is a list": (lambda state: {**state, "model": [1]}, "holds states this run cannot take (model is a "
                                                                      "list, not a dict)"),
    "a weight that is a string": (lambda state: _with(state, "model", **{"tok_embeddings.weight": "x"}),
                                  "holds states this run cannot take (model's tok_embeddings.weight is not a tensor)"),
    "a weight that holds no values": (lambda state: _with(state, "model", **{"norm.weight": torch.zeros(64, device="meta")}),
                                      "holds states this run cannot take (model's norm.weight is not a dense tensor of "
                                      "values (a meta or sparse one))"),
    "a sparse weight": (lambda state: _with(state, "model", **{"norm.weight": torch.zeros(64).to_sparse()}),
                        "holds states this run cannot take (model's norm.weight is not a dense tensor of values (a "
                        "meta or sparse one))"),
    "another model's checkpoint": (lambda state: _with(_with(state, "model", **{"norm.weight": torch.zeros(3)}),
                                                       "optimizer", state={key: {**moments, "exp_avg": torch.zeros(3)}
                                                                           for key, moments in
                                                                           state["optimizer"]["state"].items()}),
                                   "holds the weights of another model than model.path's (norm.weight of [3], where it "
                                   "has [64]); it is not loaded: resume it with model.path the model its run trained"),
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
    "a moment of another shape": (lambda state: _with(state, "optimizer", state={
                                      **state["optimizer"]["state"], 0: {**state["optimizer"]["state"][0],
                                                                        "exp_avg": torch.zeros(2)}}),
                                  "holds states this run cannot take (optimizer's exp_avg of parameter 0 is [2], where "
                                  "the parameter is ["),
    "the moments of a parameter it does not have": (lambda state: _with(state, "optimizer", state={
                                                        **state["optimizer"]["state"], 999: {}}),
                                                    "holds states this run cannot take (optimizer's state of 999 is not "
                                                    "the moments of one of its param_groups' parameters)"),
    "a schedule that sets other attributes": (lambda state: _with(state, "scheduler", optimizer=5),
                                              "holds states this run cannot take (scheduler's optimizer is not one of "
                                              "this run's schedule's)"),
    "a schedule's base learning rate that is a string": (lambda state: _with(state, "scheduler", base_lrs=["x"]),
                                                         "holds states this run cannot take (scheduler's base_lrs is "
                                                         "[\"x\"], not a list of 1 numbers (0 or more))"),
    "a schedule's step that is a string": (lambda state: _with(state, "scheduler", last_epoch="3"),
                                           "holds states this run cannot take (scheduler's last_epoch is \"3\", not "
                                           "a whole number)"),
    # an optimizer state torch's loader takes, whose first step fails (or moves the weights wrongly)
    "a moment that is a list": (lambda state: _moments(state, exp_avg=[0.0, 0.0]),
                                "holds states this run cannot take (optimizer's exp_avg of parameter 1 is [0.0, 0.0], "
                                "not a tensor)"),
    "a moment that is a string": (lambda state: _moments(state, exp_avg_sq="x"),
                                  "holds states this run cannot take (optimizer's exp_avg_sq of parameter 1 is \"x\", "
                                  "not a tensor)"),
    "a moment that is None": (lambda state: _moments(state, exp_avg=None),
                              "holds states this run cannot take (optimizer's exp_avg of parameter 1 is null, not a "
                              "tensor)"),
    "a moment of integers": (lambda state: _moments(state, exp_avg=torch.zeros(128, 64, dtype=torch.int64)),
                             "holds states this run cannot take (optimizer's exp_avg of parameter 1 is a tensor of "
                             "int64, not of floating point)"),
    "a moment of booleans": (lambda state: _moments(state, exp_avg_sq=torch.zeros(128, 64, dtype=torch.bool)),
                             "holds states this run cannot take (optimizer's exp_avg_sq of parameter 1 is a tensor of "
                             "bool, not of floating point)"),
    "a scalar moment of a matrix": (lambda state: _moments(state, exp_avg_sq=torch.tensor(0.0)),
                                    "holds states this run cannot take (optimizer's exp_avg_sq of parameter 1 is [], "
                                    "where the parameter is [128, 64])"),
    "a moment that holds no values": (lambda state: _moments(state, exp_avg=torch.zeros(128, 64, device="meta")),
                                      "holds states this run cannot take (optimizer's exp_avg of parameter 1 is a meta "
                                      "tensor, which holds no values)"),
    "a moment missing": (lambda state: _moments(state, exp_avg_sq=GONE),
                         "holds states this run cannot take (optimizer's state of parameter 1 has no exp_avg_sq (AdamW "
                         "keeps step, exp_avg, exp_avg_sq of a parameter it has stepped))"),
    "a state AdamW does not keep": (lambda state: _moments(state, extra=torch.zeros((), device="meta")),
                                    "holds states this run cannot take (optimizer's state of parameter 1 holds "
                                    "\"extra\", which this run's AdamW does not keep)"),
    "no optimizer step": (lambda state: _moments(state, step=GONE),
                          "holds states this run cannot take (optimizer's state of parameter 1 has no step (AdamW "
                          "keeps step, exp_avg, exp_avg_sq of a parameter it has stepped))"),
    "an optimizer step that is a string": (lambda state: _moments(state, step="1"),
                                           "holds states this run cannot take (optimizer's step of parameter 1 is "
                                           "\"1\", not a count of steps (a number, or a tensor of one, 0 or more))"),
    "a negative optimizer step": (lambda state: _moments(state, step=torch.tensor(-1.0)),
                                  "holds states this run cannot take (optimizer's step of parameter 1 is a tensor of "
                                  "-1.0, not a count of steps"),
    "an optimizer step that is not a number": (lambda state: _moments(state, step=float("nan")),
                                               "holds states this run cannot take (optimizer's step of parameter 1 is "
                                               "NaN, not a count of steps"),
    "an optimizer step of many values": (lambda state: _moments(state, step=torch.ones(128, 64)),
                                         "holds states this run cannot take (optimizer's step of parameter 1 is a "
                                         "tensor of [128, 64] float32, not a count of steps"),
    "a learning rate that is a string": (lambda state: _settings(state, lr="1e-4"),
                                         "holds states this run cannot take (optimizer's param_groups[0].lr is "
                                         "\"1e-4\", not a number (0 or more))"),
    "no eps": (lambda state: _settings(state, eps=GONE),
               "holds states this run cannot take (optimizer's param_groups[0] has no eps (AdamW's steps read lr, "
               "betas, eps, weight_decay))"),
    "one beta": (lambda state: _settings(state, betas=(0.9,)),
                 "holds states this run cannot take (optimizer's param_groups[0].betas is [0.9], not two numbers "
                 "from 0 up to 1)"),
    "amsgrad, which the run does not keep the moments of": (lambda state: _settings(state, amsgrad=True),
                                                            "holds states this run cannot take (optimizer's "
                                                            "param_groups[0].amsgrad is true, where this run's AdamW "
                                                            "has false)"),
    "an optimizer that climbs the loss": (lambda state: _settings(state, maximize=True),
                                          "holds states this run cannot take (optimizer's param_groups[0].maximize is "
                                          "true, where this run's AdamW has false)"),
    "a parameter named twice": (_named_twice, "holds states this run cannot take (optimizer's param_groups name "
                                              "parameter 4 more than once)"),
    # values torch's loaders take, from which the first step trains NaN: a checkpoint a run that diverged saved
    "a weight holding NaN": (lambda state: _with(state, "model", **{WQ: _spoiled(state["model"][WQ], float("nan"))}),
                             f"holds states no run can train from (model's {WQ} holds NaN or infinite values: "
                             f"{DIVERGED})"),
    "a weight holding an infinite value": (lambda state: _with(state, "model", **{"norm.weight": _spoiled(
                                               state["model"]["norm.weight"], float("-inf"))}),
                                           "holds states no run can train from (model's norm.weight holds NaN or "
                                           f"infinite values: {DIVERGED})"),
    "a moment holding NaN": (lambda state: _moments(state, exp_avg=_spoiled(state["optimizer"]["state"][1]["exp_avg"],
                                                                            float("nan"))),
                             "holds states no run can train from (optimizer's exp_avg of parameter 1 holds NaN or "
                             f"infinite values: {DIVERGED})"),
    "an exp_avg_sq holding an infinite value": (lambda state: _moments(state, exp_avg_sq=_spoiled(
                                                    state["optimizer"]["state"][1]["exp_avg_sq"], float("inf"))),
                                                "holds states no run can train from (optimizer's exp_avg_sq of "
                                                f"parameter 1 holds NaN or infinite values: {DIVERGED})"),
    "an exp_avg_sq holding a negative value": (lambda state: _moments(state, exp_avg_sq=_spoiled(
                                                   state["optimizer"]["state"][1]["exp_avg_sq"], -1e-8)),
                                               "holds states no run can train from (optimizer's exp_avg_sq of "
                                               "parameter 1 holds negative values, where AdamW's steps take its "
                                               "square root)"),
}


@pytest.mark.parametrize("misfit", MISFIT)
def test_a_trainer_pt_of_states_the_run_cannot_take_is_refused_before_any_is_loaded(
        written: Path, tiny_qwen3: Path, tmp_path: Path, misfit: str) -> None:
    # each was a traceback (TypeError, KeyError, RuntimeError from load_state_dict, ValueError from setstate), some
    # after the model's weights were loaded; a schedule's unknown key was set on the scheduler as an attribute. Most
    # optimizer states were taken by torch's loader, and the first step failed (AttributeError, KeyError, ValueError,
    # RuntimeError, ZeroDivisionError, after the weights were loaded), made the weights NaN (a NaN step), climbed the
    # loss (maximize), or went on with moments cast from integers or a parameter's moments lost (one named twice)
    step = _copy(written, tmp_path)
    change, problem = MISFIT[misfit]
    _saved_with(step, change)
    assert _refused_load(step, tiny_qwen3, field="checkpoint.resume_from").startswith(f"{step / 'trainer.pt'} {problem}")


def test_an_adamw_checkpoint_resumed_by_an_sgd_run_is_refused_naming_the_setting_sgd_reads(
        written: Path, tiny_qwen3: Path) -> None:
    # was taken by torch's loader, and the first step failed with KeyError: 'momentum'
    model = build_decoder(read_hf_config(tiny_qwen3))
    optimizer = build_optimizer(model, OptimizerConfig(name="sgd"))
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(written, model=model, optimizer=optimizer, field="checkpoint.resume_from")
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(f"{written / 'trainer.pt'} holds states this run cannot take (optimizer's "
                                    "param_groups[0] has no momentum (SGD's steps read lr, momentum, dampening, "
                                    "weight_decay))")
    assert optimizer.state_dict()["state"] == {}


def test_optimizer_steps_saved_as_numbers_load_into_a_sharded_trainer_that_steps_from_them(
        written: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    # torch before 1.12 saved AdamW's step as a number, which its loader takes; sharding it was an AttributeError
    step = _copy(written, tmp_path)
    _saved_with(step, lambda state: _with(state, "optimizer", state={
        key: {**moments, "step": float(moments["step"])} for key, moments in state["optimizer"]["state"].items()}))
    model = build_decoder(read_hf_config(tiny_qwen3))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_model(model, mixed_precision="off")
        optimizer = build_optimizer(model, OptimizerConfig())
        load_checkpoint(step, model=model, optimizer=optimizer, recipe="sft")
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()
        assert all(moments["step"].item() == 2.0 for moments in optimizer.state.values())
    finally:
        dist.destroy_process_group()


def test_a_whole_checkpoint_loads(written: Path, tiny_qwen3: Path) -> None:
    model, optimizer, scheduler = _model_and_state(tiny_qwen3)
    assert load_checkpoint(written, model=model, optimizer=optimizer, scheduler=scheduler, recipe="sft") == \
        {"step": 1, "data": {"epoch": 0, "index": 0}}
    assert optimizer.state_dict()["state"] != {} and scheduler.last_epoch == 1
    check_plain_data(written, field="checkpoint.resume_from")


def test_a_checkpoint_a_run_that_diverged_saved_is_refused_by_the_export_and_by_the_ranks_load_only(
        written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the export wrote its NaN weights as the model
    step = _copy(written, tmp_path)
    change, problem = MISFIT["a weight holding NaN"]
    _saved_with(step, change)
    check_plain_data(step, field="checkpoint.resume_from")  # passes: a Monarch controller reads no weight, its ranks do
    out = tmp_path / "exported"
    assert cli_main(["export", "--checkpoint", str(step), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].strip() == (
        f"checkpoint: {step / 'trainer.pt'} {problem}; it is not loaded: name another checkpoint (an earlier step_N "
        "folder of that run, say)")
    assert not (out / "model.safetensors").exists()


def _model_folder(tiny_qwen3: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3, folder)
    return folder


def _config_with(**changes: object) -> Callable[[Path], object]:
    """A config.json of the tiny model with `changes` to its keys (a change of None removes that key)."""
    def write(path: Path) -> None:
        changed = {**json.loads(path.read_text()), **changes}
        path.write_text(json.dumps({key: value for key, value in changed.items() if value is not None}))
    return write


# each hostile config.json: how to make it, and how the refusal starts after the folder's path
HOSTILE_CONFIG: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty": (lambda f: f.write_bytes(b""), "/config.json is not JSON (Expecting value, line 1 column 1)"),
    "NUL bytes": (lambda f: f.write_bytes(b"\0" * 8), "/config.json is not JSON (Expecting value, line 1 column 1)"),
    "not UTF-8": (lambda f: f.write_bytes(f.read_bytes() + b"\xff"), "/config.json is not UTF-8 text (byte "),
    "a list": (lambda f: f.write_text("[1, 2]"), "/config.json is a JSON list, not an object"),
    "a number of 5000 digits": (lambda f: f.write_text('{"hidden_size": ' + "9" * 5000 + "}"),
                                "/config.json is not JSON this engine can read"),
    "too long": (lambda f: f.write_text(" " * (2 << 20) + "{}"), "/config.json is longer than 1048576 bytes"),
    "a folder": (lambda f: (f.unlink(), f.mkdir()), " has no config.json file (the model's description)"),
    "a dangling symlink": (lambda f: (f.unlink(), os.symlink(f.parent / "gone", f)),
                           " has no config.json file (the model's description)"),
    "a size that is a string": (_config_with(hidden_size="64"),
                                ": config.json hidden_size: a whole number from 1 to 10000000, got '64'"),
    "a huge size": (_config_with(intermediate_size=10**12),
                    ": config.json intermediate_size: a whole number from 1 to 10000000, got 1000000000000"),
    "no vocab_size": (_config_with(vocab_size=None), ": config.json vocab_size: a whole number from 1 to 10000000, got "
                                                     "None"),
    "no layers": (_config_with(num_hidden_layers=0), ": config.json num_hidden_layers: a whole number from 1 to "),
    "positions that are a string": (_config_with(max_position_embeddings="x"),
                                    ': config.json max_position_embeddings: a whole number from 1 to 10000000, got "x"'),
    "an epsilon that is a string": (_config_with(rms_norm_eps="x"), ': config.json rms_norm_eps: a number above 0, got '
                                                                    '"x"'),
    "a negative RoPE theta": (_config_with(rope_parameters={"rope_theta": -1.0, "rope_type": "default"}),
                              ": config.json rope_theta: a number above 0, got -1.0"),
    "RoPE parameters that are a list": (_config_with(rope_parameters=[1]),
                                        ": config.json rope_parameters: an object, got list"),
    "key-value heads that do not divide the heads": (_config_with(num_key_value_heads=3), ": config.json "
                                                     "num_key_value_heads: 3 does not divide num_attention_heads"),
    "a model_type that is a list": (_config_with(model_type=["qwen3"]), ": unsupported model_type ['qwen3']"),
}


@pytest.mark.parametrize("form", HOSTILE_CONFIG)
def test_a_hostile_config_json_is_refused_naming_the_field_of_its_folder(
        written: Path, tiny_qwen3: Path, tmp_path: Path, form: str, capsys: pytest.CaptureFixture[str]) -> None:
    # each was a traceback (JSONDecodeError, UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError,
    # IsADirectoryError, FileNotFoundError), or a model built with a size of 10^12
    make, problem = HOSTILE_CONFIG[form]
    folder = _model_folder(tiny_qwen3, tmp_path)
    make(folder / "config.json")
    with pytest.raises(ConfigError) as refused:
        load_pretrained(folder)
    assert [(e.field, e.message.startswith(f"{folder}{problem}")) for e in refused.value.errors] == \
        [("model.path", True)], refused.value
    _checked_alike(folder, refused.value)

    step = _copy(written, tmp_path)  # an export reads the checkpoint's own config.json
    make(step / "config.json")
    assert cli_main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "exported")]) == 2
    printed = capsys.readouterr().err
    assert "Traceback" not in printed and printed.splitlines()[-1].strip().startswith(f"checkpoint: {step}{problem}")


def _safetensors_with(change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        save_file(change(load_file(str(path))), str(path))
    return write


# each hostile *.safetensors: how to make it from the model's, and how the refusal starts after the folder's path
HOSTILE_WEIGHTS: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty": (lambda f: f.write_bytes(b""), "/model.safetensors is not a safetensors file this engine can read "
                                            "(Error while deserializing header: header too small)"),
    "cut short": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
                  "/model.safetensors is not a safetensors file this engine can read"),
    "NUL bytes": (lambda f: f.write_bytes(b"\0" * 64), "/model.safetensors is not a safetensors file this engine can "
                                                       "read"),
    "a header of 2^60 bytes": (lambda f: f.write_bytes((1 << 60).to_bytes(8, "little") + b"{}"),
                               "/model.safetensors is not a safetensors file this engine can read"),
    "a folder": (lambda f: (f.unlink(), f.mkdir()), "/model.safetensors is not a file (a folder, or a link to nothing)"),
    "a dangling symlink": (lambda f: (f.unlink(), os.symlink(f.parent / "gone", f)),
                           "/model.safetensors is not a file (a folder, or a link to nothing)"),
    "a weight it does not have": (_safetensors_with(lambda state: {**state, "foo": torch.zeros(2)}),
                                  ": the weights do not fit the model config.json describes: 'foo' is not one of its "
                                  "weights"),
    "a weight of another shape": (_safetensors_with(lambda state: {**state, "model.norm.weight": torch.zeros(3)}),
                                  ": the weights do not fit the model config.json describes: norm.weight is [3], not "
                                  "[64]"),
    "a weight missing": (_safetensors_with(lambda state: {k: v for k, v in state.items() if k != "model.norm.weight"}),
                         ": the weights do not fit the model config.json describes: missing ['norm.weight']"),
}


@pytest.mark.parametrize("form", HOSTILE_WEIGHTS)
def test_hostile_safetensors_are_refused_naming_model_path(tiny_qwen3: Path, tmp_path: Path, form: str) -> None:
    # each was a traceback: SafetensorError, OSError ("No such device"), FileNotFoundError, KeyError, RuntimeError
    make, problem = HOSTILE_WEIGHTS[form]
    folder = _model_folder(tiny_qwen3, tmp_path)
    make(folder / "model.safetensors")
    with pytest.raises(ConfigError) as refused:
        load_pretrained(folder)
    assert [(e.field, e.message.startswith(f"{folder}{problem}")) for e in refused.value.errors] == \
        [("model.path", True)], refused.value
    _checked_alike(folder, refused.value)


def _checked_alike(folder: Path, refusal: ConfigError) -> None:
    """The vLLM generator's check before vLLM reads the folder (it reads no weights) refuses it as the load does."""
    with pytest.raises(ConfigError) as checked:
        check_hf_folder(folder)
    assert str(checked.value) == str(refusal)


def test_a_whole_model_folder_passes_the_check_before_vllm_reads_it(tiny_qwen3: Path) -> None:
    assert check_hf_folder(tiny_qwen3) == read_hf_config(tiny_qwen3)


def test_a_model_folder_of_another_family_is_refused_on_model_family_as_preflight_says_it(tiny_qwen3: Path,
                                                                                          tmp_path: Path) -> None:
    # a ValueError: a traceback from a Monarch rank or proc whose folder changed after preflight
    with pytest.raises(ConfigError) as refused:
        load_pretrained(tiny_qwen3, family="llama3")
    assert [str(e) for e in refused.value.errors] == ["model.family: the folder holds a qwen3 model, not llama3"]
    assert _preflight_errors(tiny_qwen3, tmp_path, "model.family=llama3") == [str(refused.value)]


def test_a_run_whose_config_json_passes_preflight_but_builds_no_model_exits_2_naming_model_path(
        tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # preflight reads model_type and the sizes its memory check needs; a string where a number is: a TypeError
    folder = _model_folder(tiny_qwen3, tmp_path)
    _config_with(rms_norm_eps="x")(folder / "config.json")
    config = tmp_path / "run.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: '{folder}'}}\ncheckpoint: {{folder: '{tmp_path / 'ck'}'}}\n"
                      "telemetry: {console: false}\ntrainer: {threads_per_process: 1, steps: 1}\n"
                      "data: {max_operand: 20, eval_size: 16}\n")
    assert cli_main(["train", "--config", str(config)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].strip() == \
        f'model.path: {folder}: config.json rms_norm_eps: a number above 0, got "x"'


@pytest.mark.parametrize("where", ["out", "inside"])
def test_an_export_whose_out_cannot_be_a_folder_exits_2_naming_out(written: Path, tmp_path: Path, where: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # it was a FileExistsError or NotADirectoryError traceback, once the checkpoint had loaded
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" if where == "out" else tmp_path / "taken" / "exported"
    assert cli_main(["export", "--checkpoint", str(written), "--out", str(out)]) == 2
    problem = "File exists" if where == "out" else "Not a directory"
    assert capsys.readouterr().err.splitlines()[-1].strip() == f"out: cannot make the folder {out} ({problem})"
    assert (tmp_path / "taken").read_text() == "a file"


def _preflight_errors(folder: Path, tmp_path: Path, *overrides: str) -> list[str]:
    config = load_config(f"recipe: sft\nmodel: {{path: '{folder}'}}\n",
                         overrides=[f"checkpoint.folder={tmp_path / 'ck'}", "telemetry.console=false", *overrides])
    return [str(error) for error in preflight_errors(config)]


@pytest.mark.parametrize("form", HOSTILE_CONFIG)
def test_preflight_refuses_every_config_json_the_model_load_refuses(tiny_qwen3: Path, tmp_path: Path,
                                                                     form: str) -> None:
    # preflight read only model_type and the sizes of its memory check: a config.json of no model (a string epsilon,
    # heads that do not divide, RoPE parameters that are a list, ...) passed it, and a Monarch run spawned its procs
    # before their load refused it
    make, _ = HOSTILE_CONFIG[form]
    folder = _model_folder(tiny_qwen3, tmp_path)
    make(folder / "config.json")
    errors = _preflight_errors(folder, tmp_path)
    assert any(error.startswith("model.path: ") for error in errors), errors


def test_preflight_refuses_a_config_json_of_no_model_as_the_load_does(tiny_qwen3: Path, tmp_path: Path) -> None:
    folder = _model_folder(tiny_qwen3, tmp_path)
    _config_with(num_key_value_heads=3)(folder / "config.json")
    with pytest.raises(ConfigError) as refused:
        load_pretrained(folder)
    assert _preflight_errors(folder, tmp_path) == [str(refused.value)]


def test_a_data_path_that_is_a_folder_is_refused_saying_so(tiny_qwen3: Path, tmp_path: Path) -> None:
    # it said "file ... does not exist"
    (tmp_path / "rows").mkdir()
    assert _preflight_errors(tiny_qwen3, tmp_path, "data.source=jsonl", f"data.path={tmp_path / 'rows'}") == \
        [f"data.path: {tmp_path / 'rows'} is a folder: name a JSONL file"]


def _json_with(name: str, **changes: object) -> Callable[[Path], None]:
    """The model folder's JSON file `name` with `changes` to its keys (a change of None removes that key)."""
    def write(folder: Path) -> None:
        _config_with(**changes)(folder / name)
    return write


def _written(name: str, text: str | bytes | Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """The model folder's file `name` written with `text`, or with what `text` makes of its bytes."""
    def write(folder: Path) -> None:
        path = folder / name
        raw = text(path.read_bytes()) if callable(text) else text
        path.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    return write


def _no_eos(folder: Path) -> None:
    _json_with("tokenizer_config.json", eos_token=None)(folder)
    _json_with("generation_config.json", eos_token_id=None)(folder)
    _json_with("config.json", eos_token_id=None)(folder)


# each unusable form of a model folder's tokenizer files: how to make it, and how model.path's refusal starts; the
# tiny model's tokenizer has 259 tokens
EOS_ID = "eos_token_id: a token id from 0 to 258, or a list of them, got "
HOSTILE_TOKENIZER: dict[str, tuple[Callable[[Path], object], str]] = {
    "tokenizer.json empty": (_written("tokenizer.json", b""),
                             "{folder}/tokenizer.json is not JSON (Expecting value, line 1 column 1)"),
    "tokenizer.json cut short": (_written("tokenizer.json", lambda raw: raw[:1000]),
                                 "{folder}/tokenizer.json is not JSON (Unterminated string"),
    "tokenizer.json not UTF-8": (_written("tokenizer.json", lambda raw: raw + b"\xff"),
                                 "{folder}/tokenizer.json is not UTF-8 text (byte "),
    "tokenizer.json a list": (_written("tokenizer.json", "[1]"),
                              "{folder}/tokenizer.json is a JSON list, not an object"),
    "tokenizer.json of no tokenizer": (_written("tokenizer.json", "{}"),
                                       "cannot load its tokenizer ({folder}/tokenizer.json: Model missing."),
    "tokenizer.json too long": (lambda d: os.truncate(d / "tokenizer.json", (64 << 20) + 1),
                                "{folder}/tokenizer.json is longer than 67108864 bytes: not a model's tokenizer.json"),
    "no tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(),
                          "{folder} has no tokenizer.json file (the model's tokenizer)"),
    "a tokenizer.json that is a folder": (lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").mkdir()),
                                          "{folder} has no tokenizer.json file (the model's tokenizer)"),
    "tokenizer_config.json empty": (_written("tokenizer_config.json", b""),
                                    "{folder}/tokenizer_config.json is not JSON (Expecting value, line 1 column 1)"),
    "tokenizer_config.json a string": (_written("tokenizer_config.json", '"x"'),
                                       "{folder}/tokenizer_config.json is a JSON str, not an object"),
    "tokenizer_config.json an eos_token that is a number": (
        _json_with("tokenizer_config.json", eos_token=5),
        "cannot load its tokenizer ({folder}: TypeError: Special token eos_token has to be either str or AddedToken"),
    "tokenizer_config.json a model_max_length that is a string": (
        _json_with("tokenizer_config.json", model_max_length="x"),
        "{folder}: its tokenizer cannot render a conversation (TypeError: "),
    "no chat template": (lambda d: (d / "chat_template.jinja").unlink(),
                         "{folder}: its tokenizer has no chat template (chat_template.jinja, or chat_template in "
                         "tokenizer_config.json)"),
    "a chat template that does not parse": (
        _written("chat_template.jinja", "{% for %}"),
        "{folder}: its tokenizer cannot render a conversation (TemplateSyntaxError: "),
    "no end-of-sequence token": (_no_eos, "{folder}: its tokenizer has no end-of-sequence token (eos_token in "
                                          "tokenizer_config.json, or eos_token_id in generation_config.json or "
                                          "config.json)"),
    "generation_config.json a list": (_written("generation_config.json", "[258]"),
                                      "{folder}/generation_config.json is a JSON list, not an object"),
    "generation_config.json too long": (_written("generation_config.json", " " * (2 << 20) + "{}"),
                                        "{folder}/generation_config.json is longer than 1048576 bytes"),
    "an eos_token_id that is a fraction": (_json_with("generation_config.json", eos_token_id=2.5),
                                           "{folder}: generation_config.json " + EOS_ID + "2.5"),
    "an eos_token_id that is a boolean": (_json_with("generation_config.json", eos_token_id=True),
                                          "{folder}: generation_config.json " + EOS_ID + "true"),
    "a negative eos_token_id": (_json_with("generation_config.json", eos_token_id=-1),
                                "{folder}: generation_config.json " + EOS_ID + "-1"),
    "an eos_token_id past the vocabulary": (_json_with("generation_config.json", eos_token_id=[258, 259]),
                                            "{folder}: generation_config.json " + EOS_ID + "[258, 259]"),
    "an eos_token_id that is a string": (_json_with("generation_config.json", eos_token_id="x"),
                                         '{folder}: generation_config.json ' + EOS_ID + '"x"'),
    "config.json an eos_token_id past the vocabulary": (_json_with("config.json", eos_token_id=100000),
                                                        "{folder}: config.json " + EOS_ID + "100000"),
}
PREFLIGHT_FIRST = {"no tokenizer.json", "a tokenizer.json that is a folder"}  # its own words: the folder lacks it


@pytest.mark.parametrize("form", HOSTILE_TOKENIZER)
def test_hostile_tokenizer_files_are_refused_naming_model_path_as_preflight_says_it(tiny_qwen3: Path, tmp_path: Path,
                                                                                    form: str) -> None:
    # each was a traceback (JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ValueError,
    # TemplateSyntaxError) from the trainer, generator, reference or reward proc that built its tokenizer, or an
    # end-of-sequence id taken as it was: 2.5 as 2, true as 1, -1 and ids the vocabulary does not have
    from workers.engine.models.tokenizer import ChatTokenizer

    make, problem = HOSTILE_TOKENIZER[form]
    folder = _model_folder(tiny_qwen3, tmp_path)
    make(folder)
    with pytest.raises(ConfigError) as refused:
        ChatTokenizer(folder)
    assert [(e.field, e.message.startswith(problem.format(folder=folder))) for e in refused.value.errors] == \
        [("model.path", True)], refused.value
    with pytest.raises(ConfigError) as loaded:
        load_pretrained(folder)
    assert str(loaded.value) == str(refused.value)
    _checked_alike(folder, refused.value)
    if form in PREFLIGHT_FIRST:
        assert _preflight_errors(folder, tmp_path) == [f"model.path: folder {folder} lacks tokenizer.json"]
    else:
        assert _preflight_errors(folder, tmp_path) == [str(refused.value)]

