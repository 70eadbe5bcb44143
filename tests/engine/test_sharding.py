"""The unsharded side of `sharding.py` and the pipelined step's pieces, in one process: optimizer state
keyed by index or by name, and the errors of a state or a step that does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.engine.batching import collate_rollouts
from workers.engine.config import GrpoConfig, OptimizerConfig
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.grpo_math import accumulate_gradients
from workers.engine.replay_buffer import RolloutBatchRecord, concat_records
from workers.engine.sharding import full_optimizer_state, load_full_state, optimizer_state_for
from workers.engine.training import build_optimizer


def _stepped(folder: Path):
    model = load_pretrained(folder).model.train()
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    model(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_by_name_and_back_by_index(tiny_qwen3: Path) -> None:
    model, optimizer = _stepped(tiny_qwen3)
    by_index = full_optimizer_state(model, optimizer)  # unsharded: optimizer.state_dict()
    by_name = optimizer_state_for(model, optimizer, by_index, by_name=True)
    names = [name for name, _ in model.named_parameters()]
    assert by_name["param_groups"][0]["params"] == names and set(by_name["state"]) <= set(names)
    back = optimizer_state_for(model, optimizer, by_name, by_name=False)
    assert back["param_groups"] == by_index["param_groups"] and back["state"].keys() == by_index["state"].keys()
    assert optimizer_state_for(model, optimizer, by_index, by_name=False) is by_index  # already keyed that way

    fresh = load_pretrained(tiny_qwen3).model.train()
    fresh_optimizer = build_optimizer(fresh, OptimizerConfig(lr=1e-2))
    load_full_state(fresh, fresh_optimizer, model_state=model.state_dict(), optimizer_state=by_name)
    for index, moments in fresh_optimizer.state_dict()["state"].items():
        torch.testing.assert_close(moments["exp_avg"], by_index["state"][index]["exp_avg"])


def test_optimizer_state_of_another_model_is_refused(tiny_qwen3: Path) -> None:
    model, optimizer = _stepped(tiny_qwen3)
    state = optimizer.state_dict()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="does not match this model's parameters"):
        optimizer_state_for(model, optimizer, state, by_name=True)


def test_passes_beyond_the_rows_need_a_filler(tiny_qwen3: Path) -> None:
    model = load_pretrained(tiny_qwen3).model.train()
    batch = collate_rollouts([[1, 2]], [[3, 4]], [[-1.0, -1.0]], [1.0], pad_id=0)
    with pytest.raises(ValueError, match="need a filler row"):
        accumulate_gradients(model, batch, grpo=GrpoConfig(), temperature=1.0, micro_batch_size=1, normalizer=1.0,
                             passes=2, sync=False)


def test_chunks_of_different_policy_versions_are_not_one_step() -> None:
    def record(version: int) -> RolloutBatchRecord:
        return RolloutBatchRecord(prompts=[[1]], responses=[[2]], logprobs=[[-1.0]], rewards=[1.0], advantages=[0.0],
                                  policy_version=version, prompt_texts=["p"], response_texts=["r"],
                                  reward_parts={"exact_math": [1.0]}, sample_ids=[f"s{version}"])

    merged = concat_records([record(3), record(3)])
    assert (len(merged), merged.sample_ids, merged.reward_parts) == (2, ["s3", "s3"], {"exact_math": [1.0, 1.0]})
    with pytest.raises(ValueError, match="policy versions \\[3, 4\\]"):
        concat_records([record(3), record(4)])
