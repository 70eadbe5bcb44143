"""GRPO with a single controller: generator, reward, reference and trainer in one process.

Each step, top to bottom:
  1. generate  the generator (its own copy of the weights) samples group_size completions
               per prompt and records each token's tempered log-prob; before each
               generation it takes the trainer's newest weights (a versioned, timed sync).
  2. reward    completions are scored; advantages are normalised within each group.
  3. buffer    the scored batch waits in the replay buffer, tagged with its policy version.
  4. reference (optional) the frozen starting model's log-probs, for the k3 KL penalty.
  5. train     clipped-ratio loss with the generator's log-probs as the denominator.

sync mode generates the batch it trains on right away (policy age 0). async mode lets the
generator run max_policy_age batches ahead, so the trainer learns from rollouts made by
weights up to max_policy_age updates old; the ratio corrects for that, and the buffer
drops anything older. max_policy_age = 0 is the on-policy case of the same loop.

The helpers above `train_grpo` (scoring, the policy update, metrics) are shared with the
Monarch controller (`recipes/grpo_monarch.py`) and its actors.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.batching import RolloutBatch, collate_rollouts
from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.config import GrpoConfig, RunConfig
from workers.engine.losses import group_advantages, grpo_loss, token_logprobs
from workers.engine.metrics import Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.models.titan import count_parameters
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.replay_buffer import ReplayBuffer, RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import Completion, SamplingParams, TorchSampler
from workers.engine.sharding import set_gradient_sync
from workers.engine.startup import StartupPhases
from workers.engine.tasks import Problem, build_task
from workers.engine.tasks.stream import ProblemStream
from workers.engine.training import (
    EvalResult, PhaseTimer, build_optimizer, build_scheduler, evaluate, grad_norm_and_clip, mfu, resolve_device,
    setup_process, train_tokens_per_second,
)


if TYPE_CHECKING:
    from workers.engine.run_control import RunControl


@dataclass
class GrpoResult:
    step: int
    losses: list[float]
    first_eval: EvalResult | None
    eval: EvalResult | None
    checkpoint: Path | None
    metrics: list[dict[str, float]]  # per step run by this call
    seconds: float = 0.0  # wall time of the training loop (evaluations and checkpoints included)
    trained_samples: dict[int, list[str]] = field(default_factory=dict)  # step -> sample ids it trained on (Monarch)


def _weighted_mean(parts: list[dict[str, float]], key: str) -> float:
    total = sum(p["tokens"] for p in parts if key in p)
    return sum(p[key] * p["tokens"] for p in parts if key in p) / max(total, 1.0)


def score_rollouts(
    problems: list[Problem], prompts: list[list[int]], completions: list[Completion], reward: CombinedReward,
    tokenizer: ChatTokenizer, *, group_size: int,
) -> RolloutBatchRecord:
    """Reward every completion and normalise advantages within each prompt's group."""
    texts = [tokenizer.decode_reply(c.token_ids) for c in completions]
    scores = [reward(problems[i // group_size], text, c.finished) for i, (text, c) in enumerate(zip(texts, completions))]
    rewards = torch.tensor([s.total for s in scores])
    advantages = group_advantages(rewards, group_size)
    return RolloutBatchRecord(
        prompts=prompts, responses=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
        rewards=rewards.tolist(), advantages=advantages.tolist(), policy_version=min(c.policy_version for c in completions),
        prompt_texts=[problems[i // group_size].messages[-1]["content"] for i in range(len(prompts))],
        response_texts=texts, reward_parts={name: [s.parts[name] for s in scores] for name in reward.names},
        sample_ids=[p.meta.get("sample_id", "") for p in problems],
    )


def check_prompt_lengths(prompts: list[list[int]], limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ValueError(f"a prompt has {longest} tokens, more than data.max_prompt_tokens ({limit})")


def loss_normalizer(batch: RolloutBatch, aggregation: str) -> float:
    """Response tokens (token aggregation) or sequences (sequence aggregation) of the whole step's batch."""
    return float(batch.response_mask.sum()) if aggregation == "token" else float(len(batch))


@torch.no_grad()
def reference_logprobs(reference: nn.Module, batch: RolloutBatch, *, micro_batch_size: int, temperature: float) -> list[torch.Tensor]:
    out = []
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.rows(start, start + micro_batch_size)
        out.append(token_logprobs(reference(micro.inputs), micro.targets, temperature)[0])
    return out


@dataclass
class UpdateResult:
    loss: float
    parts: list[dict[str, float]]  # grpo_loss metrics per micro-batch
    grad_norm: float
    lr: float


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    *,
    grpo: GrpoConfig,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float | None,
    normalizer: float,
    ref_logprobs: list[torch.Tensor] | None = None,
    reduce_gradients: Callable[[nn.Module], None] | None = None,
    passes: int = 0,
    filler: RolloutBatch | None = None,
) -> UpdateResult:
    """One optimizer step on a rollout batch, gradients accumulated over micro-batches.

    `normalizer` counts the whole step's batch (over all data-parallel ranks), so summing
    the ranks' gradients (`reduce_gradients`, or FSDP's reduce-scatter) gives the full batch's
    gradient. A sharded model needs the same number of forward/backward passes on every rank:
    with `passes` more than this rank's micro-batches, the rest run on `filler` with weight 0.
    """
    optimizer.zero_grad(set_to_none=True)
    step_loss, parts = accumulate_gradients(
        model, batch, grpo=grpo, temperature=temperature, micro_batch_size=micro_batch_size, normalizer=normalizer,
        ref_logprobs=ref_logprobs, passes=passes, filler=filler, sync=True)
    if reduce_gradients is not None:
        reduce_gradients(model)
    grad_norm, lr = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)
    return UpdateResult(loss=step_loss, parts=parts, grad_norm=grad_norm, lr=lr)


def accumulate_gradients(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    grpo: GrpoConfig,
    temperature: float,
    micro_batch_size: int,
    normalizer: float,
    ref_logprobs: list[torch.Tensor] | None = None,
    passes: int = 0,
    filler: RolloutBatch | None = None,
    sync: bool,
) -> tuple[float, list[dict[str, float]]]:
    """Forward and backward over `batch` in micro-batches, adding to the gradients; (loss, per-micro-batch stats).
    A sharded model reduces its gradients in the last pass when `sync`, else keeps accumulating locally."""
    step_loss, parts = 0.0, []
    starts = list(range(0, len(batch), micro_batch_size))
    total = max(len(starts), passes)
    for i in range(total):
        set_gradient_sync(model, enabled=sync and i == total - 1)
        if i >= len(starts):
            if filler is None:
                raise ValueError("passes beyond this rank's rows need a filler row")
            zero_weighted_pass(model, filler)
            continue
        micro = batch.rows(starts[i], starts[i] + micro_batch_size)
        logprobs, entropy = token_logprobs(model(micro.inputs), micro.targets, temperature)
        loss, part = grpo_loss(
            logprobs, micro.behaviour_logprobs, micro.advantages, micro.response_mask,
            clip_epsilon=grpo.clip_epsilon, aggregation=grpo.loss_aggregation, kl_coef=grpo.kl_coef,
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[i], entropy=entropy.detach(),
            normalizer=normalizer,
        )
        loss.backward()
        step_loss += float(loss.detach())
        parts.append(part)
    return step_loss, parts


def zero_weighted_pass(model: nn.Module, filler: RolloutBatch) -> None:
    """A forward and backward that adds nothing to the gradients: a sharded rank's share of a collective."""
    (model(filler.inputs).float().sum() * 0.0).backward()


def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, *,
                 grad_clip: float | None) -> tuple[float, float]:
    """Clip, step the optimizer and the schedule; (gradient norm before clipping, learning rate used)."""
    grad_norm = grad_norm_and_clip(model, grad_clip)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return grad_norm, lr


def rollout_metrics(record: RolloutBatchRecord) -> dict[str, float]:
    rewards = torch.tensor(record.rewards)
    lengths = [len(r) for r in record.responses]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        **{f"reward/{name}": sum(v) / len(v) for name, v in record.reward_parts.items()},
        "response_length/mean": sum(lengths) / len(lengths),
    }


def update_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    metrics = {
        "ratio/mean": _weighted_mean(parts, "ratio_mean"),
        "ratio/max": max(p["ratio_max"] for p in parts),
        "ratio/min": min(p["ratio_min"] for p in parts),
        "clip_fraction": _weighted_mean(parts, "clip_fraction"),
        "entropy": _weighted_mean(parts, "entropy"),
    }
    if any("kl" in p for p in parts):
        metrics["kl"] = _weighted_mean(parts, "kl")
    return metrics


def train_grpo(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None) -> GrpoResult:
    cfg, trainer_cfg, grpo = config, config.trainer, config.grpo
    startup = StartupPhases(recorder)
    startup.enter("loading_model", "loading the model and data")
    setup_process(threads=trainer_cfg.threads_per_process, seed=trainer_cfg.seed)

    task = build_task(cfg)  # a row it cannot use stops the run before the model loads
    recorder.event("dataset", step=0, **task.summary())

    # --- setup: policy (trainer), generator copy, optional frozen reference -------------
    device = resolve_device(trainer_cfg.device)
    loaded = load_pretrained(cfg.model.path, family=cfg.model.family, dtype=cfg.model.dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.train()
    n_params = count_parameters(model)
    generator = TorchSampler(copy.deepcopy(model).eval().requires_grad_(False),
                             eos_token_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_id, policy_version=0)
    reference = None
    if cfg.reference.enabled:
        # the run's starting weights, also after a resume
        reference = copy.deepcopy(generator.model) if not cfg.checkpoint.resume_from else \
            load_pretrained(cfg.model.path, dtype=cfg.model.dtype, device=device).model.eval().requires_grad_(False)
    eval_sampler = TorchSampler(model, eos_token_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_id)

    stream = ProblemStream(task.train, seed=trainer_cfg.seed)
    reward = CombinedReward(cfg.reward.functions, cfg.reward.weights)
    optimizer = build_optimizer(model, trainer_cfg.optimizer)
    scheduler = build_scheduler(optimizer, trainer_cfg.optimizer, trainer_cfg.steps)
    max_age = grpo.max_policy_age if grpo.mode == "async" else 0
    buffer = ReplayBuffer(capacity=max(cfg.replay_buffer.capacity, trainer_cfg.batch_size * grpo.group_size),
                          max_policy_age=max_age)
    sampling = SamplingParams(max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
                              top_p=cfg.generator.top_p)
    temperature = cfg.generator.temperature

    start_step, policy_version, generations = 0, 0, 0
    staleness: Counter[int] = Counter()
    if cfg.checkpoint.resume_from:
        progress = load_checkpoint(cfg.checkpoint.resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
        start_step, policy_version, generations = progress["step"], progress["policy_version"], progress["generations"]
        stream.load_state_dict(progress["data"])
        buffer.load_state_dict(progress["buffer"])
        staleness.update({int(k): v for k, v in progress["staleness"].items()})
        generator.policy_version = -1  # its weights are the starting ones: sync before generating
        recorder.event("resumed", step=start_step, path=cfg.checkpoint.resume_from, policy_version=policy_version)

    def generate_batch(timer: PhaseTimer) -> int:
        """Sample, score and buffer one step's rollouts; return the generated token count."""
        nonlocal generations
        if generator.policy_version != policy_version:
            with timer.phase("weight_sync"):
                generator.load_weights(model.state_dict(), policy_version)
        problems = stream.take(trainer_cfg.batch_size)
        with timer.phase("generate"):
            prompts = [tokenizer.encode_prompt(p.messages) for p in problems for _ in range(grpo.group_size)]
            check_prompt_lengths(prompts, cfg.data.max_prompt_tokens)
            completions = generator.generate(prompts, sampling, seed=trainer_cfg.seed * 1_000_003 + generations)
        generations += 1
        with timer.phase("reward"):
            buffer.put(score_rollouts(problems, prompts, completions, reward, tokenizer, group_size=grpo.group_size))
        return sum(len(c.token_ids) for c in completions)

    def run_eval(step: int) -> EvalResult:
        model.eval()
        result = evaluate(eval_sampler, tokenizer, task.held_out, reward, max_new_tokens=cfg.generator.max_new_tokens,
                          keep_samples=cfg.eval.rollout_samples)
        model.train()
        recorder.log_many({"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean}, step)
        for prompt, completion, score in result.samples:
            recorder.rollout(step=step, prompt=prompt, completion=completion, reward=score, split="held_out")
        return result

    def checkpoint(step: int) -> Path:
        path = save_checkpoint(
            cfg.checkpoint.folder, step=step, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
            scheduler_state=scheduler.state_dict(),
            progress={"step": step, "policy_version": policy_version, "generations": generations,
                      "data": stream.state_dict(), "buffer": buffer.state_dict(), "staleness": dict(staleness)},
            model_folder=cfg.model.path, keep_last=cfg.checkpoint.keep_last,
        )
        recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=policy_version)
        return path

    startup.ready()
    first_eval = last_eval = run_eval(start_step) if cfg.eval.every_steps and start_step == 0 else None
    loop_start = time.perf_counter()
    losses: list[float] = []
    step_metrics: list[dict[str, float]] = []
    saved: Path | None = None
    step = start_step
    for step in range(start_step + 1, trainer_cfg.steps + 1):
        timer = PhaseTimer()
        step_start = time.perf_counter()

        # 1-3. generate, reward, buffer: keep the generator max_age batches ahead of the trainer
        generated_tokens = 0
        timer.seconds["weight_sync"] = 0.0  # reported every step, 0 when the generator was current
        batch_record = None
        while batch_record is None:
            while len(buffer) < max_age + 1:
                generated_tokens += generate_batch(timer)
            batch_record = buffer.take(policy_version)
        age = policy_version - batch_record.policy_version
        staleness[age] += 1
        batch = collate_rollouts(batch_record.prompts, batch_record.responses, batch_record.logprobs,
                                 batch_record.advantages, pad_id=tokenizer.pad_id).to(device)
        normalizer = loss_normalizer(batch, grpo.loss_aggregation)

        # 4. reference log-probs
        ref_logprobs = None
        if reference is not None:
            with timer.phase("reference"):
                ref_logprobs = reference_logprobs(reference, batch, micro_batch_size=trainer_cfg.micro_batch_size,
                                                  temperature=temperature)

        # 5. train
        with timer.phase("train"):
            update = policy_update(
                model, optimizer, scheduler, batch, grpo=grpo, temperature=temperature,
                micro_batch_size=trainer_cfg.micro_batch_size, grad_clip=trainer_cfg.optimizer.grad_clip,
                normalizer=normalizer, ref_logprobs=ref_logprobs,
            )
            policy_version += 1

        # record
        step_seconds = time.perf_counter() - step_start
        train_tokens = int(batch.inputs.numel())
        metrics = {
            "loss": update.loss,
            **rollout_metrics(batch_record),
            **update_metrics(update.parts),
            "grad_norm": update.grad_norm,
            "lr": update.lr,
            "policy_version": policy_version,
            "staleness/policy_age": age,
            "buffer/batches": len(buffer),
            "buffer/dropped_stale": buffer.dropped_stale,
            "time/step_s": step_seconds,
            **timer.metrics(),
            "throughput/train_tokens_per_s": train_tokens_per_second(tokens=train_tokens, step_seconds=step_seconds),
            "data/train_tokens": train_tokens,
            "mfu": mfu(n_params=n_params, tokens=train_tokens, seconds=step_seconds, peak_flops_per_second=trainer_cfg.peak_flops_per_second),
        }
        if "generate" in timer.seconds:
            metrics["throughput/gen_tokens_per_s"] = generated_tokens / max(timer.seconds["generate"], 1e-9)
        recorder.log_many(metrics, step)
        for i in range(min(cfg.eval.rollout_samples, len(batch_record))):
            recorder.rollout(step=step, prompt=batch_record.prompt_texts[i], completion=batch_record.response_texts[i],
                             reward=batch_record.rewards[i], policy_version=batch_record.policy_version, split="train")
        losses.append(update.loss)
        step_metrics.append(metrics)

        if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == trainer_cfg.steps):
            last_eval = run_eval(step)
        if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == trainer_cfg.steps:
            saved = checkpoint(step)
        if control is not None and not control.between_steps(step=step, checkpoint=lambda: checkpoint(step)):
            break

    recorder.event("staleness_histogram", step=trainer_cfg.steps, counts={str(k): v for k, v in sorted(staleness.items())})
    return GrpoResult(step=step, losses=losses, first_eval=first_eval, eval=last_eval,
                      checkpoint=saved, metrics=step_metrics, seconds=time.perf_counter() - loop_start)
