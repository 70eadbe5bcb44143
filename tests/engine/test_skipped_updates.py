"""A step whose gradients are NaN or infinite leaves the weights and the optimizer as they were (no clip, no step: the
update is skipped and recorded as `train/update_skipped`), the next good step trains, and trainer.max_skipped_updates
such steps in a row end the run as diverged."""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import workers.engine.grpo_math as grpo_math
import workers.engine.sft_math as sft_math
from tests.engine.conftest import ARITHMETIC
from workers.engine.config import OptimizerConfig
from workers.engine.data_parallel import apply_update
from workers.engine.fields import ConfigError
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.training import RunDiverged, build_optimizer, build_scheduler

SFT = (*ARITHMETIC, "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.optimizer.lr=3e-3",
       "eval.every_steps=0")
GRPO = (*ARITHMETIC, "trainer.batch_size=2", "trainer.micro_batch_size=64", "grpo.group_size=4", "eval.every_steps=0",
        "trainer.optimizer.lr=1e-3", "grpo.entropy_coef=0.01")  # a gradient whatever the rewards


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("grad_clip", [1.0, None])
def test_an_update_whose_gradient_is_not_finite_is_skipped_and_the_next_one_trains(bad: float,
                                                                                   grad_clip: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=2))
    scheduler = build_scheduler(optimizer, OptimizerConfig(lr=1e-2, warmup_steps=2), total_steps=10)
    before, warm_up_lr = _weights(model), scheduler.get_last_lr()[0]

    model(torch.randn(5, 4)).sum().backward()
    model[0].weight.grad[1, 2] = bad  # one value of one tensor: a clip would spread it (inf x 0 = NaN) over all
    applied = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)

    assert applied.skipped and not math.isfinite(applied.grad_norm) and applied.lr == warm_up_lr
    assert _same(before, _weights(model))
    assert all(param.grad is None for param in model.parameters())  # nothing of those gradients is kept
    assert optimizer.state == {}  # AdamW took no step: no moments, its step count not moved
    assert scheduler.last_epoch == 1  # the schedule steps on, as the run's step does

    model(torch.randn(5, 4)).sum().backward()
    applied = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)
    after = _weights(model)
    assert not applied.skipped and math.isfinite(applied.grad_norm) and applied.lr > warm_up_lr
    assert all(torch.isfinite(w).all() for w in after.values()) and not _same(before, after)
    assert all(int(s["step"]) == 1 for s in optimizer.state.values())


def test_a_first_update_skipped_steps_the_schedule_without_torchs_warning_and_keeps_its_learning_rates() -> None:
    """torch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when a schedule's first step comes
    before any optimizer step: here it is deliberate (a skipped update steps the schedule alone). The learning rates
    are those of a run whose updates all trained."""

    def learning_rates(skip_first: bool) -> tuple[list[float], list[str]]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        config = OptimizerConfig(lr=1e-2, warmup_steps=2, schedule="cosine")
        optimizer, lrs = build_optimizer(model, config), []
        scheduler = build_scheduler(optimizer, config, total_steps=6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for update in range(6):
                model(torch.randn(3, 4)).sum().backward()
                if skip_first and update == 0:
                    model.weight.grad[0, 0] = math.nan
                applied = apply_update(model, optimizer, scheduler, grad_clip=1.0)
                assert applied.skipped == (skip_first and update == 0)
                lrs.append(applied.lr)
            lrs.append(scheduler.get_last_lr()[0])
        return lrs, [str(w.message) for w in caught]

    trained, _ = learning_rates(skip_first=False)
    skipped, warned = learning_rates(skip_first=True)
    assert not [text for text in warned if "lr_scheduler.step()" in text], warned
    assert skipped == trained
    assert trained == pytest.approx([1e-2 * f for f in (1 / 3, 2 / 3, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                                        0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0)])


def _poison(module: Any, name: str, monkeypatch: pytest.MonkeyPatch, bad_calls: set[int]) -> None:
    """`module.name` (a loss returning (loss, metrics)) multiplied by inf on its `bad_calls` (1-based)."""
    loss_fn, calls = getattr(module, name), [0]

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        loss, metrics = loss_fn(*args, **kwargs)
        calls[0] += 1
        return (loss * math.inf if calls[0] in bad_calls else loss), metrics

    monkeypatch.setattr(module, name, poisoned)


def _watch_updates(module: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict]]:
    """Each of `module`'s apply_update calls' weights before and after it."""
    real, seen = module.apply_update, []

    def watched(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        before = _weights(model)
        applied = real(model, *args, **kwargs)
        seen.append((before, _weights(model)))
        return applied

    monkeypatch.setattr(module, "apply_update", watched)
    return seen


def test_an_sft_step_with_infinite_gradients_leaves_the_weights_and_the_next_step_trains(
        tiny_trainable_qwen3: Path, make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    _poison(sft_math, "sft_loss", monkeypatch, bad_calls={2})  # one micro-batch a step: step 2
    updates = _watch_updates(sft_math, monkeypatch)
    sink = MemorySink()
    result = train_sft(make_config("sft", tiny_trainable_qwen3, *SFT, "trainer.steps=4"), Recorder([sink]))

    assert sink.series("train/update_skipped") == [(1, 0), (2, 1), (3, 0), (4, 0)]
    grad_norms = dict(sink.series("grad_norm"))
    assert not math.isfinite(grad_norms[2]) and all(math.isfinite(grad_norms[s]) for s in (1, 3, 4))
    assert _same(*updates[1])  # the bad step: exactly the weights before it
    for before, after in (updates[0], updates[2], updates[3]):
        assert not _same(before, after) and all(torch.isfinite(w).all() for w in after.values())
    assert result.step == 4 and result.losses[2] < result.losses[0]


@pytest.mark.parametrize(("limit", "bad_steps", "ends"), [
    (None, {2, 3, 4}, "3 steps in a row from step 2"),  # the default: 3
    (2, {1, 3, 4}, "2 steps in a row from step 3"),  # a good step between starts the count again
    (1, {2}, "1 steps in a row from step 2"),
])
def test_sft_steps_with_infinite_gradients_in_a_row_end_the_run_as_diverged(
        tiny_trainable_qwen3: Path, make_config, monkeypatch: pytest.MonkeyPatch, limit: int | None,
        bad_steps: set[int], ends: str) -> None:
    _poison(sft_math, "sft_loss", monkeypatch, bad_calls=bad_steps)
    sink = MemorySink()
    limit_override = () if limit is None else (f"trainer.max_skipped_updates={limit}",)
    config = make_config("sft", tiny_trainable_qwen3, *SFT, "trainer.steps=6", *limit_override)
    with pytest.raises(ConfigError) as raised:
        train_sft(config, Recorder([sink]))
    assert [(e.field, e.message) for e in raised.value.errors] == [(
        "trainer.optimizer.lr", f"the gradients were NaN or infinite for {ends}: the run diverged; lower "
        "trainer.optimizer.lr or resume from an earlier checkpoint")]
    last = max(bad_steps)
    assert [step for step, skipped in sink.series("train/update_skipped") if skipped] == sorted(bad_steps)
    assert sink.series("train/update_skipped")[-1][0] == last  # ended at the step that made the row
    # each skipped update but the last is said on the run page; the last ends the run under its own heading
    said = [(e["step"], e["text"]) for e in sink.events("message")]
    assert [step for step, _ in said] == sorted(bad_steps)[:-1]
    assert all(text.startswith(f"the gradients of step {step} were NaN or infinite: its update was skipped, the "
                               "weights are those of the step before (") for step, text in said)
    assert isinstance(raised.value, RunDiverged) and raised.value.heading == "the run diverged"
    assert pickle.loads(pickle.dumps(raised.value)).errors == raised.value.errors  # as a Monarch rank would send it
    assert type(pickle.loads(pickle.dumps(raised.value))) is RunDiverged


def test_grpo_steps_with_infinite_gradients_are_skipped_then_end_the_run(
        tiny_trainable_qwen3: Path, make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    _poison(grpo_math, "grpo_loss", monkeypatch, bad_calls={2, 4, 5})  # one micro-batch a step
    updates = _watch_updates(grpo_math, monkeypatch)
    sink = MemorySink()
    config = make_config("grpo", tiny_trainable_qwen3, *GRPO, "trainer.steps=6", "trainer.max_skipped_updates=2")
    with pytest.raises(ConfigError, match="the gradients were NaN or infinite for 2 steps in a row from step 4: the "
                                          "run diverged; lower trainer.optimizer.lr or resume"):
        train_grpo(config, Recorder([sink]))
    assert sink.series("train/update_skipped") == [(1, 0), (2, 1), (3, 0), (4, 1), (5, 1)]
    assert _same(*updates[1]) and _same(*updates[3]) and _same(*updates[4])
    assert not _same(*updates[2])  # the good step after a skipped one trains
    assert all(torch.isfinite(w).all() for w in updates[4][1].values())


def test_max_skipped_updates_is_at_least_one(tiny_trainable_qwen3: Path, make_config) -> None:
    with pytest.raises(ConfigError) as raised:
        make_config("sft", tiny_trainable_qwen3, "trainer.max_skipped_updates=0")
    [error] = raised.value.errors
    assert error.field == "trainer.max_skipped_updates" and "greater than or equal to 1" in error.message
    assert make_config("sft", tiny_trainable_qwen3).trainer.max_skipped_updates == 3


def test_the_command_line_says_a_diverged_run_diverged_and_a_config_error_is_an_invalid_config(
        capsys: pytest.CaptureFixture[str]) -> None:
    from workers.engine.cli import _print_config_error

    _print_config_error(RunDiverged.on("trainer.optimizer.lr", "the gradients were NaN or infinite"))
    _print_config_error(ConfigError.on("trainer.steps", "must be positive"))
    assert capsys.readouterr().err.splitlines() == [
        "the run diverged:", "  trainer.optimizer.lr: the gradients were NaN or infinite",
        "invalid config:", "  trainer.steps: must be positive"]
