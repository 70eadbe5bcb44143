"""A model folder a generator or reference proc refuses (its weights do not fit its config.json): on real Monarch procs
the actor is built, and its pid call (the controller's sign that it started) raises model.path's ConfigError, which
reaches the controller itself inside Monarch's ActorError, where a constructor's exception failed the actor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.engine.fields import ConfigError


def _misfit_model(tiny_qwen3: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model whose final norm's weight is of another size than its config.json says."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, "model.norm.weight": torch.zeros(3)}, str(model / "model.safetensors"))
    return model


def _refusal(model: Path) -> str:
    return f"model.path: {model}: the weights do not fit the model config.json describes: norm.weight is [3], not [64]"


@pytest.mark.slow
def test_a_generator_or_reference_proc_that_refuses_the_model_folder_says_model_paths_error(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    # each was a SupervisionError ("The actor ... and all its descendants have failed: ... ConfigError: ...", the
    # text only) and an unhandled fault report
    from monarch.actor import ActorError

    from workers.engine.actors.generator import GeneratorActor
    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.reference import ReferenceActor
    from workers.engine.controller.attach import collect_fault_reports

    model = _misfit_model(tiny_qwen3, tmp_path)
    refusal = _refusal(model)
    reports = collect_fault_reports()
    procs = spawn_procs(1, threads=1)
    try:
        for name, actor in (("generator", GeneratorActor), ("reference", ReferenceActor)):
            with pytest.raises(ActorError) as refused:
                procs.spawn(name, actor, str(model), "float32", "cpu").pid.call_one().get(timeout=120)
            assert isinstance(refused.value.exception, ConfigError), refused.value
            assert [str(e) for e in refused.value.exception.errors] == [refusal]
            assert procs.spawn(f"{name}_whole", actor, str(tiny_qwen3), "float32", "cpu").pid.call_one().get(
                timeout=120) > 0, "a whole folder's actor answers with its pid"
        assert reports == [], "no actor failed"
    finally:
        procs.stop().get()


@pytest.mark.slow
def test_a_reward_proc_that_refuses_the_model_folders_tokenizer_says_model_paths_error(tiny_qwen3: Path,
                                                                                      tmp_path: Path) -> None:
    # it was a SupervisionError from reward_0_1.pid() (the ValueError's text only) and an unhandled fault report
    from monarch.actor import ActorError

    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.reward import RewardActor
    from workers.engine.config import OverlongConfig
    from workers.engine.controller.attach import collect_fault_reports

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    (model / "generation_config.json").write_text('{"eos_token_id": "x"}')
    reports = collect_fault_reports()
    procs = spawn_procs(1, threads=1)
    try:
        with pytest.raises(ActorError) as refused:
            procs.spawn("reward", RewardActor, str(model), ["exact_math"], None, True, OverlongConfig(), 4).pid \
                .call_one().get(timeout=120)
        assert isinstance(refused.value.exception, ConfigError), refused.value
        assert [str(e) for e in refused.value.exception.errors] == [
            f'model.path: {model}: generation_config.json eos_token_id: a token id from 0 to 258, or a list of them, '
            'got "x"']
        assert procs.spawn("reward_whole", RewardActor, str(tiny_qwen3), ["exact_math"], None, True, OverlongConfig(),
                           4).pid.call_one().get(timeout=120) > 0, "a whole folder's actor answers with its pid"
        assert reports == [], "no actor failed"
    finally:
        procs.stop().get()


@pytest.mark.slow
def test_a_monarch_grpo_run_whose_procs_refuse_the_model_folder_ends_with_model_paths_error(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    # preflight reads no weights: the trainer ranks, the generator and the reference each refuse them; it ended with
    # the first to answer's raw error (a SupervisionError from generator_0_1.pid() on the old code)
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    model = _misfit_model(tiny_qwen3, tmp_path)
    config = load_config(f"recipe: grpo\nmodel: {{path: '{model}'}}\n", overrides=[
        "data.max_operand=20", "data.eval_size=8", "trainer.batch_size=2", "grpo.group_size=2",
        "generator.max_new_tokens=4", "eval.every_steps=0", "telemetry.console=false", "trainer.threads_per_process=1",
        "placement.backend=monarch", "trainer.steps=1", "reference.enabled=true", f"checkpoint.folder={tmp_path / 'ck'}"])
    with pytest.raises(ConfigError) as refused:
        train_grpo_monarch(config, Recorder())
    assert [str(e) for e in refused.value.errors] == [_refusal(model)]


@pytest.mark.slow
def test_a_vllm_generator_proc_that_refuses_the_model_folder_says_model_paths_error(tiny_qwen3: Path,
                                                                                    tmp_path: Path) -> None:
    # vLLM read the folder itself: its error reached the controller as a SupervisionError's text only, and a
    # replacement on a folder changed mid-run counted as one more failure until failover.max_replacements
    from monarch.actor import ActorError

    from workers.engine.actors.procs import spawn_procs
    from workers.engine.actors.vllm_generator import VllmGeneratorActor, vllm_proc_env
    from workers.engine.controller.attach import collect_fault_reports

    model = _misfit_model(tiny_qwen3, tmp_path)
    reports = collect_fault_reports()
    vllm_proc_env()
    procs = spawn_procs(1, threads=1)
    try:
        with pytest.raises(ActorError) as refused:
            procs.spawn("vllm_generator", VllmGeneratorActor, str(model), "float32", 64).pid.call_one().get(timeout=120)
        assert isinstance(refused.value.exception, ConfigError), refused.value
        assert [str(e) for e in refused.value.exception.errors] == [_refusal(model)]
        assert reports == [], "no actor failed"
    finally:
        procs.stop().get()
