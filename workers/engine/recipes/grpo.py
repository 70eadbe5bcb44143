"""GRPO with a single controller: generator, reward, reference and trainer in one process.

Each step, top to bottom:
  1. generate  the generator (its own copy of the weights) samples group_size completions
               per prompt and records each token's tempered log-prob; before each
               generation it takes the trainer's newest weights (a versioned, timed sync).
  2. reward    completions are scored (with DAPO's soft overlong punishment when set); advantages are
               normalised within each group. Dynamic sampling drops zero-spread groups and generates
               more until the batch is full or its rounds run out (rollout_shaping.py).
  3. buffer    the scored batch waits in the replay buffer, tagged with its policy version.
  4. reference (optional) the frozen starting model's log-probs, for the KL penalty (in the loss, or
               taken from the reward before the advantages).
  5. train     grpo.epochs x grpo.mini_batches optimizer steps of the clipped-ratio loss. Its denominator
               is the generator's log-prob, or with a rollout correction the trainer's own under the
               weights that generated the batch (pi_old), each token weighted by the truncated or
               masked pi_old / mu.

sync mode generates the batch it trains on right away (policy age 0). async mode lets the
generator run max_policy_age batches ahead, so the trainer learns from rollouts made by
weights up to max_policy_age updates old; the ratio corrects for that, and the buffer
drops anything older. max_policy_age = 0 is the on-policy case of the same loop.

The step's maths (scoring, reference log-probs, the policy update) is in `grpo_math.py`, shared
with the Monarch controller (`recipes/grpo_monarch.py`) and its actors, and so are the step's metrics
(`grpo_metrics.py`) and its end (`step_end.py`: skipped updates, rollouts, eval, checkpoint, operator commands).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING


from workers.engine.batching import collate_record
from workers.engine.behaviour_weights import BehaviourWeights
from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.checkpoint_folders import resume_field, with_resume_point
from workers.engine.config import RunConfig
from workers.engine.grpo_math import (group_prompts, kl_reward_advantages, policy_update, prepare_old_logprobs,
                                      sequence_logprobs)
from workers.engine.grpo_metrics import rollout_metrics, update_metrics
from workers.engine.metrics import Recorder
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.models.titan import count_parameters
from workers.engine.precision import DTYPES, apply_mixed_precision
from workers.engine.recipes.results import GrpoResult
from workers.engine.replay_buffer import ReplayBuffer
from workers.engine.rewards import CombinedReward
from workers.engine.rollout_shaping import DynamicSampler
from workers.engine.sampler import SamplingParams, TorchSampler
from workers.engine.scoring import score_rollouts
from workers.engine.startup import StartupPhases, record_resumed
from workers.engine.step_end import StepEnd
from workers.engine.timeline import WorkSpans
from workers.engine.tasks import build_task
from workers.engine.tasks.stream import ProblemStream
from workers.engine.training import (
    UPDATE_SKIPPED, EvalResult, PhaseTimer, build_optimizer, build_scheduler, evaluate, mfu,
    record_eval, setup_process, single_process_device, train_tokens_per_second,
)


if TYPE_CHECKING:
    from workers.engine.run_control import RunControl


def train_grpo(config: RunConfig, recorder: Recorder, *, control: RunControl | None = None) -> GrpoResult:
    cfg, trainer_cfg, grpo = with_resume_point(config), config.trainer, config.grpo
    startup = StartupPhases(recorder)
    startup.enter("loading_model", "loading the model and data")
    setup_process(threads=trainer_cfg.threads_per_process, seed=trainer_cfg.seed)

    task = build_task(cfg)  # a row it cannot use stops the run before the model loads
    recorder.event("dataset", step=0, **task.summary())

    # --- setup: policy (trainer), generator copy, optional frozen reference -------------
    device = single_process_device(cfg)
    loaded = load_pretrained(cfg.model.path, family=cfg.model.family, dtype=cfg.model.dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.train()
    n_params = count_parameters(model)
    generator = TorchSampler.copy_of(model, dtype=DTYPES[cfg.rollout_dtype], eos_token_ids=tokenizer.eos_token_ids,
                                     pad_id=tokenizer.pad_id)
    reference = None
    if cfg.reference.enabled:
        # the run's starting weights, also after a resume
        reference = copy.deepcopy(generator.model) if not cfg.checkpoint.resume_from else \
            load_pretrained(cfg.model.path, dtype=cfg.rollout_dtype, device=device).model.eval().requires_grad_(False)
    apply_mixed_precision(model, mixed_precision=trainer_cfg.mixed_precision)
    eval_sampler = TorchSampler(model, eos_token_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_id)

    stream = ProblemStream(task.train, seed=trainer_cfg.seed)
    reward = CombinedReward(cfg.reward.functions, cfg.reward.weights)
    optimizer = build_optimizer(model, trainer_cfg.optimizer)
    scheduler = build_scheduler(optimizer, trainer_cfg.optimizer, trainer_cfg.steps * grpo.updates_per_step)
    max_age = grpo.max_policy_age if grpo.mode == "async" else 0
    buffer = ReplayBuffer(capacity=max(cfg.replay_buffer.capacity, trainer_cfg.batch_size * grpo.group_size),
                          max_policy_age=max_age)
    behaviour = BehaviourWeights(max_policy_age=max_age if grpo.rollout_correction is not None else 0)
    sampling = SamplingParams(max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
                              top_p=cfg.generator.top_p)
    temperature = cfg.generator.temperature
    dynamic = DynamicSampler(batch_size=trainer_cfg.batch_size, group_size=grpo.group_size,
                             max_rounds=grpo.dynamic_sampling.max_rounds if grpo.dynamic_sampling else None)

    start_step, policy_version, generations = 0, 0, 0
    staleness: Counter[int] = Counter()
    if cfg.checkpoint.resume_from:
        progress = load_checkpoint(cfg.checkpoint.resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                   recipe=cfg.recipe, field=resume_field(cfg))
        start_step, policy_version, generations = progress["step"], progress["policy_version"], progress["generations"]
        stream.load_state_dict(progress["data"])
        buffer.load_state_dict(progress["buffer"])
        staleness.update({int(k): v for k, v in progress["staleness"].items()})
        generator.policy_version = -1  # its weights are the starting ones: sync before generating
        record_resumed(recorder, step=start_step, path=cfg.checkpoint.resume_from, progress=progress,
                       policy_version=policy_version)

    behaviour.record(model, version=policy_version)

    def generate_batch(timer: PhaseTimer) -> int:
        """Sample, score and buffer one step's rollouts (with dynamic sampling, rounds of them until the batch is
        filled); return the generated token count."""
        nonlocal generations
        if generator.policy_version != policy_version:
            with timer.phase("weight_sync"):
                generator.load_weights(model.state_dict(), policy_version)
        filling, tokens = dynamic.start(), 0
        while not filling.done:
            problems = stream.take(trainer_cfg.batch_size)
            with timer.phase("generate"):
                prompts = group_prompts(tokenizer, problems, group_size=grpo.group_size, limit=cfg.data.max_prompt_tokens)
                completions = generator.generate(prompts, sampling, seed=trainer_cfg.seed * 1_000_003 + generations)
            generations += 1
            tokens += sum(len(c.token_ids) for c in completions)
            with timer.phase("reward"):
                filling.add(score_rollouts(problems, prompts, completions, reward, tokenizer, group_size=grpo.group_size,
                                           std_normalised=grpo.std_normalised_advantages, overlong=grpo.overlong,
                                           max_new_tokens=cfg.generator.max_new_tokens))
        buffer.put(dynamic.finish(filling))
        return tokens

    def run_eval(step: int) -> EvalResult:
        model.eval()
        result = evaluate(eval_sampler, tokenizer, task.held_out, reward, max_new_tokens=cfg.generator.max_new_tokens,
                          keep_samples=cfg.eval.rollout_samples)
        model.train()
        record_eval(recorder, result, step)
        return result

    def checkpoint(step: int) -> Path:
        path = save_checkpoint(
            cfg.checkpoint.folder, step=step, recipe=cfg.recipe, model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
            progress={"step": step, "policy_version": policy_version, "generations": generations,
                      "data": stream.state_dict(), "buffer": buffer.state_dict(), "staleness": dict(staleness)},
            model_folder=cfg.model.path, keep_last=cfg.checkpoint.keep_last,
        )
        recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=policy_version)
        return path

    startup.ready()
    step_end = StepEnd(config=cfg, recorder=recorder, evaluate=run_eval, checkpoint=checkpoint, control=control)
    step_end.before_first(start_step)
    loop_start = time.perf_counter()
    losses: list[float] = []
    step_metrics: list[dict[str, float]] = []
    step = start_step
    for step in range(start_step + 1, trainer_cfg.steps + 1):
        timer = PhaseTimer(lane="process")
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
        sampled = dynamic.step_metrics(batch_record)  # sampling/*: with grpo.dynamic_sampling
        batch = collate_record(batch_record, pad_id=tokenizer.pad_id, mask_truncated=grpo.overlong.filter).to(device)

        # 4. reference log-probs (and the KL in the reward, when it goes there)
        shaping: dict[str, float] = {}
        if reference is not None:
            with timer.phase("reference"):
                batch.ref_logprobs = sequence_logprobs(reference, batch, micro_batch_size=trainer_cfg.micro_batch_size,
                                                       temperature=temperature, packing=grpo.packing)
            if grpo.kl_in == "reward":
                shaping["kl/reward_penalty"] = kl_reward_advantages(batch, batch_record.rewards, grpo=grpo)

        # 5. train: pi_old when a rollout correction or several updates need it, then epochs x mini_batches updates
        train_spans = WorkSpans()
        with timer.phase("train"):
            with train_spans.span("old_logprobs"):
                shaping.update(prepare_old_logprobs(
                    model, batch, grpo=grpo, temperature=temperature, micro_batch_size=trainer_cfg.micro_batch_size,
                    policy_age=age, batch_version=batch_record.policy_version, behaviour=behaviour))
            update = policy_update(
                model, optimizer, scheduler, batch, grpo=grpo, temperature=temperature,
                micro_batch_size=trainer_cfg.micro_batch_size, grad_clip=trainer_cfg.optimizer.grad_clip,
                max_new_tokens=cfg.generator.max_new_tokens, seed=trainer_cfg.seed * 1_000_003 + policy_version,
                spans=train_spans,
            )
            policy_version += 1
            behaviour.record(model, version=policy_version)

        # record
        step_seconds = time.perf_counter() - step_start
        train_tokens = int(batch.inputs.numel())
        metrics = {
            "loss": update.loss,
            **rollout_metrics(batch_record),
            **update_metrics(update.parts),
            **shaping,
            **sampled,
            "train/updates": update.updates,
            "grad_norm": update.grad_norm,
            UPDATE_SKIPPED: update.skipped,
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
        timer.split("train", train_spans.items)  # where the step's time went: the train phase in its parts
        metrics.update(timer.record_timeline(recorder, step=step))
        recorder.log_many(metrics, step)
        losses.append(update.loss)
        step_metrics.append(metrics)
        if not step_end.after(step, metrics=metrics, rollouts=batch_record):  # its end (step_end.py)
            break

    recorder.event("staleness_histogram", step=trainer_cfg.steps, counts={str(k): v for k, v in sorted(staleness.items())})
    return GrpoResult(step=step, losses=losses, first_eval=step_end.first_eval, eval=step_end.last_eval,
                      checkpoint=step_end.saved, metrics=step_metrics, seconds=time.perf_counter() - loop_start)
