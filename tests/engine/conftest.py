"""Shared fixtures: tiny random Qwen3 / Llama3 HF folders built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import workers.engine.actors  # noqa: F401 - before any monarch import: dead procs are noticed within ~1 s
import torch

torch.set_num_threads(1)  # 2 cores shared with other test suites: more threads spin and stall


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3", init_scale=3.0)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), family="llama3", init_scale=3.0)


@pytest.fixture(scope="session")
def tiny_trainable_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Default init (not sharpened): the starting point of training tests."""
    from workers.engine.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-train"), family="qwen3")


@pytest.fixture
def make_config(tmp_path: Path):
    """make_config(recipe, model_folder, "section.key=value", ...) -> RunConfig writing under tmp_path."""
    from workers.engine.config import RunConfig, load_config

    def make(recipe: str, model: Path, *overrides: str) -> RunConfig:
        base = (
            f"recipe: {recipe}\n"
            f"model: {{path: '{model}'}}\n"
            f"checkpoint: {{folder: '{tmp_path / 'checkpoints'}'}}\n"
            "telemetry: {console: false}\n"
            "trainer: {threads_per_process: 1}\n"
        )
        return load_config(base, overrides=list(overrides))

    return make


# The warm start of every GRPO test: a tiny Qwen3 after a short SFT on a+b (operands up
# to 20), exported as an HF folder. Its greedy held-out accuracy lands between 0.2 and
# 0.7, so GRPO has a learning signal and room to improve.
ARITHMETIC = ("data.max_operand=20", "data.eval_size=128", "generator.max_new_tokens=6")


@pytest.fixture(scope="session")
def sft_warm_start(tiny_trainable_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """(HF folder of the SFT'd model, its held-out greedy accuracy)."""
    from workers.engine.models.hf_folder import export_hf
    from workers.engine.config import load_config
    from workers.engine.metrics import Recorder
    from workers.engine.recipes.sft import train_sft

    root = tmp_path_factory.mktemp("sft-warm-start")
    config = load_config(
        f"recipe: sft\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n",
        overrides=[
            *ARITHMETIC, "data.seq_len=256", "trainer.steps=240", "trainer.batch_size=32", "trainer.micro_batch_size=8",
            "trainer.optimizer.lr=3e-3", "trainer.optimizer.warmup_steps=10", "trainer.threads_per_process=1",
            "eval.every_steps=240", f"checkpoint.folder={root / 'checkpoints'}", "telemetry.console=false",
        ],
    )
    result = train_sft(config, Recorder())
    assert result.checkpoint is not None and result.eval is not None
    return export_hf(result.checkpoint, root / "hf"), result.eval.accuracy


@pytest.fixture(scope="session")
def monarch_mode_runs(tiny_trainable_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """mode -> (GrpoResult, MemorySink) of one small Monarch GRPO run per mode (sync, async, pipelined), the same
    config otherwise: one trainer rank, one generator replica, 6 steps. The random model's completions run to
    max_new_tokens, so every mode trains on as many tokens per step."""
    from workers.engine.config import load_config
    from workers.engine.metrics import MemorySink, Recorder
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    runs = {}
    for mode, extra in {"sync": [], "async": ["grpo.max_policy_age=1"], "pipelined": ["grpo.pipeline_chunks=4"]}.items():
        root = tmp_path_factory.mktemp(f"monarch-{mode}")
        config = load_config(f"recipe: grpo\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n", overrides=[
            *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=1", "generator.replicas=1",
            f"grpo.mode={mode}", *extra, "trainer.steps=6", "trainer.batch_size=8", "trainer.micro_batch_size=16",
            "grpo.group_size=4", "eval.every_steps=0", f"checkpoint.folder={root / 'checkpoints'}",
            "telemetry.console=false", "trainer.threads_per_process=1",
        ])
        sink = MemorySink()
        runs[mode] = (train_grpo_monarch(config, Recorder([sink])), sink)
    return runs


TCP_FIRST = ("test_monarch_hosts.py", "test_monarch_sft_hosts.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Monarch's transport is chosen once per process, by its first call. The multi-host runs need TCP
    (to reach worker processes), so they go before every other Monarch test, whose first call would
    otherwise choose Unix sockets for the rest of the session."""
    first = [item for item in items if item.path.name in TCP_FIRST]
    items[:] = first + [item for item in items if item.path.name not in TCP_FIRST]


def recorded_timelines(sink: Any) -> list[dict[str, Any]]:
    """The payloads of a MemorySink's step_timeline events as the control plane takes them (a `StepTimeline` each)."""
    from workers.engine.control_plane import record_to_wire
    from workers.engine.telemetry_wire import WireEvent

    return [WireEvent.model_validate(record_to_wire(r)[1]).payload for r in sink.events("step_timeline")]


def phases_on(timeline: dict[str, Any], lane: str) -> set[str]:
    index = timeline["lanes"].index(lane)
    return {phase for at, phase, _, _ in timeline["spans"] if at == index}
