"""A generator whose recorded log-probs are off, as vLLM's in bf16 are against an fp32 trainer: with the rollout
correction (truncated importance sampling, Yao et al. 2025) GRPO trains stably and ends higher than without.

This machine has no GPU and no vLLM, so the mismatch is simulated on the CPU: TorchSampler.generate is wrapped to
add seeded noise to each Completion's log-probs. The tokens are still sampled from the true policy; only the
log-probs the generator records (mu) are off. The noise has the shape bf16 rounding of the logits gives: per
token, heavy-tailed (Student-t, 3 degrees of freedom), and larger on low-probability tokens. Its mean |noise|
(about 0.38 nats) is far stronger than a real bf16 engine's (a few hundredths) so that it matters on this tiny
model in 70 steps; at 0.22 nats the corrected runs still ended higher in each of five seeded draws, but by as
little as 0.03 in one.

Without the correction the PPO ratio pi / mu carries the noise: the clip zeroes the gradient of tokens it should
not touch (about a fifth of them) and the rest are weighted by exp(-noise). With it the ratio is pi / pi_old (1 on
the single update of a sync step) and w = pi_old / mu, truncated at C = 2 or masked outside [1/2, 2], weights each
token instead. Since the tokens here come from the true policy, w is itself noise, not the correction of a sampling
bias that it is on a real bf16 engine: what the correction buys in this simulation is that no token's gradient is
clipped away.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.config import load_config
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.results import GrpoResult
from workers.engine.sampler import Completion, SamplingParams, TorchSampler

NOISE_SCALE = 0.5  # per-token noise: NOISE_SCALE x (1.5 - p) x Student-t(3), p the token's true probability
STUDENT_DOF = 3
STEPS, EVAL_EVERY = 70, 10
SEEDS = (0, 1, 2, 3, 4)  # the comparison of the corrections is over these seeded draws (one can go the other way)
CORRECTIONS: dict[str, tuple[str, ...]] = {
    "off": (),
    "truncate": ("grpo.rollout_correction.mode=truncate", "grpo.rollout_correction.threshold=2.0"),
    "mask": ("grpo.rollout_correction.mode=mask", "grpo.rollout_correction.threshold=2.0"),
}


def bf16_like_noise(logprobs: list[float], generator: torch.Generator) -> torch.Tensor:
    """Seeded per-token log-prob error: heavy-tailed, and larger for the less likely tokens."""
    true = torch.tensor(logprobs, dtype=torch.float64)
    normal = torch.randn(len(true), generator=generator, dtype=torch.float64)
    chi2 = torch.randn(len(true), STUDENT_DOF, generator=generator, dtype=torch.float64).square().sum(dim=1)
    student = normal / (chi2 / STUDENT_DOF).sqrt()
    return NOISE_SCALE * (1.5 - true.exp()) * student


@dataclass
class MismatchRun:
    result: GrpoResult
    curve: list[tuple[int, float]]  # (step, held-out eval/reward_mean)
    injected: list[float]  # mean |noise| over each sampled batch's tokens, in generation order


def run_with_perturbed_generator(folder: Path, root: Path, correction: str, seed: int = 0) -> MismatchRun:
    original = TorchSampler.generate
    injected: list[float] = []

    def perturbed(self: TorchSampler, prompts: list[list[int]], params: SamplingParams, *, seed: int) -> list[Completion]:
        completions = original(self, prompts, params, seed=seed)
        if params.greedy:  # the held-out eval reads no log-probs
            return completions
        generator = torch.Generator().manual_seed(seed)
        total, tokens = 0.0, 0
        for completion in completions:
            noise = bf16_like_noise(completion.logprobs, generator)
            completion.logprobs = (torch.tensor(completion.logprobs, dtype=torch.float64) + noise).tolist()
            total, tokens = total + float(noise.abs().sum()), tokens + len(noise)
        injected.append(total / max(tokens, 1))
        return completions

    config = load_config(
        f"recipe: grpo\nmodel: {{path: '{folder}'}}\n",
        overrides=[*ARITHMETIC, f"trainer.steps={STEPS}", "trainer.batch_size=16", "trainer.micro_batch_size=128",
                   "grpo.group_size=8", "trainer.optimizer.lr=2e-4", f"eval.every_steps={EVAL_EVERY}",
                   "trainer.threads_per_process=1", "telemetry.console=false",
                   f"trainer.seed={seed}", f"checkpoint.folder={root / correction / str(seed)}", *CORRECTIONS[correction]],
    )
    sink = MemorySink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TorchSampler, "generate", perturbed)
        result = train_grpo(config, Recorder([sink]))
    return MismatchRun(result=result, curve=sink.series("eval/reward_mean"), injected=injected)


@pytest.fixture(scope="module")
def mismatch_draws(sft_warm_start: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[MismatchRun]]:
    """correction -> the same sync GRPO run from the SFT warm start, with the perturbed generator, once per seed of
    SEEDS (off and truncate; mask with the first seed only)."""
    folder, _ = sft_warm_start
    root = tmp_path_factory.mktemp("mismatch")
    draws = {name: [run_with_perturbed_generator(folder, root, name, seed) for seed in (SEEDS[:1] if name == "mask" else SEEDS)]
             for name in CORRECTIONS}
    for name, runs in draws.items():
        for seed, run in zip(SEEDS, runs):
            metrics = run.result.metrics
            print(f"\n{name:>8} seed {seed}: eval/reward_mean " + " ".join(f"{step}:{value:.3f}" for step, value in run.curve)
                  + f" | mean grad_norm {_mean(metrics, 'grad_norm'):.2f}, clip_fraction {_mean(metrics, 'clip_fraction'):.3f}"
                  f", ratio/max {_mean(metrics, 'ratio/max'):.3g}, mismatch/abs_mean {_mean(metrics, 'mismatch/abs_mean'):.3f}"
                  f", train reward (last 20 steps) {_mean(metrics[-20:], 'reward/mean'):.3f}"
                  f" ({run.result.seconds:.1f} s)")
    return draws


@pytest.fixture(scope="module")
def mismatch_runs(mismatch_draws: dict[str, list[MismatchRun]]) -> dict[str, MismatchRun]:
    """correction -> its run with the first seed."""
    return {name: runs[0] for name, runs in mismatch_draws.items()}


def _mean(metrics: list[dict[str, float]], key: str) -> float:
    return sum(m[key] for m in metrics) / len(metrics)


def test_the_mismatch_metric_measures_the_injected_noise(mismatch_runs: dict[str, MismatchRun]) -> None:
    """Sync: one generation per step, all of it trained on; the trainer's log-probs are the generator's true ones
    (to float32 precision), so each step's mean |log pi_old - log mu| is that batch's mean |noise|."""
    for name, run in mismatch_runs.items():
        measured = [m["mismatch/abs_mean"] for m in run.result.metrics]
        assert len(run.injected) == len(measured) == STEPS, name
        assert measured == pytest.approx(run.injected, abs=1e-4), name
        assert 0.3 < sum(measured) / STEPS < 0.45, name
        assert max(m["mismatch/abs_max"] for m in run.result.metrics) > 2.0, name  # the heavy tail


def test_without_the_correction_the_clip_zeroes_noisy_tokens(mismatch_runs: dict[str, MismatchRun]) -> None:
    off = mismatch_runs["off"].result.metrics
    assert _mean(off, "clip_fraction") > 0.15
    assert max(m["ratio/max"] for m in off) > 10.0  # pi / mu carries exp(-noise)
    for name in ("truncate", "mask"):  # the ratio is pi / pi_old: 1 on a sync step's one update
        corrected = mismatch_runs[name].result.metrics
        assert all(m["clip_fraction"] == 0.0 and m["ratio/max"] < 1.0 + 1e-3 for m in corrected), name


def test_the_correction_weights_report_what_they_cut(mismatch_runs: dict[str, MismatchRun]) -> None:
    truncate, mask = mismatch_runs["truncate"].result.metrics, mismatch_runs["mask"].result.metrics
    assert 0.0 < _mean(truncate, "mismatch/truncated_share") < 0.15
    assert all(m["mismatch/masked_share"] == 0.0 for m in truncate)
    assert 0.0 < _mean(mask, "mismatch/masked_share") < 0.3
    assert all(m["mismatch/truncated_share"] == 0.0 for m in mask)
    assert _mean(truncate, "mismatch/is_weight_mean") == pytest.approx(1.0, abs=0.15)
    assert "mismatch/is_weight_mean" not in mismatch_runs["off"].result.metrics[0]


def test_truncated_importance_sampling_trains_stably_and_beats_no_correction(
        mismatch_runs: dict[str, MismatchRun], mismatch_draws: dict[str, list[MismatchRun]]) -> None:
    """Held-out greedy reward over the run's second half (4 evals, steadier than one) and the sampled rollouts' reward
    over its last 20 steps, each averaged over the seeded draws: higher with the correction, which also keeps every
    gradient its tokens carry. Per draw the corrected run was ahead on the held-out second-half mean by +0.05, +0.09
    and +0.08 on an AVX-512 Xeon (seeds 0 to 2, lr 2e-4; at 5e-4 the runs peaked mid-way and fell back), and by
    +0.056, +0.055, -0.027, +0.076 and +0.061 on an AMD EPYC (seeds 0 to 4; +0.044 on average): one draw alone is no
    verdict, and another CPU's arithmetic draws other rollouts."""
    starts = {name: run.curve[0][1] for name, run in mismatch_runs.items()}
    assert len(set(starts.values())) == 1  # the same warm start, the same held-out problems
    assert [step for step, _ in mismatch_runs["truncate"].curve] == list(range(0, STEPS + 1, EVAL_EVERY))
    late = {name: [_late_mean(run) for run in runs] for name, runs in mismatch_draws.items()}
    ahead = [corrected - plain for corrected, plain in zip(late["truncate"], late["off"], strict=True)]
    train = {name: statistics.mean(_mean(run.result.metrics[-20:], "reward/mean") for run in runs)
             for name, runs in mismatch_draws.items()}
    truncate = mismatch_runs["truncate"]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in truncate.result.metrics)
    gains = [run.curve[-1][1] - run.curve[0][1] for run in mismatch_draws["truncate"]]
    assert statistics.mean(gains) >= 0.2, gains  # +0.24 to +0.27 on the Xeon, +0.47 to +0.52 on the EPYC
    assert mismatch_runs["mask"].curve[-1][1] >= starts["mask"] + 0.1  # masked IS trains stably too
    assert statistics.mean(ahead) >= 0.02 and sum(a > 0 for a in ahead) >= 3, ahead
    assert train["truncate"] > train["off"]
    assert _mean(truncate.result.metrics, "grad_norm") > _mean(mismatch_runs["off"].result.metrics, "grad_norm")


def _late_mean(run: MismatchRun) -> float:
    values = [value for step, value in run.curve if step > STEPS // 2]
    return sum(values) / len(values)
