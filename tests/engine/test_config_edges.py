"""Configs at the edges their schema allows, each of which once validated and then ended in a traceback: now refused
at validation or preflight, naming the field and why."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.support.unprivileged import call_as, copy_readable, folder_for, suite_is_root, unprivileged_uid
from workers.engine.config import MAX_REWARD_WEIGHT, MAX_THREADS_PER_PROCESS, ConfigError, load_config
from workers.engine.preflight import preflight_errors, preflight_report
from workers.engine.tasks import jsonl_chat

GRPO = "recipe: grpo\nmodel: {path: /x}\n"


def _field_errors(config_text: str, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(config_text, overrides=list(overrides))
    return {e.field: e.message for e in caught.value.errors}


def _preflight(model: Path, *overrides: str, recipe: str = "grpo") -> dict[str, str]:
    config = load_config(f"recipe: {recipe}\nmodel: {{path: '{model}'}}\n", overrides=list(overrides))
    return {e.field: e.message for e in preflight_errors(config)}


def _report(model: Path, *overrides: str, recipe: str = "sft") -> tuple[list[str], list[str]]:
    """(errors, warnings), each `field: message`: several can name one field."""
    config = load_config(f"recipe: {recipe}\nmodel: {{path: '{model}'}}\n", overrides=list(overrides))
    report = preflight_report(config)
    return [str(e) for e in report.errors], [str(e) for e in report.warnings]


def _warnings(model: Path, *overrides: str, recipe: str = "sft") -> list[str]:
    errors, warnings = _report(model, *overrides, recipe=recipe)
    assert errors == []
    return warnings


def test_threads_per_process_stops_at_more_cores_than_a_host_has() -> None:
    # 2**31 - 1 threads validated, then OpenMP tried to allocate 432 GiB and the run died without a field
    assert "trainer.threads_per_process" in _field_errors(GRPO, "trainer.threads_per_process=2147483647")
    config = load_config(GRPO, overrides=[f"trainer.threads_per_process={MAX_THREADS_PER_PROCESS}"])
    assert config.trainer.threads_per_process == MAX_THREADS_PER_PROCESS


@pytest.mark.parametrize("weights", ["[.nan]", "[.inf]", "[-.inf]", "[1e308, 1e308]"])
def test_reward_weights_are_finite(weights: str) -> None:
    # each validated; the combined reward was nan or inf, so were the advantages and, after one update, the model's
    # weights: the second step's sampler stopped with 'no token to draw' (a traceback)
    functions = "reward.functions=[exact_math, format]" if "," in weights else "reward.functions=[exact_math]"
    errors = _field_errors(GRPO, functions, f"reward.weights={weights}")
    assert set(errors) <= {"reward.weights.0", "reward.weights.1"} and errors


def test_reward_weights_keep_their_range() -> None:
    config = load_config(GRPO, overrides=["reward.functions=[exact_math, format]",
                                          f"reward.weights=[{-MAX_REWARD_WEIGHT}, {MAX_REWARD_WEIGHT}]"])
    assert config.reward.weights == [-MAX_REWARD_WEIGHT, MAX_REWARD_WEIGHT]


def test_a_gpu_this_host_lacks_is_refused_before_a_single_process_run(tiny_qwen3: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # trainer.device=cuda on a host without CUDA passed preflight and raised from the recipe's setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    errors = _preflight(tiny_qwen3, "trainer.device=cuda", "placement.trainer.gpus_per_proc=1")
    assert errors == {"trainer.device": "this host has no CUDA device: set it to cpu or auto",
                      "placement.trainer.gpus_per_proc": "this host has no CUDA device: set it to 0"}
    assert "trainer.device" not in _preflight(tiny_qwen3, "trainer.device=cuda", "placement.backend=monarch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "trainer.device" not in _preflight(tiny_qwen3, "trainer.device=cuda")


def test_a_prompt_longer_than_max_prompt_tokens_is_refused_with_where_it_comes_from(tiny_qwen3: Path,
                                                                                    tmp_path: Path) -> None:
    # The first step that drew such a prompt raised ValueError (a traceback); the eval never checked it at all.
    # The tiny model's byte tokenizer and chat template make '20+20=' a prompt of 25 tokens.
    errors = _preflight(tiny_qwen3, "data.max_operand=20", "data.max_prompt_tokens=24")
    assert errors == {"data.max_prompt_tokens": "24 is shorter than a prompt of 25 tokens (data.max_operand 20: "
                                                "'20+20=', in the chat template)"}
    assert _preflight(tiny_qwen3, "data.max_operand=20", "data.max_prompt_tokens=25") == {}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": text, "answer": "2", "response": "2"}) for text in ("1+1=", "", "x" * 300, "1+1=")))
    errors = _preflight(tiny_qwen3, "data.source=jsonl", f"data.path={rows}", "data.eval_size=1")
    assert errors == {"data.max_prompt_tokens": "64 is shorter than a prompt of 319 tokens (data.path line 3, in the "
                                                "chat template)"}
    # SFT truncates its sequences at data.seq_len instead; its one held-out example (line 3) then has nothing to score
    assert _preflight(tiny_qwen3, "data.source=jsonl", f"data.path={rows}", "data.eval_size=1", "eval.every_steps=0",
                      recipe="sft") == {}
    assert _preflight(tiny_qwen3, "data.source=jsonl", f"data.path={rows}", "data.eval_size=1", recipe="sft") == {
        "data.seq_len": "256 cuts off every held-out example's whole response: their prompts are 319 tokens (in the "
                        "chat template), so eval/nll would score nothing (or set eval.every_steps: 0)"}


def test_a_tokenizer_that_cannot_load_is_a_model_path_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    broken = tmp_path / "model"
    broken.mkdir()
    for item in tiny_qwen3.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "tokenizer.json").write_text("{}")
    assert _preflight(broken)["model.path"].startswith("cannot load its tokenizer (")


def test_what_the_run_writes_or_resumes_from_is_checked_before_it_starts(tiny_qwen3: Path, tmp_path: Path) -> None:
    # each validated; a checkpoint folder that is a file failed at the first save (the run's end, its training lost),
    # a telemetry file that is a folder when its sink opened, a resume folder without a checkpoint when it loaded
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert _preflight(tiny_qwen3, f"checkpoint.folder={a_file}") == {
        "checkpoint.folder": f"{a_file} is a file: name a folder"}
    assert _preflight(tiny_qwen3, f"checkpoint.folder={a_file / 'ckpt'}") == {
        "checkpoint.folder": f"{a_file} is a file: {a_file / 'ckpt'} cannot be made inside it"}
    assert _preflight(tiny_qwen3, f"telemetry.jsonl_path={tmp_path}") == {
        "telemetry.jsonl_path": f"{tmp_path} is a folder: name a file"}
    empty = tmp_path / "checkpoints"
    (empty / "step_000002").mkdir(parents=True)  # a folder name, not a complete checkpoint
    assert _preflight(tiny_qwen3, f"checkpoint.resume_from={empty}") == {
        "checkpoint.resume_from": f"{empty} holds no checkpoint (a step_N folder, or a folder of them)"}
    assert _preflight(tiny_qwen3, f"checkpoint.resume_from={a_file}") == {
        "checkpoint.resume_from": f"{a_file} is a file: name a checkpoint folder (a step_N folder, or a folder of them)"}
    (empty / "step_000002" / "trainer.pt").write_bytes(b"")
    (empty / "step_000002" / "checkpoint.json").write_text('{"recipe": "grpo", "step": 2}')
    fine = (f"checkpoint.folder={tmp_path / 'new' / 'ckpt'}", f"telemetry.jsonl_path={tmp_path / 'new' / 'm.jsonl'}")
    assert _preflight(tiny_qwen3, *fine, f"checkpoint.resume_from={empty}") == {}
    assert _preflight(tiny_qwen3, *fine, f"checkpoint.resume_from={empty / 'step_000002'}") == {}
    assert not (tmp_path / "new").exists(), "preflight makes nothing the run has not made yet"


@pytest.mark.parametrize("field, value, message", [
    ("checkpoint.folder", "/proc/x", "/proc/x cannot be made: nothing can be created in /proc ("),
    ("checkpoint.folder", "/sys/fb/ckpt", "/sys/fb/ckpt cannot be made: nothing can be created in /sys ("),
    ("checkpoint.folder", "/proc/self", "cannot write in /proc/self ("),
    ("telemetry.jsonl_path", "/proc/x.jsonl", "/proc/x.jsonl cannot be made: nothing can be created in /proc ("),
    ("telemetry.jsonl_path", "/proc/version", "cannot write to /proc/version ("),
])
def test_an_output_path_that_cannot_be_made_or_written_is_refused(tiny_qwen3: Path, field: str, value: str,
                                                                  message: str) -> None:
    # each validated; the run loaded the model, trained, and failed when it first wrote there (a checkpoint folder: at
    # its first save, the end of a run without checkpoint.every_steps). /proc and /sys refuse root too.
    errors = _preflight(tiny_qwen3, f"{field}={value}")
    assert list(errors) == [field] and errors[field].startswith(message)


def test_a_read_only_folder_is_refused_for_a_user(tiny_qwen3: Path) -> None:
    """A folder of the user's own that they may not write in (0o500): preflight says so, naming it. Root writes there,
    so under root (CI) the check runs in a child process that has dropped to `nobody`, who owns the folder and the
    model's copy, as a user running the engine would."""
    uid = unprivileged_uid()
    with folder_for(uid) as home:
        model = copy_readable(tiny_qwen3, home, uid=uid)
        locked = home / "locked"
        locked.mkdir(mode=0o500)
        if suite_is_root():
            os.chown(locked, uid, uid)
        inside = locked / "a" / "b"
        errors = {value: call_as(uid, _preflight, model, f"checkpoint.folder={value}") for value in (locked, inside)}
        assert list(errors[locked]) == ["checkpoint.folder"]
        assert errors[locked]["checkpoint.folder"].startswith(f"cannot write in {locked} (Permission denied")
        assert list(errors[inside]) == ["checkpoint.folder"]
        assert errors[inside]["checkpoint.folder"].startswith(
            f"{inside} cannot be made: nothing can be created in {locked} (Permission denied")
        assert list(locked.iterdir()) == []
        assert call_as(uid, _preflight, model, f"checkpoint.folder={home / 'ckpt'}") == {}, "its own folder is fine"


def test_a_writable_output_folder_is_left_as_it_was(tiny_qwen3: Path, tmp_path: Path) -> None:
    existing = tmp_path / "ckpt"
    existing.mkdir()
    log = tmp_path / "m.jsonl"
    log.write_text("kept\n")
    assert _preflight(tiny_qwen3, f"checkpoint.folder={existing}", f"telemetry.jsonl_path={log}") == {}
    assert list(existing.iterdir()) == [] and log.read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.jsonl"]


def test_an_sft_eval_that_would_generate_past_the_models_positions_is_refused(tiny_qwen3: Path) -> None:
    # generator.max_new_tokens=1023 validated for SFT (only data.seq_len was held to the 1024 positions); the held-out
    # eval before the first step generated past position 1023 and torchtitan's rope raised
    arithmetic = ("data.max_operand=20", "data.eval_size=8")
    assert _preflight(tiny_qwen3, *arithmetic, "generator.max_new_tokens=1023", recipe="sft") == {
        "generator.max_new_tokens": "the held-out eval generates 1023 tokens after prompts of up to 25: 1048 is longer "
                                    "than the model's 1024 positions"}
    assert _preflight(tiny_qwen3, *arithmetic, "generator.max_new_tokens=999", recipe="sft") == {}
    assert _preflight(tiny_qwen3, *arithmetic, "generator.max_new_tokens=1023", "eval.every_steps=0", recipe="sft") == {}


def test_an_sft_seq_len_that_cuts_off_every_response_is_refused_and_one_that_cuts_some_is_reported(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    # data.seq_len shorter than the prompts validated and trained on nothing, with loss 0: every example's response
    # lay past seq_len, so no target was a response token. The tiny model's chat template makes 'a+b=' 19 + 4..6 tokens.
    assert _report(tiny_qwen3, "data.seq_len=20") == ([
        "data.seq_len: 20 cuts off every training example's whole response: their prompts are 23 to 25 tokens (in "
        "the chat template), so the run would train on nothing, with loss 0",
        "data.seq_len: 20 cuts off every held-out example's whole response: their prompts are 23 to 25 tokens (in "
        "the chat template), so eval/nll would score nothing (or set eval.every_steps: 0)"], [])
    assert _warnings(tiny_qwen3, "data.seq_len=24") == [
        "data.seq_len: 104 of 377 training examples have prompts longer than 24 tokens (the longest: 25 tokens, "
        "'12+12='): their responses are cut off whole and train nothing",
        "data.seq_len: 17 of 64 held-out examples have prompts longer than 24 tokens (the longest: 25 tokens, "
        "'14+13='): eval/nll leaves them out, with none of their responses to score"]
    assert _warnings(tiny_qwen3, "data.seq_len=25") == []

    rows = tmp_path / "rows.jsonl"
    examples = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(8)]
    examples[2], examples[5] = {"prompt": "x" * 100, "response": "x"}, {"prompt": "y" * 120, "response": "y"}
    rows.write_text("\n".join(json.dumps(example) for example in examples) + "\n")
    jsonl = ("data.source=jsonl", f"data.path={rows}", "data.eval_size=1")
    assert _warnings(tiny_qwen3, *jsonl, "data.seq_len=64") == [
        "data.seq_len: 2 of 7 training examples have prompts longer than 64 tokens (the longest: 139 tokens, "
        "data.path line 6): their responses are cut off whole and train nothing"]
    assert _report(tiny_qwen3, *jsonl, "data.seq_len=16") == ([
        "data.seq_len: 16 cuts off every training example's whole response: their prompts are 23 to 139 tokens (in "
        "the chat template), so the run would train on nothing, with loss 0",
        "data.seq_len: 16 cuts off every held-out example's whole response: their prompts are 23 tokens (in the chat "
        "template), so eval/nll would score nothing (or set eval.every_steps: 0)"], [])
    assert _warnings(tiny_qwen3, *jsonl, "data.seq_len=139") == []


def test_an_sft_seq_len_that_cuts_off_held_out_examples_is_reported_and_one_that_cuts_them_all_refused(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    # a held-out example whose prompt filled data.seq_len dropped out of eval/nll without a word; when every one did,
    # eval/nll was 0 over no tokens at all, and read as a perfect score. Seed 0 holds out lines 8 and 9 of 10.
    rows = tmp_path / "rows.jsonl"
    examples = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(10)]
    examples[7] = {"prompt": "x" * 100, "response": "x"}  # 119 tokens in the chat template
    rows.write_text("\n".join(json.dumps(example) for example in examples) + "\n")
    jsonl = ("data.source=jsonl", f"data.path={rows}", "data.eval_size=2", "data.seq_len=64")
    assert _warnings(tiny_qwen3, *jsonl) == [
        "data.seq_len: 1 of 2 held-out examples have prompts longer than 64 tokens (the longest: 119 tokens, "
        "data.path line 8): eval/nll leaves them out, with none of their responses to score"]
    assert _warnings(tiny_qwen3, *jsonl, "eval.every_steps=0") == [], "no eval: nothing is left out of it"

    examples[8] = {"prompt": "y" * 120, "response": "y"}  # 139 tokens
    rows.write_text("\n".join(json.dumps(example) for example in examples) + "\n")
    assert _report(tiny_qwen3, *jsonl) == ([
        "data.seq_len: 64 cuts off every held-out example's whole response: their prompts are 119 to 139 tokens (in "
        "the chat template), so eval/nll would score nothing (or set eval.every_steps: 0)"], [])
    assert _report(tiny_qwen3, *jsonl, "eval.every_steps=0") == ([], [])


@pytest.mark.parametrize("recipe", ["grpo", "sft"])
def test_preflight_reads_the_data_file_once(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            recipe: str) -> None:
    # the data check, then GRPO's prompt lengths (or SFT's seq_len and eval checks) each read the file again
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "response": str(i + 1)})
                              for i in range(10)))
    reads: list[str] = []
    numbered = jsonl_chat.numbered_jsonl_problems

    def counted(path: str, **kwargs: object) -> object:
        reads.append(path)
        return numbered(path, **kwargs)

    monkeypatch.setattr(jsonl_chat, "numbered_jsonl_problems", counted)
    monkeypatch.setattr("workers.engine.tasks.build.numbered_jsonl_problems", counted)
    assert _preflight(tiny_qwen3, "data.source=jsonl", f"data.path={rows}", "data.eval_size=2", recipe=recipe) == {}
    assert reads == [str(rows)]
