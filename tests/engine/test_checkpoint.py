"""Checkpoint/resume: a resumed run's next losses equal an uninterrupted run's; export starts new runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import ARITHMETIC
from workers.engine.checkpoint import list_checkpoints, resolve_checkpoint, save_checkpoint
from workers.engine.checkpoint_folders import with_resume_point
from workers.engine.config import ConfigError
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import export_hf, load_pretrained
from workers.engine.preflight import preflight_errors
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft

# Same process, same kernels: resumed losses should match bit for bit; allow float noise.
LOSS_TOLERANCE = 1e-6


def test_sft_resume_matches_uninterrupted_run(tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    common = (*ARITHMETIC, "trainer.steps=6", "trainer.batch_size=8", "trainer.micro_batch_size=4",
              "trainer.optimizer.schedule=cosine", "trainer.optimizer.warmup_steps=2", "eval.every_steps=0")
    whole_sink = MemorySink()
    whole = train_sft(make_config("sft", tiny_trainable_qwen3, *common,
                                  f"checkpoint.folder={tmp_path / 'a'}", "checkpoint.every_steps=3"), Recorder([whole_sink]))
    assert [p.name for p in list_checkpoints(tmp_path / "a")] == ["step_000003", "step_000006"]

    sink = MemorySink()
    resumed = train_sft(make_config("sft", tiny_trainable_qwen3, *common, f"checkpoint.folder={tmp_path / 'b'}",
                                    f"checkpoint.resume_from={tmp_path / 'a' / 'step_000003'}"), Recorder([sink]))
    assert len(resumed.losses) == 3
    assert resumed.losses == pytest.approx(whole.losses[3:], abs=LOSS_TOLERANCE)
    assert sink.series("lr") == whole_sink.series("lr")[3:]  # the schedule continues where it stopped
    assert [step for step, _ in sink.series("lr")] == [4, 5, 6]
    # the same optimizer settings (the warmup's lr at the step is not the setting): nothing to say
    assert [event["optimizer_from_checkpoint"] for event in sink.events("resumed")] == [[]]
    assert sink.events("message") == []


def test_grpo_async_resume_matches_uninterrupted_run(sft_warm_start: tuple[Path, float], make_config, tmp_path: Path) -> None:
    folder, _ = sft_warm_start
    common = (*ARITHMETIC, "trainer.steps=5", "trainer.batch_size=4", "trainer.micro_batch_size=16", "grpo.group_size=4",
              "grpo.mode=async", "grpo.max_policy_age=1", "trainer.optimizer.lr=2e-3", "eval.every_steps=0")
    whole = train_grpo(make_config("grpo", folder, *common, f"checkpoint.folder={tmp_path / 'a'}",
                                   "checkpoint.every_steps=2"), Recorder())
    sink = MemorySink()
    resumed = train_grpo(make_config("grpo", folder, *common, f"checkpoint.folder={tmp_path / 'b'}",
                                     f"checkpoint.resume_from={tmp_path / 'a'}/step_000002"), Recorder([sink]))
    assert resumed.losses == pytest.approx(whole.losses[2:], abs=LOSS_TOLERANCE)
    assert [m["policy_version"] for m in resumed.metrics] == [3, 4, 5]
    assert [m["staleness/policy_age"] for m in resumed.metrics] == [m["staleness/policy_age"] for m in whole.metrics[2:]]
    assert [event["optimizer_from_checkpoint"] for event in sink.events("resumed")] == [[]]
    assert sink.events("message") == []


# The checkpoint's optimizer settings win over the resuming run's config (torch's loaders keep them: exact
# resumption), and the run says so in its `resumed` event, which the run page says in words (tests/e2e/test_event_text):
# once, with no message beside it.
CHANGED_SETTINGS = ("trainer.optimizer.lr=2e-3", "trainer.optimizer.weight_decay=0.1")


def test_an_sft_resume_with_other_optimizer_settings_goes_on_with_the_checkpoints_and_says_so(
        tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    common = (*ARITHMETIC, "trainer.batch_size=4", "trainer.micro_batch_size=4", "eval.every_steps=0")
    train_sft(make_config("sft", tiny_trainable_qwen3, *common, "trainer.steps=1", "trainer.optimizer.lr=1e-3",
                          f"checkpoint.folder={tmp_path / 'a'}", "checkpoint.every_steps=1"), Recorder())
    sink = MemorySink()
    resumed = train_sft(make_config("sft", tiny_trainable_qwen3, *common, "trainer.steps=2", *CHANGED_SETTINGS,
                                    "trainer.optimizer.betas=[0.8, 0.99]", f"checkpoint.folder={tmp_path / 'b'}",
                                    f"checkpoint.resume_from={tmp_path / 'a' / 'step_000001'}"), Recorder([sink]))
    assert resumed.step == 2 and sink.series("lr") == [(2, 1e-3)]  # the checkpoint's lr, not the config's
    assert [event["optimizer_from_checkpoint"] for event in sink.events("resumed")] == [[
        {"setting": "lr", "checkpoint": 1e-3, "config": 2e-3},
        {"setting": "betas", "checkpoint": [0.9, 0.95], "config": [0.8, 0.99]},
        {"setting": "weight_decay", "checkpoint": 0.0, "config": 0.1}]]
    assert sink.events("message") == []


def test_a_grpo_resume_with_other_optimizer_settings_goes_on_with_the_checkpoints_and_says_so(
        tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    common = (*ARITHMETIC, "trainer.batch_size=2", "trainer.micro_batch_size=4", "grpo.group_size=2",
              "eval.every_steps=0")
    train_grpo(make_config("grpo", tiny_trainable_qwen3, *common, "trainer.steps=1", "trainer.optimizer.lr=1e-3",
                           f"checkpoint.folder={tmp_path / 'a'}", "checkpoint.every_steps=1"), Recorder())
    sink = MemorySink()
    resumed = train_grpo(make_config("grpo", tiny_trainable_qwen3, *common, "trainer.steps=2", *CHANGED_SETTINGS,
                                     f"checkpoint.folder={tmp_path / 'b'}",
                                     f"checkpoint.resume_from={tmp_path / 'a' / 'step_000001'}"), Recorder([sink]))
    assert [m["lr"] for m in resumed.metrics] == [1e-3]  # the checkpoint's lr, not the config's
    assert [event["optimizer_from_checkpoint"] for event in sink.events("resumed")] == [[
        {"setting": "lr", "checkpoint": 1e-3, "config": 2e-3},
        {"setting": "weight_decay", "checkpoint": 0.0, "config": 0.1}]]
    assert sink.events("message") == []


def test_export_is_an_hf_folder_that_starts_a_new_run(tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    result = train_sft(make_config("sft", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=2", "trainer.batch_size=4",
                                   "eval.every_steps=0"), Recorder())
    assert result.checkpoint is not None
    exported = export_hf(tmp_path / "checkpoints", tmp_path / "exported")  # the newest checkpoint in the folder
    assert resolve_checkpoint(tmp_path / "checkpoints") == result.checkpoint

    ours = load_pretrained(exported)
    start = load_pretrained(tiny_trainable_qwen3)
    reference = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(input_ids=ids).logits - ours.model(ids)).abs().max() < 1e-5
        assert (ours.model(ids) - start.model(ids)).abs().max() > 1e-3  # the trained weights, not the start

    again = train_sft(make_config("sft", exported, *ARITHMETIC, "trainer.steps=1", "trainer.batch_size=4",
                                  "eval.every_steps=0", f"checkpoint.folder={tmp_path / 'again'}"), Recorder())
    assert again.losses[0] < result.losses[0]  # continues from the trained weights


def _state_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint states (trainer.pt) torch.load reads from now on."""
    loads: list[str] = []
    real = torch.load

    def load(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith("trainer.pt"):
            loads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return loads


def _no_info(folder: Path, *, run: str, recipe: str, step: int) -> str:
    """The refusal of a checkpoint without a checkpoint.json."""
    return (f"{folder} has no checkpoint.json, which says which recipe wrote a checkpoint (it was written before "
            f"checkpoints had one): {_remedy(folder, run=run, recipe=recipe, step=step)}")


def _remedy(folder: Path, *, run: str, recipe: str, step: int) -> str:
    return (f"if {run} wrote it, write {folder / 'checkpoint.json'} as {{\"recipe\": \"{recipe}\", \"step\": {step}}} "
            f"and resume again; otherwise start from its weights: export them (python -m workers.engine export "
            f"--checkpoint {folder} --out DIR) and set model.path to DIR (on the platform: "
            "model.artifact=run:<id>@step:<step>)")


def test_a_checkpoint_of_the_other_recipe_is_refused_naming_resume_from(tiny_trainable_qwen3: Path, make_config,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # GRPO resuming an SFT checkpoint loaded it, then stopped on KeyError: 'generations' (a traceback); SFT resuming a
    # GRPO checkpoint trained on from the GRPO run's data position as if nothing were amiss
    model = tiny_trainable_qwen3
    short = {"sft": (*ARITHMETIC, "trainer.steps=1", "trainer.batch_size=2", "trainer.micro_batch_size=4",
                     "eval.every_steps=0")}
    short["grpo"] = (*short["sft"], "grpo.group_size=2")
    sft = train_sft(make_config("sft", model, *short["sft"], f"checkpoint.folder={tmp_path / 'sft'}"),
                    Recorder()).checkpoint
    grpo = train_grpo(make_config("grpo", model, *short["grpo"], f"checkpoint.folder={tmp_path / 'grpo'}"),
                      Recorder()).checkpoint
    assert sft is not None and grpo is not None
    assert json.loads((sft / "checkpoint.json").read_text()) == {"recipe": "sft", "step": 1}
    assert json.loads((grpo / "checkpoint.json").read_text()) == {"recipe": "grpo", "step": 1}

    for recipe, train, other, holds, run in (("grpo", train_grpo, sft, "an SFT run", "a GRPO run"),
                                             ("sft", train_sft, grpo, "a GRPO run", "an SFT run")):
        refusal = (f"{other} holds {holds}'s checkpoint, and {run} resumes only its own recipe's; to start it from "
                   f"these weights, export them (python -m workers.engine export --checkpoint {other} --out DIR) and "
                   "set model.path to DIR (on the platform: model.artifact=run:<id>@step:<step>)")
        config = make_config(recipe, model, *short[recipe], f"checkpoint.folder={tmp_path / 'resumed'}",
                             f"checkpoint.resume_from={other.parent}")  # the folder of step folders: its newest
        assert {e.field: e.message for e in preflight_errors(config)} == {"checkpoint.resume_from": refusal}
        # as checkpoints were written before there was one: preflight passed it, and the run refused it only once its
        # whole state had loaded (told by its progress)
        (other / "checkpoint.json").unlink()
        no_info = _no_info(other, run=run, recipe=recipe, step=1)
        assert {e.field: e.message for e in preflight_errors(config)} == {"checkpoint.resume_from": no_info}
        loads = _state_loads(monkeypatch)
        with pytest.raises(ConfigError) as refused:
            train(config, Recorder())
        assert [(e.field, e.message) for e in refused.value.errors] == [("checkpoint.resume_from", no_info)]
        assert loads == [], "refused before its state loads"

        # one written by hand that names the wrong recipe: what it holds tells, once it loads
        (other / "checkpoint.json").write_text(json.dumps({"recipe": recipe, "step": 1}))
        assert preflight_errors(config) == []
        with pytest.raises(ConfigError) as refused:
            train(config, Recorder())
        assert [(e.field, e.message) for e in refused.value.errors] == [("checkpoint.resume_from", (
            f"{other / 'checkpoint.json'} says {run} wrote it, but it holds {holds}'s progress, and {run} resumes only "
            f"its own recipe's; to start it from these weights, export them (python -m workers.engine export "
            f"--checkpoint {other} --out DIR) and set model.path to DIR (on the platform: "
            "model.artifact=run:<id>@step:<step>)"))]
        assert loads == [str(other / "trainer.pt")]
        monkeypatch.undo()
    assert not (tmp_path / "resumed").exists()


def test_a_checkpoint_without_checkpoint_json_is_refused_before_it_loads_and_resumes_once_it_has_one(
        tiny_trainable_qwen3: Path, make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a checkpoint written before checkpoint.json existed was refused (the other recipe's) or resumed only once its
    # whole state had loaded; now preflight refuses it, saying what the folder lacks and what to write there
    short = (*ARITHMETIC, "trainer.steps=1", "trainer.batch_size=2", "eval.every_steps=0")
    written = train_sft(make_config("sft", tiny_trainable_qwen3, *short, f"checkpoint.folder={tmp_path / 'a'}"),
                        Recorder()).checkpoint
    assert written is not None
    (written / "checkpoint.json").unlink()
    config = make_config("sft", tiny_trainable_qwen3, *short, "trainer.steps=2", f"checkpoint.folder={tmp_path / 'b'}",
                         f"checkpoint.resume_from={tmp_path / 'a'}")
    refusal = _no_info(written, run="an SFT run", recipe="sft", step=1)
    assert {e.field: e.message for e in preflight_errors(config)} == {"checkpoint.resume_from": refusal}
    loads = _state_loads(monkeypatch)
    with pytest.raises(ConfigError) as refused:
        train_sft(config, Recorder())
    assert [(e.field, e.message) for e in refused.value.errors] == [("checkpoint.resume_from", refusal)]
    assert loads == []

    (written / "checkpoint.json").write_text('{"recipe": "sft", "step": 1}')  # what the refusal says to write
    assert preflight_errors(config) == []
    sink = MemorySink()
    assert train_sft(config, Recorder([sink])).step == 2
    assert sink.events("resumed")[0]["step"] == 1 and loads == [str(written / "trainer.pt")]


HUGE = 10 * 1024**3  # a sparse file: read whole, it would take minutes and 10 GiB


@pytest.mark.parametrize("content, problem", [
    (b"step 3, sft", "is not JSON (Expecting value)"),
    (HUGE, "is longer than 4096 bytes: not one this engine wrote"),
    (b'{"recipe": "sft\x00", "step": 3}', "holds a NUL byte: not one this engine wrote"),
    (b'{"recipe": "sft", "step": 3}\n\x00', "holds a NUL byte: not one this engine wrote"),
    (b"\xff\xfe{\x00}\x00", "holds a NUL byte: not one this engine wrote"),
    (b'{"recipe": "sft", "step": 3, "note": "\xe9t\xe9"}', "is not UTF-8 text"),
    (b"[" * 3000, "is not JSON this engine can read"),
    (b'["sft", 3]', "is not a JSON object"),
    (b'{"step": 3}', "'recipe' is null, not one of 'grpo', 'sft'"),
    (b'{"recipe": "dpo", "step": 3}', "'recipe' is \"dpo\", not one of 'grpo', 'sft'"),
    (b'{"recipe": ["sft"], "step": 3}', "'recipe' is [\"sft\"], not one of 'grpo', 'sft'"),
    (b'{"recipe": "sft"}', "'step' is null, not a whole number of steps (0 or more)"),
    (b'{"recipe": "sft", "step": -3}', "'step' is -3, not a whole number of steps (0 or more)"),
    (b'{"recipe": "sft", "step": "3"}', "'step' is \"3\", not a whole number of steps (0 or more)"),
    (b'{"recipe": "sft", "step": 3.5}', "'step' is 3.5, not a whole number of steps (0 or more)"),
    (b'{"recipe": "sft", "step": true}', "'step' is true, not a whole number of steps (0 or more)"),
    (b'{"recipe": "sft", "step": "' + b"3" * 100 + b'"}',
     "'step' is \"" + "3" * 36 + "..., not a whole number of steps (0 or more)"),  # cut short
    ("folder", "is not a file"),
    ("fifo", "is not a file"),
])
def test_a_checkpoint_json_it_cannot_use_is_refused_naming_resume_from_and_why(
        tiny_qwen3: Path, make_config, tmp_path: Path, content: bytes | int | str, problem: str) -> None:
    # each one the engine cannot have written: a clean refusal (what is wrong, what to write there), never a traceback,
    # and never a read of more than the few bytes a checkpoint.json holds (nor a wait on a FIFO)
    folder = tmp_path / "checkpoints" / "step_000003"
    folder.mkdir(parents=True)
    (folder / "trainer.pt").write_bytes(b"")
    info = folder / "checkpoint.json"
    if content == "folder":
        info.mkdir()
    elif content == "fifo":
        os.mkfifo(info)
    elif isinstance(content, int):
        with open(info, "wb") as file:
            file.truncate(content)
    else:
        info.write_bytes(content)
    config = make_config("sft", tiny_qwen3, f"checkpoint.resume_from={folder.parent}")
    assert {e.field: e.message for e in preflight_errors(config)} == {
        "checkpoint.resume_from": f"{info}{'' if problem.startswith('is') or problem.startswith('holds') else ':'} "
                                  f"{problem}: {_remedy(folder, run='an SFT run', recipe='sft', step=3)}"}


def test_a_folder_named_with_other_digits_is_not_a_step(tmp_path: Path) -> None:
    # 'step_²' passed str.isdigit, then int() raised ValueError: a traceback from preflight
    folder = tmp_path / "checkpoints"
    for name in ("step_000002", "step_²", "step_٣"):
        (folder / name).mkdir(parents=True)
        (folder / name / "trainer.pt").write_bytes(b"")
    assert list_checkpoints(folder) == [folder / "step_000002"]
    assert resolve_checkpoint(folder) == folder / "step_000002"


def _save(folder: Path, step: int, keep_last: int) -> Path:
    return save_checkpoint(folder, step=step, recipe="sft", model_state={"w": torch.zeros(1)}, optimizer_state={},
                           scheduler_state={}, progress={"step": step}, model_folder=folder, keep_last=keep_last)


def test_pruning_keeps_this_runs_newest_by_step_and_the_one_just_written(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    for step in (4, 6):  # an older run's later steps
        _save(folder, step, keep_last=2)
    written = _save(folder, 3, keep_last=2)  # a rerun into the same folder
    assert (written / "trainer.pt").is_file()
    assert [p.name for p in list_checkpoints(folder)] == ["step_000003", "step_000004", "step_000006"]

    _save(folder, 5, keep_last=2)  # the steps up to 5 count as this run's: 4 and 5 are the newest two
    assert [p.name for p in list_checkpoints(folder)] == ["step_000004", "step_000005", "step_000006"]


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    _save(folder, 999_999, keep_last=1)
    newest = _save(folder, 1_000_000, keep_last=1)
    assert list_checkpoints(folder) == [newest]
    assert resolve_checkpoint(folder) == newest


def test_resume_latest_goes_on_from_the_newest_checkpoint_of_its_own_folder(tiny_trainable_qwen3: Path, make_config,
                                                                            tmp_path: Path) -> None:
    """checkpoint.resume_latest: a run started again with the same config (a restart, a requeued job) goes on from the
    newest complete checkpoint in checkpoint.folder; with none there (empty, or not made yet) it starts at step 0, or
    from checkpoint.resume_from, which is only that warm start."""
    short = (*ARITHMETIC, "trainer.batch_size=2", "eval.every_steps=0", "checkpoint.every_steps=2",
             f"checkpoint.folder={tmp_path / 'own'}", "checkpoint.resume_latest=true")
    missing = make_config("sft", tiny_trainable_qwen3, *short, "trainer.steps=2")
    assert preflight_errors(missing) == []
    sink = MemorySink()
    assert train_sft(missing, Recorder([sink])).losses and sink.events("resumed") == [], "nothing to resume: step 0"
    assert [p.name for p in list_checkpoints(tmp_path / "own")] == ["step_000002"]
    (tmp_path / "own" / ".tmp_step_000003").mkdir()  # a save that a kill cut short: not complete, never resumed
    (tmp_path / "own" / ".tmp_step_000003" / "trainer.pt").write_bytes(b"half")

    again = make_config("sft", tiny_trainable_qwen3, *short, "trainer.steps=4")
    assert preflight_errors(again) == []
    sink = MemorySink()
    resumed = train_sft(again, Recorder([sink]))
    assert len(resumed.losses) == 2 and resumed.step == 4
    assert _resumed(sink) == [(2, str(tmp_path / "own" / "step_000002"))]

    # its own checkpoints win over a warm start; with none in its folder the warm start is where it starts
    warm = make_config("sft", tiny_trainable_qwen3, *short, "trainer.steps=5",
                       f"checkpoint.resume_from={tmp_path / 'own' / 'step_000002'}")
    sink = MemorySink()
    assert len(train_sft(warm, Recorder([sink])).losses) == 1
    assert _resumed(sink) == [(4, str(tmp_path / "own" / "step_000004"))]
    fresh = warm.model_copy(update={"checkpoint": warm.checkpoint.model_copy(update={"folder": str(tmp_path / "new")})})
    sink = MemorySink()
    assert len(train_sft(fresh, Recorder([sink])).losses) == 3
    assert _resumed(sink) == [(2, str(tmp_path / "own" / "step_000002"))]

    empty = tmp_path / "empty"
    empty.mkdir()
    without = make_config("sft", tiny_trainable_qwen3, *short, "trainer.steps=1", f"checkpoint.folder={empty}")
    assert preflight_errors(without) == []
    sink = MemorySink()
    assert len(train_sft(without, Recorder([sink])).losses) == 1 and sink.events("resumed") == []


def _resumed(sink: MemorySink) -> list[tuple[int, str]]:
    return [(event["step"], event["path"]) for event in sink.events("resumed")]


def test_resume_latest_refuses_the_other_recipes_checkpoint_in_its_folder(tiny_trainable_qwen3: Path, make_config,
                                                                          tmp_path: Path) -> None:
    sft = train_sft(make_config("sft", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=1", "trainer.batch_size=2",
                                "eval.every_steps=0", f"checkpoint.folder={tmp_path / 'own'}"), Recorder()).checkpoint
    assert sft is not None
    config = make_config("grpo", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=1", "trainer.batch_size=2",
                         "grpo.group_size=2", f"checkpoint.folder={tmp_path / 'own'}", "checkpoint.resume_latest=true")
    assert {e.field: e.message for e in preflight_errors(config)} == {"checkpoint.folder": (
        f"{sft} holds an SFT run's checkpoint, and a GRPO run resumes only its own recipe's; to start it from these "
        f"weights, export them (python -m workers.engine export --checkpoint {sft} --out DIR) and set model.path to DIR "
        "(on the platform: model.artifact=run:<id>@step:<step>)")}
    with pytest.raises(ConfigError):
        train_grpo(config, Recorder())
    assert preflight_errors(config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"resume_latest": False})})) == [], "without the switch the folder is only written to"


def _cut_short(folder: Path, step: int) -> Path:
    """What a save that a kill stopped mid-way leaves: a temp folder with a half-written trainer.pt."""
    tmp = folder / f".tmp_step_{step:06d}"
    tmp.mkdir(parents=True)
    (tmp / "trainer.pt").write_bytes(b"half")
    return tmp


def test_a_save_removes_this_runs_unfinished_saves_and_leaves_later_ones(tmp_path: Path) -> None:
    # they stayed until their own step was saved again: a run killed mid-save and resumed from an earlier
    # checkpoint kept one for good when its next saves fell on other steps
    folder = tmp_path / "checkpoints"
    for step in (1, 3, 4, 9):
        _cut_short(folder, step)
    assert list_checkpoints(folder) == []
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(folder)

    _save(folder, 2, keep_last=5)
    assert sorted(p.name for p in folder.iterdir()) == [".tmp_step_000003", ".tmp_step_000004", ".tmp_step_000009",
                                                        "step_000002"]
    _save(folder, 4, keep_last=5)  # its own temp folder, and the one of step 3 a kill left
    assert sorted(p.name for p in folder.iterdir()) == [".tmp_step_000009", "step_000002", "step_000004"], \
        "step 9's may be another run's save, being written now"
    assert list_checkpoints(folder) == [folder / "step_000002", folder / "step_000004"]


def test_an_unfinished_save_is_never_resumed(tiny_qwen3: Path, make_config, tmp_path: Path) -> None:
    # named as checkpoint.resume_from it was a step folder like any other, and torch.load met its half a file
    folder = tmp_path / "checkpoints"
    tmp = _cut_short(folder, 3)
    (tmp / "checkpoint.json").write_text(json.dumps({"recipe": "sft", "step": 3}))
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp)
    named = make_config("sft", tiny_qwen3, *ARITHMETIC, f"checkpoint.resume_from={tmp}")
    assert {e.field: e.message for e in preflight_errors(named)} == {
        "checkpoint.resume_from": f"{tmp} holds no checkpoint (a step_N folder, or a folder of them)"}
    latest = make_config("sft", tiny_qwen3, *ARITHMETIC, f"checkpoint.folder={folder}", "checkpoint.resume_latest=true")
    assert preflight_errors(latest) == [] and with_resume_point(latest) == latest, "a folder without one: step 0"
