"""A checkpoint is data, not code: trainer.pt loads with torch.load's weights_only, so one that would build any other
object (a pickle whose __reduce__ runs something) is refused before anything in it is built, as an error of the field
that named it (checkpoint.resume_from, or checkpoint.folder when checkpoint.resume_latest chose it); a save never
writes one."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from tests.engine.fake_fleet import FakeEndpoint, FakeHosts, controller_parts, fake_group, grpo_config
from workers.engine.checkpoint import save_checkpoint
from workers.engine.checkpoint_folders import with_resume_point
from workers.engine.config import ConfigError
from workers.engine.controller.recovery import TrainerRecovery
from workers.engine.metrics import Recorder
from workers.engine.cli import main as cli_main
from workers.engine.models.hf_folder import export_hf
from workers.engine.preflight import preflight_errors
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft


class _WritesMarker:
    """Pickled as the call open(marker, "w"): whatever unpickles it without weights_only creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return open, (str(self.marker), "w")


def _state(marker: Path) -> dict[str, object]:
    return {"model": {}, "optimizer": {}, "scheduler": {}, "rng": {},
            "progress": {"step": 1, "data": _WritesMarker(marker)}}


WRITERS = {  # the ways a trainer.pt can hold it: torch.save's zip (its pickle protocol, or 4's opcodes), a bare pickle
    "torch.save": lambda state, file: torch.save(state, file),
    "torch.save protocol 4": lambda state, file: torch.save(state, file, pickle_protocol=4),
    "bare pickle": lambda state, file: file.write_bytes(pickle.dumps(state)),
}


def _hostile_checkpoint(folder: Path, marker: Path, writer: str, *, recipe: str = "sft") -> Path:
    """A step folder whose checkpoint.json says `recipe` wrote it and whose trainer.pt would write `marker`."""
    folder.mkdir(parents=True)
    WRITERS[writer](_state(marker), folder / "trainer.pt")
    (folder / "checkpoint.json").write_text(json.dumps({"recipe": recipe, "step": 1}))
    return folder


def _refusal(folder: Path, writer: str = "torch.save") -> str:
    """How the refusal of the trainer.pt `writer` wrote starts: a bare pickle is not even torch.save's zip."""
    if writer == "bare pickle":
        return f"{folder / 'trainer.pt'} is not a checkpoint this engine wrote"
    return f"{folder / 'trainer.pt'} holds objects that are not plain data"


@pytest.mark.parametrize("writer", WRITERS)
def test_a_trainer_pt_that_would_run_code_is_refused_naming_its_field_and_runs_nothing(
        tiny_qwen3: Path, make_config, tmp_path: Path, writer: str, capsys: pytest.CaptureFixture[str]) -> None:
    # it loaded with weights_only=False: the pickle ran open(marker) in the engine (and anything else it liked)
    marker = tmp_path / "ran"
    step = _hostile_checkpoint(tmp_path / "theirs" / "step_000001", marker, writer)
    short = (*ARITHMETIC, "trainer.steps=2", "trainer.batch_size=2", "eval.every_steps=0")
    warm = make_config("sft", tiny_qwen3, *short, f"checkpoint.folder={tmp_path / 'own'}",
                       f"checkpoint.resume_from={step.parent}")
    assert preflight_errors(warm) == [], "preflight reads checkpoint.json only"
    with pytest.raises(Exception) as refused:
        train_sft(warm, Recorder())
    assert not marker.exists(), "the trainer.pt's pickle ran code in the engine"
    assert refused.type is ConfigError
    [error] = refused.value.errors
    assert error.field == "checkpoint.resume_from"
    assert error.message.startswith(_refusal(step, writer))
    assert writer == "bare pickle" or "checkpoints load as data only" in error.message

    latest = make_config("sft", tiny_qwen3, *short, f"checkpoint.folder={step.parent}", "checkpoint.resume_latest=true")
    with pytest.raises(ConfigError) as refused:
        train_sft(latest, Recorder())
    [error] = refused.value.errors
    assert error.field == "checkpoint.folder" and error.message.startswith(_refusal(step, writer))
    assert not marker.exists()

    shutil.copyfile(tiny_qwen3 / "config.json", step / "config.json")  # what an export reads first
    with pytest.raises(ConfigError) as refused:  # an export loads it as data only too
        export_hf(step, tmp_path / "exported")
    [error] = refused.value.errors
    assert error.field == "checkpoint" and error.message.startswith(_refusal(step, writer))
    assert not marker.exists() and not (tmp_path / "exported" / "model.safetensors").exists()
    # the platform's export runs the command line and shows the last lines it printed: the reason, not a traceback
    assert cli_main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "exported")]) == 2
    printed = capsys.readouterr().err
    assert "Traceback" not in printed and f"checkpoint: {_refusal(step, writer)}" in printed.splitlines()[-1]
    assert not marker.exists()


def test_the_refusal_names_what_it_would_have_built(tiny_qwen3: Path, make_config, tmp_path: Path) -> None:
    step = _hostile_checkpoint(tmp_path / "theirs" / "step_000001", tmp_path / "ran", "torch.save")
    with pytest.raises(ConfigError) as refused:
        train_sft(make_config("sft", tiny_qwen3, *ARITHMETIC, f"checkpoint.resume_from={step}"), Recorder())
    assert refused.value.errors[0].message == (
        f"{_refusal(step)} ({open.__module__}.open), and checkpoints load as data only (tensors, numbers, strings, "
        "lists, dicts): this engine never wrote it, and it is not loaded; name a checkpoint a run of this engine wrote")


def _monarch_recovery(tmp_path: Path, checkpoint: str) -> tuple[TrainerRecovery, FakeEndpoint]:
    """A Monarch run's recovery over fake hosts, with the config its recipe runs (`with_resume_point`), and the
    trainer ranks' load endpoint."""
    config = with_resume_point(grpo_config("", checkpoint=checkpoint))
    hosts = FakeHosts(["a"])
    fleet = controller_parts(config, hosts, {"generator": fake_group("generator", hosts, ["a"])})
    load = fleet.trainer.actors.load = FakeEndpoint(lambda path: {0: {"step": 1}})
    return TrainerRecovery(config=config, trainer=fleet.trainer, supervisor=fleet.supervisor, failover=fleet.failover,
                           log=fleet.log, recorder=fleet.recorder, state=fleet.state), load


@pytest.mark.parametrize("writer", WRITERS)
def test_a_monarch_controller_refuses_it_before_its_ranks_load_it(tmp_path: Path, writer: str) -> None:
    # the ranks' load refuses it too (weights_only), but as an actor's failure: a traceback, not the field's error
    marker = tmp_path / "ran"
    step = _hostile_checkpoint(tmp_path / "theirs" / "step_000001", marker, writer, recipe="grpo")
    for checkpoint, field in ((f"{{resume_from: '{step}', folder: '{tmp_path / 'own'}'}}", "checkpoint.resume_from"),
                              (f"{{folder: '{step.parent}', resume_latest: true}}", "checkpoint.folder")):
        recovery, load = _monarch_recovery(tmp_path, checkpoint)
        path = recovery.config.checkpoint.resume_from
        assert path == str(step)
        with pytest.raises(ConfigError) as refused:
            recovery.load(path)
        [error] = refused.value.errors
        assert error.field == field
        assert error.message.startswith(_refusal(step, writer))
        assert load.calls == [], "refused before the ranks are asked to load it"
    assert not marker.exists()


def test_a_plain_checkpoint_passes_the_monarch_controllers_checks(tmp_path: Path) -> None:
    written = save_checkpoint(tmp_path / "theirs", step=1, recipe="grpo", model_state={"w": torch.zeros(1)},
                              optimizer_state={}, scheduler_state={}, model_folder=tmp_path, keep_last=1,
                              progress={"step": 1, "generations": 2, "staleness": {0: 1}, "data": {"epoch": 0}})
    recovery, load = _monarch_recovery(tmp_path, f"{{resume_from: '{written}'}}")
    assert recovery.load(str(written)) == {"step": 1}
    assert load.calls == [(str(written),)]


@pytest.mark.parametrize("chosen_by", ["checkpoint.resume_from", "checkpoint.folder"])
def test_the_other_recipes_checkpoint_refused_at_load_time_names_the_field_that_chose_it(
        tiny_trainable_qwen3: Path, make_config, tmp_path: Path, chosen_by: str) -> None:
    # (preflight named checkpoint.folder already; the run's own refusal named checkpoint.resume_from either way)
    step = tmp_path / "own" / "step_000001"
    train_sft(make_config("sft", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=1", "trainer.batch_size=2",
                          "eval.every_steps=0", f"checkpoint.folder={step.parent}"), Recorder())
    chooses = ([f"checkpoint.folder={step.parent}", "checkpoint.resume_latest=true"]
               if chosen_by == "checkpoint.folder" else
               [f"checkpoint.folder={tmp_path / 'grpo'}", f"checkpoint.resume_from={step}"])
    config = make_config("grpo", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=2", "trainer.batch_size=2",
                         "grpo.group_size=2", *chooses)
    assert [e.field for e in preflight_errors(config)] == [chosen_by]
    refusal = f"{step} holds an SFT run's checkpoint, and a GRPO run resumes only its own recipe's"
    with pytest.raises(ConfigError) as refused:  # told by its checkpoint.json
        train_grpo(config, Recorder())
    assert [(e.field, e.message.startswith(refusal)) for e in refused.value.errors] == [(chosen_by, True)]

    # one written by hand that names the wrong recipe: told by its progress, once it loads
    (step / "checkpoint.json").write_text(json.dumps({"recipe": "grpo", "step": 1}))
    with pytest.raises(ConfigError) as refused:
        train_grpo(config, Recorder())
    assert [(e.field, "but it holds an SFT run's progress" in e.message) for e in refused.value.errors] == \
        [(chosen_by, True)]


def test_a_state_that_is_not_plain_data_is_never_saved(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    with pytest.raises(TypeError, match=r"the checkpoint of step 2 holds objects that are not plain data \(.*Path"):
        save_checkpoint(folder, step=2, recipe="sft", model_state={"w": torch.zeros(1)}, optimizer_state={},
                        scheduler_state={}, progress={"step": 2, "data": tmp_path}, model_folder=folder, keep_last=1)
    assert list(folder.iterdir()) == [], "nothing left behind"
