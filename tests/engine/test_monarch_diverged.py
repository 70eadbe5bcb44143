"""The nan_gradients drill on a running Monarch GRPO or SFT run (real procs, the tiny Qwen3, two trainer ranks over
gloo): the drill makes trainer rank 1's gradients of its next update NaN, and every rank skips that update, the norm
being all-reduced (rank 0's results are the step's metrics, its weights the checkpoints').

  diverged  drills at steps 3 and 4, trainer.max_skipped_updates 2: the run ends as diverged at step 4
  recovers  one drill at step 3, the default limit: step 3's update is skipped (its checkpoint holds step 2's
            weights), step 4 trains again and the fault's one `recovered` says so; for GRPO, and for SFT (its own step
            loop, which tells the injector of the skipped update too)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.checkpoint_folders import STATE_FILE
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.training import UPDATE_SKIPPED, RunDiverged

pytestmark = pytest.mark.slow


def _drills(*steps: int) -> str:
    return "drills:\n" + "".join(f"  - {{kind: nan_gradients, role: trainer, replica: 1, schedule: {{at_step: {step}}}}}\n"
                                 for step in steps)


def _run(model: Path, root: Path, *, steps: int, drill_steps: tuple[int, ...], extra: tuple[str, ...] = ()):
    """(the GrpoResult or the error that ended the run, its records)."""
    from workers.engine.config import load_config
    from workers.engine.recipes.grpo_monarch import train_grpo_monarch

    config = load_config(f"recipe: grpo\nmodel: {{path: '{model}'}}\n{_drills(*drill_steps)}", overrides=[
        *ARITHMETIC, "data.eval_size=8", "placement.backend=monarch", "trainer.ranks=2", "generator.replicas=1",
        f"trainer.steps={steps}", "trainer.batch_size=4", "trainer.micro_batch_size=8", "grpo.group_size=4",
        "grpo.entropy_coef=0.01",  # a gradient whatever the rewards of the untrained model
        "eval.every_steps=0", f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=1",
        "checkpoint.keep_last=10", "telemetry.console=false", "trainer.threads_per_process=1", *extra,
    ])
    sink = MemorySink()
    try:
        outcome: Any = train_grpo_monarch(config, Recorder([sink]))
    except RunDiverged as diverged:
        outcome = diverged
    return outcome, sink.records


def _run_sft(model: Path, root: Path, *, steps: int, drill_steps: tuple[int, ...]):
    """(the SftResult, its records)."""
    from workers.engine.config import load_config
    from workers.engine.recipes.sft_monarch import train_sft_monarch

    config = load_config(f"recipe: sft\nmodel: {{path: '{model}'}}\n{_drills(*drill_steps)}", overrides=[
        "data.max_operand=20", "data.eval_size=8", "data.seq_len=64", "placement.backend=monarch", "trainer.ranks=2",
        f"trainer.steps={steps}", "trainer.batch_size=10", "trainer.micro_batch_size=2", "eval.every_steps=0",
        f"checkpoint.folder={root / 'checkpoints'}", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
        "telemetry.console=false", "trainer.threads_per_process=1",
    ])
    sink = MemorySink()
    return train_sft_monarch(config, Recorder([sink])), sink.records


def _metric(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["step"]: r["value"] for r in records if r["kind"] == "metric" and r["key"] == key}


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "event" and r["name"] == name]


def _skipped_messages(records: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in _events(records, "message") if "were NaN or infinite: its update was skipped" in r["text"]]


def _weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(root / "checkpoints" / f"step_{step:06d}" / STATE_FILE, weights_only=True)["model"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_nan_gradients_at_two_steps_in_a_row_end_the_run_as_diverged(tiny_trainable_qwen3: Path,
                                                                      tmp_path: Path) -> None:
    outcome, records = _run(tiny_trainable_qwen3, tmp_path, steps=6, drill_steps=(3, 4),
                            extra=("trainer.max_skipped_updates=2",))
    assert isinstance(outcome, RunDiverged), outcome
    assert "the run diverged" in outcome.heading
    assert "the gradients were NaN or infinite for 2 steps in a row from step 3: the run diverged" in str(outcome)
    assert _metric(records, UPDATE_SKIPPED) == {1: 0, 2: 0, 3: 1, 4: 1}, "rank 0 skipped rank 1's NaN updates"
    grad_norms = _metric(records, "grad_norm")
    assert all(math.isfinite(grad_norms[s]) for s in (1, 2)) and all(math.isnan(grad_norms[s]) for s in (3, 4))
    assert _skipped_messages(records) == [3], "the run page is told of step 3; step 4's is the run's error"
    injected = _events(records, "fault_injected")
    assert [(e["fault_kind"], e["role"], e["replica"], e["step"]) for e in injected] == \
        [("nan_gradients", "trainer", 1, 3), ("nan_gradients", "trainer", 1, 4)]
    assert _events(records, "recovered") == [], "the run ended in its error: no step trained again"


def test_one_nan_gradients_step_is_skipped_and_the_run_recovers_and_finishes(tiny_trainable_qwen3: Path,
                                                                             tmp_path: Path) -> None:
    result, records = _run(tiny_trainable_qwen3, tmp_path, steps=5, drill_steps=(3,))
    assert not isinstance(result, Exception), result
    assert result.step == 5
    assert [m[UPDATE_SKIPPED] for m in result.metrics] == [0, 0, 1, 0, 0]
    assert math.isnan(result.metrics[2]["grad_norm"]) and all(math.isfinite(m["loss"]) for m in result.metrics)
    _step_3_skipped_then_recovered_at_step_4(records, tmp_path)


def test_one_nan_gradients_step_of_an_sft_run_is_skipped_and_the_run_recovers_and_finishes(tiny_trainable_qwen3: Path,
                                                                                          tmp_path: Path) -> None:
    result, records = _run_sft(tiny_trainable_qwen3, tmp_path, steps=4, drill_steps=(3,))
    assert result.step == 4
    assert _metric(records, UPDATE_SKIPPED) == {1: 0, 2: 0, 3: 1, 4: 0}, "rank 0 skipped rank 1's NaN update"
    assert math.isnan(_metric(records, "grad_norm")[3]) and all(math.isfinite(loss) for loss in result.losses)
    _step_3_skipped_then_recovered_at_step_4(records, tmp_path)


def _step_3_skipped_then_recovered_at_step_4(records: list[dict], tmp_path: Path) -> None:
    """One nan_gradients drill at step 3 on rank 1: the run page told, step 2's weights kept, step 4 trained, and one
    `recovered` for the fault, at step 4, told by the step that trained again (not by the run's end)."""
    assert _skipped_messages(records) == [3]
    assert _same(_weights(tmp_path, 2), _weights(tmp_path, 3)), "step 3's update was skipped: step 2's weights"
    assert not _same(_weights(tmp_path, 3), _weights(tmp_path, 4)), "step 4 trained"
    [injected] = _events(records, "fault_injected")
    [recovered] = _events(records, "recovered")
    assert (recovered["fault_id"], recovered["fault_kind"], recovered["role"], recovered["replica"]) == \
        (injected["fault_id"], "nan_gradients", "trainer", 1)
    assert (recovered["step"], recovered["skipped_updates"], recovered["caused_failure"]) == (4, 1, False)
    assert "cut_short_by_run_end" not in recovered
