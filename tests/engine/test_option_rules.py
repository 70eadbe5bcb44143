"""Options that would do nothing where they are set are refused at validation, naming the field and the reason;
a value equal to its default is not (a snapshot's full dump writes every field)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.config import ConfigError, config_to_yaml, load_config
from workers.engine.training import build_optimizer, single_process_device

GRPO = "recipe: grpo\nmodel: {path: /x}\n"
MONARCH = "placement.backend=monarch"


def _errors(*overrides: str, text: str = GRPO) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(text, overrides=list(overrides))
    return {e.field: e.message for e in caught.value.errors}


def test_a_buffer_that_cannot_hold_max_policy_age_plus_one_batches_is_refused() -> None:
    small = ("grpo.mode=async", "grpo.max_policy_age=1", "trainer.batch_size=2", "grpo.group_size=2")
    message = _errors(*small, "replay_buffer.capacity=1")["replay_buffer.capacity"]
    assert "2 batches of 4 rollouts" in message and "at least 8" in message
    assert "replay_buffer.capacity" in _errors(*small, "replay_buffer.capacity=7", MONARCH)
    assert load_config(GRPO, overrides=[*small, "replay_buffer.capacity=8"]).replay_buffer.capacity == 8
    # sync: one batch, and the buffer always holds one whatever its capacity
    assert load_config(GRPO, overrides=["replay_buffer.capacity=1"]).replay_buffer.capacity == 1


def test_max_policy_age_outside_async_mode_is_refused() -> None:
    assert "grpo.mode: async" in _errors("grpo.max_policy_age=2")["grpo.max_policy_age"]
    assert load_config(GRPO, overrides=["grpo.mode=sync", "grpo.max_policy_age=0"]).grpo.max_policy_age == 0
    assert load_config(GRPO, overrides=["grpo.mode=async", "grpo.max_policy_age=2"]).grpo.max_policy_age == 2


def test_failover_off_monarch_is_refused_per_field() -> None:
    errors = _errors("failover.max_retries=5", "failover.warm_spares=1")
    assert set(errors) == {"failover.max_retries", "failover.warm_spares"}
    assert "placement.backend: monarch" in errors["failover.max_retries"]
    assert "failover.call_timeout_s" in _errors("failover.call_timeout_s=10", text="recipe: sft\nmodel: {path: /x}\n")
    assert load_config(GRPO, overrides=[MONARCH, "failover.max_retries=5"]).failover.max_retries == 5


def test_the_trainers_setup_timeout_is_bounded_and_read_only_where_a_monarch_trainer_starts() -> None:
    """failover.setup_timeout_s bounds a Monarch trainer's set-up (GRPO's or SFT's): refused off Monarch like every
    failover option, and outside its bounds with the field named."""
    sft = "recipe: sft\nmodel: {path: /x}\n"
    assert load_config(GRPO, overrides=[MONARCH]).failover.setup_timeout_s == 1800.0
    assert load_config(sft, overrides=[MONARCH, "failover.setup_timeout_s=600"]).failover.setup_timeout_s == 600.0
    assert load_config(GRPO, overrides=[MONARCH, "failover.setup_timeout_s=60"]).failover.setup_timeout_s == 60.0
    assert "placement.backend: monarch" in _errors("failover.setup_timeout_s=600")["failover.setup_timeout_s"]
    assert "placement.backend: monarch" in _errors("failover.setup_timeout_s=600", text=sft)["failover.setup_timeout_s"]
    for bad in ("0", "-5", "100000", "soon"):
        assert set(_errors(MONARCH, f"failover.setup_timeout_s={bad}")) == {"failover.setup_timeout_s"}


def test_full_dumps_of_default_configs_still_validate() -> None:
    for text in (GRPO, "recipe: sft\nmodel: {path: /x}\n"):
        config = load_config(text, overrides=["trainer.optimizer.name=sgd"])
        assert load_config(config_to_yaml(config)) == config


def test_adamw_betas_are_set_and_used_and_refused_for_sgd() -> None:
    config = load_config(GRPO, overrides=["trainer.optimizer.betas=[0.8, 0.99]"])
    optimizer = build_optimizer(nn.Linear(2, 2), config.trainer.optimizer)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    default = build_optimizer(nn.Linear(2, 2), load_config(GRPO).trainer.optimizer)
    assert default.param_groups[0]["betas"] == (0.9, 0.95)
    assert "sgd has none" in _errors("trainer.optimizer.name=sgd", "trainer.optimizer.betas=[0.8, 0.99]")[
        "trainer.optimizer.betas"]
    assert "trainer.optimizer.betas.1" in _errors("trainer.optimizer.betas=[0.9, 1.0]")


def test_a_trainer_gpu_in_one_process_is_a_gpu_or_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="placement.trainer.gpus_per_proc"):
        single_process_device(load_config(GRPO, overrides=["placement.trainer.gpus_per_proc=1"]))
    assert single_process_device(load_config(GRPO)) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert single_process_device(load_config(GRPO, overrides=["placement.trainer.gpus_per_proc=1"])).type == "cuda"


def test_update_correction_and_shaping_options_are_refused_where_they_do_nothing() -> None:
    pipelined = ("grpo.mode=pipelined", MONARCH)
    errors = _errors(*pipelined, "grpo.epochs=2", "grpo.mini_batches=2")
    assert "one optimizer step as the chunks come in" in errors["grpo.epochs"] and "grpo.mini_batches" in errors
    too_many = _errors("trainer.batch_size=2", "grpo.group_size=2", "grpo.mini_batches=5")["grpo.mini_batches"]
    assert "4 sequences" in too_many
    assert "kl_coef > 0" in _errors("grpo.kl_in=reward")["grpo.kl_in"]
    assert "set mode: mask" in _errors("grpo.rollout_correction.threshold_low=0.3")["grpo.rollout_correction.threshold_low"]
    assert "does not refill" in _errors("grpo.dynamic_sampling.max_rounds=2", MONARCH)["grpo.dynamic_sampling"]
    assert "penalty_tokens" in _errors("grpo.overlong.penalty_factor=0.5")["grpo.overlong.penalty_factor"]
    assert "(16)" in _errors("grpo.overlong.penalty_tokens=17")["grpo.overlong.penalty_tokens"]
    assert "grpo.rollout_correction.threshold" in _errors("grpo.rollout_correction.threshold=1.0")  # C must exceed 1

    accepted = load_config(GRPO, overrides=[
        "grpo.epochs=2", "grpo.mini_batches=4", "reference.enabled=true", "grpo.kl_coef=0.05", "grpo.kl_in=reward",
        "grpo.rollout_correction.mode=mask", "grpo.rollout_correction.threshold_low=0.3",
        "grpo.dynamic_sampling.max_rounds=2", "grpo.overlong.penalty_tokens=4", "grpo.overlong.filter=true",
        "trainer.optimizer.lr=0"])
    assert accepted.grpo.updates_per_step == 8 and accepted.grpo.rollout_correction.low == 0.3
    assert accepted.trainer.optimizer.lr == 0.0  # a control run
    assert load_config(GRPO, overrides=["grpo.rollout_correction.mode=mask"]).grpo.rollout_correction.low == 0.5
    assert load_config(config_to_yaml(accepted)).grpo == accepted.grpo  # a full dump validates again


def test_a_generator_in_the_trainers_procs_refuses_what_configures_generator_procs() -> None:
    in_trainer = (MONARCH, "generator.in_trainer=true")
    config = load_config(GRPO, overrides=list(in_trainer))
    assert config.role_processes()["generator"] == 0 and config.role_processes()["trainer"] == 1
    assert load_config(config_to_yaml(config)) == config, "a full dump (placement.generator.hosts: []) still validates"
    assert "placement.backend: monarch" in _errors("generator.in_trainer=true")["generator.in_trainer"]
    for mode in ("async", "pipelined"):
        assert "grpo.mode: sync" in _errors(*in_trainer, f"grpo.mode={mode}")["generator.in_trainer"], mode
    assert "generator.backend: torch" in _errors(*in_trainer, "generator.backend=vllm")["generator.in_trainer"]
    assert "trainer.sharding: replicate" in _errors(*in_trainer, "trainer.sharding=fsdp", "trainer.ranks=2")[
        "generator.in_trainer"]
    errors = _errors(*in_trainer, "generator.replicas=2", "generator.routing=sticky", "placement.generator.hosts=[a]",
                     "placement.generator.gpus_per_proc=1")
    assert {"generator.replicas", "generator.routing", "placement.generator.hosts",
            "placement.generator.gpus_per_proc"} <= set(errors)
    assert "place the trainer" in errors["placement.generator.hosts"]
    assert "colocate_with: trainer" in _errors(*in_trainer, "placement.reward.colocate_with=generator")[
        "placement.reward.colocate_with"]
    assert load_config(GRPO, overrides=[*in_trainer, "placement.reward.colocate_with=trainer"]).placement.reward.colocate_with \
        == "trainer"
    drill = "drills=[{kind: kill, role: generator, replica: 0, schedule: {at_step: 2}}]"
    assert "drill the trainer" in _errors(*in_trainer, drill)["drills.0.role"]
    assert load_config(GRPO, overrides=[MONARCH, drill]).drills[0].role == "generator", "with generator procs: allowed"


SFT = "recipe: sft\nmodel: {path: /x}\n"


def test_grpo_options_on_an_sft_run_are_refused_down_to_the_nested_field() -> None:
    errors = _errors("grpo.loss=cispo", "grpo.overlong.penalty_tokens=4", "grpo.dynamic_sampling.max_rounds=2",
                     "generator.temperature=0.7", "generator.routing=sticky", "reference.enabled=true",
                     "replay_buffer.capacity=64", text=SFT)
    assert set(errors) == {"grpo.loss", "grpo.overlong.penalty_tokens", "grpo.dynamic_sampling",
                           "generator.temperature", "generator.routing", "reference.enabled", "replay_buffer.capacity"}
    assert all("recipe: sft" in message for message in errors.values())
    # what an SFT run reads: its held-out eval's max_new_tokens and reward functions
    config = load_config(SFT, overrides=["generator.max_new_tokens=32", "reward.functions=[exact_math, format]"])
    assert config.generator.max_new_tokens == 32
    assert load_config(config_to_yaml(config)) == config, "a full dump writes every GRPO default, and validates"


def test_generator_routing_on_the_local_recipe_is_refused() -> None:
    assert "placement.backend: monarch" in _errors("generator.routing=sticky")["generator.routing"]
    assert load_config(GRPO, overrides=[MONARCH, "generator.replicas=2", "generator.routing=sticky"]).generator.routing \
        == "sticky"
