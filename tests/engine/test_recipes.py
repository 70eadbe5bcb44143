"""SFT and GRPO loops end to end on a tiny Qwen3: metrics, on-policy consistency, async staleness, learning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import ARITHMETIC
from workers.engine.batching import collate_rollouts
from workers.engine.losses import token_logprobs
from workers.engine.metrics import MemorySink, Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.recipes.grpo import train_grpo
from workers.engine.recipes.sft import train_sft
from workers.engine.sampler import SamplingParams, TorchSampler

GRPO = (*ARITHMETIC, "trainer.batch_size=8", "trainer.micro_batch_size=64", "grpo.group_size=8", "eval.every_steps=0")


def test_sft_learns_and_records(tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    sink = MemorySink()
    config = make_config("sft", tiny_trainable_qwen3, *ARITHMETIC, "trainer.steps=12", "trainer.batch_size=16",
                         "trainer.micro_batch_size=2", "trainer.optimizer.lr=3e-3", "eval.every_steps=6",
                         "eval.rollout_samples=2")
    result = train_sft(config, Recorder([sink]))
    assert result.losses[-1] < 0.5 * result.losses[0]
    assert result.checkpoint is not None and (result.checkpoint / "trainer.pt").is_file()
    for key in ("grad_norm", "lr", "time/step_s", "time/train_s", "throughput/train_tokens_per_s", "mfu"):
        assert len(sink.series(key)) == 12, key
    assert [step for step, _ in sink.series("eval/accuracy")] == [0, 6, 12]
    evals = sink.events("eval")  # each evaluation is a line on the run's timeline too, with the same figures
    assert [(e["step"], e["accuracy"], e["reward_mean"]) for e in evals] == [
        (step, accuracy, reward) for (step, accuracy), (_, reward) in zip(
            sink.series("eval/accuracy"), sink.series("eval/reward_mean"), strict=True)]
    assert sum(r["kind"] == "rollout" for r in sink.records) == 3 * 2
    assert 0.0 < sink.last("mfu") < 1.0


def test_sft_warm_start_is_partly_right(sft_warm_start: tuple[Path, float]) -> None:
    _, accuracy = sft_warm_start
    assert 0.2 <= accuracy <= 0.7


def test_generator_and_trainer_agree_after_weight_sync(sft_warm_start: tuple[Path, float]) -> None:
    folder, _ = sft_warm_start
    trainer = load_pretrained(folder)
    generator = TorchSampler(load_pretrained(folder).model, eos_token_ids=trainer.tokenizer.eos_token_ids,
                             pad_id=trainer.tokenizer.pad_id)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.mul_(1.05)  # the trainer moved on
    generator.load_weights(trainer.model.state_dict(), version=7)
    prompts = [trainer.tokenizer.encode_prompt([{"role": "user", "content": f"{a}+3="}]) for a in range(6)]
    completions = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8), seed=0)
    assert all(c.policy_version == 7 for c in completions)
    batch = collate_rollouts(prompts, [c.token_ids for c in completions], [c.logprobs for c in completions],
                             [0.0] * 6, pad_id=trainer.tokenizer.pad_id)
    with torch.no_grad():
        logprobs, _ = token_logprobs(trainer.model(batch.inputs), batch.targets, temperature=0.8)
    assert ((logprobs - batch.behaviour_logprobs) * batch.response_mask).abs().max() < 1e-5


def test_grpo_sync_is_on_policy(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sink = MemorySink()
    result = train_grpo(make_config("grpo", folder, *GRPO, "trainer.steps=4", "trainer.optimizer.lr=1e-3"), Recorder([sink]))
    for metrics in result.metrics:
        assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["ratio/max"] < 1.0 + 1e-3 and metrics["clip_fraction"] == 0.0
        assert metrics["staleness/policy_age"] == 0
        assert metrics["time/weight_sync_s"] >= 0.0 and metrics["time/generate_s"] > 0.0
        assert metrics["throughput/gen_tokens_per_s"] > 0.0
    assert [m["policy_version"] for m in result.metrics] == [1, 2, 3, 4]
    assert result.metrics[0]["reward/std"] > 0.0  # the warm start gives groups with mixed rewards
    assert result.metrics[0]["time/weight_sync_s"] == 0.0  # generator and trainer start from the same weights
    assert all(m["time/weight_sync_s"] > 0.0 for m in result.metrics[1:])  # one versioned sync per update
    rollouts = [r for r in sink.records if r["kind"] == "rollout" and r["split"] == "train"]
    assert len(rollouts) == 4 * 4 and {"prompt", "completion", "reward", "advantage", "policy_version"} <= set(rollouts[0])
    for step in range(1, 5):  # the first rollouts of a step are of one group: a higher reward, a higher advantage
        shown = sorted((r["reward"], r["advantage"]) for r in rollouts if r["step"] == step)
        assert [a for _, a in shown] == sorted(a for _, a in shown)
    assert any(r["advantage"] != 0.0 for r in rollouts)


def test_grpo_async_uses_stale_rollouts_and_corrects_them(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *GRPO, "trainer.steps=6", "trainer.optimizer.lr=3e-3",
                         "grpo.mode=async", "grpo.max_policy_age=2")
    result = train_grpo(config, Recorder())
    ages = [m["staleness/policy_age"] for m in result.metrics]
    assert ages == [0, 1, 2, 2, 2, 2]
    stale = [m for m in result.metrics if m["staleness/policy_age"] > 0]
    assert all(abs(m["ratio/mean"] - 1.0) > 1e-4 for m in stale)
    assert max(m["clip_fraction"] for m in stale) > 0.0
    assert result.metrics[0]["clip_fraction"] == 0.0  # the first batch is fresh


def test_grpo_async_with_age_zero_is_the_sync_loop(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    sync = train_grpo(make_config("grpo", folder, *GRPO, "trainer.steps=3"), Recorder())
    async0 = train_grpo(make_config("grpo", folder, *GRPO, "trainer.steps=3", "grpo.mode=async", "grpo.max_policy_age=0"), Recorder())
    assert async0.losses == sync.losses
    assert [m["staleness/policy_age"] for m in async0.metrics] == [0, 0, 0]


def test_grpo_kl_to_reference(sft_warm_start: tuple[Path, float], make_config) -> None:
    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *GRPO, "trainer.steps=4", "trainer.optimizer.lr=3e-3",
                         "reference.enabled=true", "grpo.kl_coef=0.1", "grpo.loss_aggregation=sequence")
    result = train_grpo(config, Recorder())
    kls = [m["kl"] for m in result.metrics]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert kls[-1] > 1e-6
    assert all("time/reference_s" in m for m in result.metrics)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_grpo_each_loss_trains(sft_warm_start: tuple[Path, float], make_config, tmp_path: Path, loss: str) -> None:
    """Smoke: three steps of each loss from the SFT warm start give finite losses and move the weights."""
    from workers.engine.models.hf_folder import export_hf

    folder, _ = sft_warm_start
    result = train_grpo(make_config("grpo", folder, *GRPO, "trainer.steps=3", "trainer.optimizer.lr=1e-3",
                                    f"grpo.loss={loss}"), Recorder())
    assert len(result.losses) == 3 and all(math.isfinite(value) for value in result.losses)
    assert all(m["mismatch/abs_max"] < 1e-3 for m in result.metrics)  # sync on CPU: generator and trainer agree
    assert result.checkpoint is not None
    trained, start = load_pretrained(export_hf(result.checkpoint, tmp_path / "hf")), load_pretrained(folder)
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (trained.model(ids) - start.model(ids)).abs().max() > 1e-4


# The learning runs, from the SFT warm start: sync 70 steps; async (max_policy_age 2) 50 steps, which keeps the ten
# runs within CI's budget (~20 s a 70-step run alone on 2 cores), at lr 2e-4. The held-out reward of one seeded run
# depends on the CPU's arithmetic (another machine's SIMD path draws other rollouts from the same seed), so the rate
# is one where every seed learns: over seeds 0-4 on an AVX-512 Xeon, grpo sync gained +0.21 to +0.32 at 2e-4 and
# +0.05 to +0.22 at 5e-4 (it peaked by step 40, then fell); async cispo (no trust region on stale rollouts) gained
# +0.19 to +0.29 at 2e-4 and -0.07 to +0.09 at 5e-4.
LEARNING = (*ARITHMETIC, "trainer.batch_size=16", "trainer.micro_batch_size=128", "grpo.group_size=8")
LEARNING_MODES = {"sync": ("trainer.steps=70", "eval.every_steps=70"),
                  "async": ("trainer.steps=50", "eval.every_steps=50", "grpo.mode=async", "grpo.max_policy_age=2")}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_grpo_raises_held_out_reward(sft_warm_start: tuple[Path, float], make_config, loss: str, mode: str) -> None:
    """Seeded: a short GRPO run from the SFT warm start clearly improves held-out greedy accuracy, with every loss
    of the family, on-policy (sync) and on rollouts up to two updates old (async)."""
    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *LEARNING, *LEARNING_MODES[mode], "trainer.optimizer.lr=2e-4",
                         f"grpo.loss={loss}")
    result = train_grpo(config, Recorder())
    assert result.first_eval is not None and result.eval is not None
    start, end = result.first_eval.reward_mean, result.eval.reward_mean
    print(f"{loss} {mode}: held-out reward {start:.3f} -> {end:.3f} ({result.seconds:.1f} s)")
    assert 0.2 <= start <= 0.7
    assert end >= start + 0.1
    if mode == "async":
        assert max(m["staleness/policy_age"] for m in result.metrics) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_control_at_learning_rate_zero_stays_flat(sft_warm_start: tuple[Path, float], make_config,
                                                       tmp_path: Path, mode: str) -> None:
    """The learning runs' control: the same seeded run at learning rate 0 computes its gradients, its weights never
    move, and its held-out greedy reward ends exactly where it started. In async mode the stale rollouts come from
    the same weights, so the ratio stays 1."""
    from workers.engine.models.hf_folder import export_hf

    folder, _ = sft_warm_start
    config = make_config("grpo", folder, *LEARNING, *LEARNING_MODES[mode], "trainer.optimizer.lr=0",
                         "grpo.loss=grpo")
    result = train_grpo(config, Recorder())
    assert result.first_eval is not None and result.eval is not None
    start, end = result.first_eval.reward_mean, result.eval.reward_mean
    print(f"control {mode}: held-out reward {start:.3f} -> {end:.3f} ({result.seconds:.1f} s)")
    assert end == start and result.eval.accuracy == result.first_eval.accuracy
    assert all(m["lr"] == 0.0 for m in result.metrics)
    assert all(m["grad_norm"] > 0.0 for m in result.metrics)  # a learning signal, not applied
    assert all(m["ratio/max"] < 1.0 + 1e-3 and m["clip_fraction"] == 0.0 for m in result.metrics)
    if mode == "async":
        assert max(m["staleness/policy_age"] for m in result.metrics) == 2
    assert result.checkpoint is not None
    trained = load_pretrained(export_hf(result.checkpoint, tmp_path / "hf")).model.state_dict()
    start_weights = load_pretrained(folder).model.state_dict()
    assert trained.keys() == start_weights.keys()
    assert all(torch.equal(trained[name], start_weights[name]) for name in start_weights)


def test_sft_on_jsonl_chat_without_answers(tiny_trainable_qwen3: Path, make_config, tmp_path: Path) -> None:
    import json

    data = tmp_path / "chat.jsonl"
    lines = [{"messages": [{"role": "system", "content": "echo"}, {"role": "user", "content": f"say {w}"},
                           {"role": "assistant", "content": w}]} for w in ("red", "green", "blue", "cyan", "pink", "gold")]
    data.write_text("\n".join(json.dumps(line) for line in lines))
    sink = MemorySink()
    config = make_config("sft", tiny_trainable_qwen3, "data.source=jsonl", f"data.path={data}", "data.eval_size=2",
                         "trainer.steps=10", "trainer.batch_size=4", "trainer.optimizer.lr=3e-3", "eval.every_steps=5")
    result = train_sft(config, Recorder([sink]))
    nll = sink.series("eval/nll")
    assert [step for step, _ in nll] == [0, 5, 10] and nll[-1][1] < nll[0][1]
    assert sink.series("eval/accuracy") == [] and result.eval is None  # nothing to check answers against


def test_held_out_examples_cut_off_whole_are_warned_of_once_and_counted_at_each_eval(
        tiny_trainable_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a held-out example whose prompt filled data.seq_len dropped out of eval/nll without a word
    import json

    from workers.engine.cli import main

    rows = tmp_path / "rows.jsonl"
    examples = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(10)]
    examples[7] = {"prompt": "x" * 100, "response": "x"}  # 119 tokens in the chat template; seed 0 holds out lines 8, 9
    rows.write_text("\n".join(json.dumps(example) for example in examples) + "\n")
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: '{tiny_trainable_qwen3}'}}\n")
    assert main(["train", "--config", str(config), "data.source=jsonl", f"data.path={rows}", "data.eval_size=2",
                 "data.seq_len=64", "trainer.steps=2", "trainer.batch_size=4", "eval.every_steps=1",
                 "trainer.threads_per_process=1", "telemetry.console=false", f"checkpoint.folder={tmp_path / 'ckpt'}",
                 f"telemetry.jsonl_path={tmp_path / 'metrics.jsonl'}"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: data.seq_len: 1 of 2 held-out examples have prompts longer than 64 tokens (the "
                        "longest: 119 tokens, data.path line 8): eval/nll leaves them out, with none of their "
                        "responses to score"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r["value"]) for r in records if r["kind"] == "metric" and r["key"] == key]

    assert series("eval/nll_dropped") == [(0, 1.0), (1, 1.0), (2, 1.0)]
    nll = series("eval/nll")
    assert [step for step, _ in nll] == [0, 1, 2] and all(0.0 < value < math.inf for _, value in nll)


def test_grpo_refuses_prompts_over_the_limit(tiny_qwen3: Path, make_config) -> None:
    config = make_config("grpo", tiny_qwen3, "data.max_prompt_tokens=8", "trainer.steps=1", "grpo.group_size=2",
                         "eval.every_steps=0")
    with pytest.raises(ValueError, match="more than data.max_prompt_tokens"):
        train_grpo(config, Recorder())
