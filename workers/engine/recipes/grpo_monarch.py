"""GRPO on Monarch process meshes: the controller loop.

The same algorithm as `recipes/grpo.py`, with each role in its own processes:
  trainer    `trainer.ranks` procs, data parallel (gloo on CPU, NCCL on GPUs)
  generator  `generator.replicas` procs behind a routed Service (torch sampler or vLLM)
  reference  one proc (when enabled)
  dataset, reward, replay buffer   actors sharing one small "control" proc

Each step, top to bottom:
  1. generate  launch generations until max_policy_age + 1 batches are buffered or in
               flight; each launch first syncs the newest weights to the generators
               (versioned, timed). Launched generations keep running on the generator
               procs while the trainer trains: that is the async overlap.
  2. reward    the oldest generation is awaited, scored by the reward actor, buffered.
  3. buffer    the trainer's batch comes out of the replay buffer within the age bound.
  4. reference (optional) reference log-probs for the KL penalty.
  5. train     every trainer rank takes its rows; gradients are summed across ranks.

Trainer fault tolerance: when a trainer proc dies (`FaultDrill` kills one on purpose), the
controller respawns the trainer mesh, restores the last checkpoint (model, optimizer,
scheduler, data position, replay buffer, policy version), drops generations launched with
newer weights, and carries on, up to `trainer.recover_failures` times.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monarch.actor
from monarch.spmd import setup_torch_elastic_env

from workers.engine.actors.dataset import DatasetActor
from workers.engine.actors.generator import GeneratorActor
from workers.engine.actors.procs import spawn_procs
from workers.engine.actors.reference import ReferenceActor
from workers.engine.actors.replay_buffer import ReplayBufferActor
from workers.engine.actors.reward import RewardActor
from workers.engine.actors.service import Service
from workers.engine.actors.trainer import TrainerActor
from workers.engine.config import RunConfig
from workers.engine.metrics import Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.recipes.grpo import GrpoResult, check_prompt_lengths, rollout_metrics, update_metrics
from workers.engine.sampler import SamplingParams
from workers.engine.tasks import Problem
from workers.engine.training import EvalResult, PhaseTimer, mfu


@dataclass
class PendingGeneration:
    problems: list[Problem]
    prompts: list[list[int]]
    calls: list[tuple[int, Any]]  # (replica index, future of its completions), in prompt order
    data_state: dict[str, Any]  # the dataset's position before these problems were taken
    generation: int  # index of this generation (its sampling seeds derive from it)


class ProcFailure(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultDrill:
    """Kill one trainer proc right before the given step trains (operator drills, tests)."""

    step: int
    rank: int = 0


def _stop_quietly(mesh: Any) -> None:
    try:
        mesh.stop().get(timeout=15)
    except Exception:  # a damaged mesh may refuse to stop cleanly; its procs are gone or get reaped
        pass


def train_grpo_monarch(config: RunConfig, recorder: Recorder, *, drills: Sequence[FaultDrill] = ()) -> GrpoResult:
    cfg, trainer_cfg, grpo = config, config.trainer, config.grpo
    threads = trainer_cfg.threads_per_process
    failures: list[Any] = []
    # A proc that dies must not kill this controller (monarch's default exits the client):
    # remember it; `check_failures` decides whether the run can go on.
    monarch.actor.unhandled_fault_hook = failures.append

    device = trainer_cfg.device if trainer_cfg.device != "auto" else "cpu"
    meshes: list[Any] = []
    trainer_procs: Any = None
    try:
        # --- setup: process meshes and actors ------------------------------------------
        setup_start = time.perf_counter()

        def start_trainer() -> tuple[Any, Any, int]:
            procs = spawn_procs(trainer_cfg.ranks, threads=threads)
            setup_torch_elastic_env(procs)
            actors = procs.spawn("trainer", TrainerActor, cfg)
            info = list(actors.setup.call().get().values())
            return procs, actors, info[0]["n_params"]

        trainer_procs, trainer, n_params = start_trainer()
        trainer0 = trainer.slice(procs=0)

        if cfg.generator.backend == "vllm":
            from workers.engine.actors.vllm_generator import VllmGeneratorActor, vllm_proc_env

            vllm_proc_env()
            generator_procs = spawn_procs(cfg.generator.replicas, threads=threads)
            max_len = cfg.data.max_prompt_tokens + cfg.generator.max_new_tokens
            generators = generator_procs.spawn("generator", VllmGeneratorActor, cfg.model.path, cfg.model.dtype,
                                               max_len, trainer_cfg.seed)
        else:
            generator_procs = spawn_procs(cfg.generator.replicas, threads=threads)
            generators = generator_procs.spawn("generator", GeneratorActor, cfg.model.path, cfg.model.dtype, device)
        meshes.append(generator_procs)
        service = Service([generators.slice(procs=i) for i in range(cfg.generator.replicas)], routing=cfg.generator.routing)

        control_procs = spawn_procs(1, threads=threads)
        meshes.append(control_procs)
        max_age = grpo.max_policy_age if grpo.mode == "async" else 0
        dataset = control_procs.spawn("dataset", DatasetActor, cfg.data, trainer_cfg.seed)
        reward = control_procs.spawn("reward", RewardActor, cfg.model.path, list(cfg.reward.functions), cfg.reward.weights)
        buffer = control_procs.spawn("replay_buffer", ReplayBufferActor,
                                     max(cfg.replay_buffer.capacity, trainer_cfg.batch_size * grpo.group_size), max_age)
        reference = None
        if cfg.reference.enabled:
            reference_procs = spawn_procs(1, threads=threads)
            meshes.append(reference_procs)
            reference = reference_procs.spawn("reference", ReferenceActor, cfg.model.path, cfg.model.dtype, device)
        generators.policy_version.call().get()  # generators built
        held_out = dataset.held_out.call_one().get()
        tokenizer = ChatTokenizer(cfg.model.path)
        recorder.event("meshes_ready", step=0, seconds=round(time.perf_counter() - setup_start, 2),
                       trainer_ranks=trainer_cfg.ranks, generator_replicas=cfg.generator.replicas)

        sampling = SamplingParams(max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
                                  top_p=cfg.generator.top_p)
        step, policy_version, generations = 0, 0, 0
        generator_version = 0
        staleness: Counter[int] = Counter()
        pending: deque[PendingGeneration] = deque()
        initial_progress = {"step": 0, "policy_version": 0, "generations": 0, "staleness": {},
                            "data": dataset.state_dict.call_one().get(), "buffer": buffer.state_dict.call_one().get()}
        last_checkpoint: str | None = None

        def restore(path: str | None) -> None:
            """Put every stateful actor back to a checkpoint (or to the run's start)."""
            nonlocal step, policy_version, generations, generator_version
            progress = list(trainer.load.call(path).get().values())[0] if path else initial_progress
            step, policy_version, generations = progress["step"], progress["policy_version"], progress["generations"]
            dataset.load_state_dict.call_one(progress["data"]).get()
            buffer.load_state_dict.call_one(progress["buffer"]).get()
            staleness.clear()
            staleness.update({int(k): v for k, v in progress["staleness"].items()})
            while pending:  # launched from later states: finish them and throw them away
                for index, future in pending.popleft().calls:
                    future.get()
                    service.done(index)
            generator_version = -1  # the generators hold newer weights: sync before generating

        if cfg.checkpoint.resume_from:
            restore(cfg.checkpoint.resume_from)
            last_checkpoint = cfg.checkpoint.resume_from
            recorder.event("resumed", step=step, path=cfg.checkpoint.resume_from, policy_version=policy_version)

        def check_failures() -> None:
            """A failure report whose mesh still answers came from a mesh already replaced."""
            if not failures:
                return
            try:
                generators.policy_version.call().get(timeout=30)
                buffer.stats.call_one().get(timeout=30)
                trainer.pids.call().get(timeout=30)
                if reference is not None:
                    reference.ping.call().get(timeout=30)
            except Exception:
                raise ProcFailure(f"a process of the run failed: {str(failures[0])[:500]}") from None
            failures.clear()

        recoveries = 0

        def recover(error: Exception) -> None:
            nonlocal trainer_procs, trainer, trainer0, recoveries
            recoveries += 1
            recorder.event("trainer_failed", step=step + 1, error=str(error)[:300], recovery=recoveries)
            if recoveries > trainer_cfg.recover_failures:
                raise ProcFailure(f"trainer failed at step {step + 1} ({recoveries - 1} recoveries allowed): {str(error)[:300]}")
            _stop_quietly(trainer_procs)
            started = time.perf_counter()
            trainer_procs, trainer, _ = start_trainer()
            trainer0 = trainer.slice(procs=0)
            restore(last_checkpoint)
            recorder.event("trainer_recovered", step=step, path=last_checkpoint, policy_version=policy_version,
                           seconds=round(time.perf_counter() - started, 2))

        def sync_weights(timer: PhaseTimer) -> None:
            nonlocal generator_version
            with timer.phase("weight_sync"):
                state = trainer0.state_dict.call_one().get()
                generators.load_weights.call(state, policy_version).get()
            generator_version = policy_version

        def launch_generation(timer: PhaseTimer) -> PendingGeneration:
            nonlocal generations
            if generator_version != policy_version:
                sync_weights(timer)
            data_state = dataset.state_dict.call_one().get()
            problems = dataset.take.call_one(trainer_cfg.batch_size).get()
            prompts = [tokenizer.encode_prompt(p.messages) for p in problems for _ in range(grpo.group_size)]
            check_prompt_lengths(prompts, cfg.data.max_prompt_tokens)
            # whole groups per request, one request per replica
            groups_per_call = math.ceil(len(problems) / len(service.replicas))
            calls = []
            for c, first in enumerate(range(0, len(problems), groups_per_call)):
                chunk = prompts[first * grpo.group_size:(first + groups_per_call) * grpo.group_size]
                seed = trainer_cfg.seed * 1_000_003 + generations * 1_000 + c
                calls.append(service.submit(lambda replica, chunk=chunk, seed=seed: replica.generate.call_one(chunk, sampling, seed),
                                            key=problems[first].messages[-1]["content"]))
            generations += 1
            return PendingGeneration(problems, prompts, calls, data_state, generations - 1)

        def finish_generation(pending: PendingGeneration, timer: PhaseTimer) -> tuple[int, float]:
            """Await a launched generation, score and buffer it; return (tokens, slowest replica's seconds)."""
            with timer.phase("generate_wait"):
                completions, busiest = [], 0.0
                for index, future in pending.calls:
                    part, seconds = future.get()
                    completions.extend(part)
                    busiest = max(busiest, seconds)
                    service.done(index)
            with timer.phase("reward"):
                record = reward.score.call_one(pending.problems, pending.prompts, completions, grpo.group_size).get()
                buffer.put.call_one(record).get()
            return sum(len(c.token_ids) for c in completions), busiest

        def run_eval(step: int) -> EvalResult:
            result = trainer0.evaluate.call_one(held_out, cfg.eval.rollout_samples).get()
            recorder.log_many({"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean}, step)
            for prompt, completion, score in result.samples:
                recorder.rollout(step=step, prompt=prompt, completion=completion, reward=score, split="held_out")
            return result

        def checkpoint(step: int) -> Path:
            nonlocal last_checkpoint
            # generations in flight are not saved: the position before the oldest one is, so a
            # restore generates those problems again with the same seeds
            progress = {"step": step, "policy_version": policy_version,
                        "generations": pending[0].generation if pending else generations,
                        "data": pending[0].data_state if pending else dataset.state_dict.call_one().get(),
                        "buffer": buffer.state_dict.call_one().get(), "staleness": dict(staleness)}
            path = Path(trainer0.save.call_one(step, progress).get())
            last_checkpoint = str(path)
            recorder.event("checkpoint_saved", step=step, path=str(path), policy_version=policy_version)
            return path

        first_eval = last_eval = run_eval(step) if cfg.eval.every_steps and step == 0 else None
        loop_start = time.perf_counter()
        drills_left = list(drills)
        losses: list[float] = []
        step_metrics: list[dict[str, float]] = []
        saved: Path | None = None
        while step < trainer_cfg.steps:
            check_failures()
            timer = PhaseTimer()
            timer.seconds["weight_sync"] = 0.0
            step_start = time.perf_counter()

            # 1-3. generate (launch ahead), reward, buffer
            generated_tokens, generate_seconds = 0, 0.0
            record = None
            while record is None:
                buffered = buffer.stats.call_one().get()["batches"]
                while buffered + len(pending) < max_age + 1:
                    pending.append(launch_generation(timer))
                    buffered = buffer.stats.call_one().get()["batches"]
                if buffered == 0:
                    tokens, seconds = finish_generation(pending.popleft(), timer)
                    generated_tokens, generate_seconds = generated_tokens + tokens, generate_seconds + seconds
                record = buffer.take.call_one(policy_version).get()
            age = policy_version - record.policy_version
            staleness[age] += 1

            # 4. reference log-probs
            ref_logprobs = None
            if reference is not None:
                with timer.phase("reference"):
                    ref_logprobs = reference.logprobs.call_one(record, trainer_cfg.micro_batch_size,
                                                               cfg.generator.temperature).get()

            # 5. train on every rank
            for drill in [d for d in drills_left if d.step == step + 1]:
                drills_left.remove(drill)
                pid = list(trainer.pids.call().get().values())[drill.rank]
                os.kill(pid, signal.SIGKILL)
                recorder.event("fault_drill", step=step + 1, role="trainer", rank=drill.rank, pid=pid)
            try:
                with timer.phase("train"):
                    results = list(trainer.train_step.call(record, ref_logprobs).get().values())
            except Exception as error:  # a trainer proc died: the step did not happen
                recover(error)
                continue
            policy_version += 1
            step += 1

            step_seconds = time.perf_counter() - step_start
            parts = [p for r in results for p in r["parts"]]
            train_tokens = sum(r["train_tokens"] for r in results)
            stats = buffer.stats.call_one().get()
            metrics = {
                "loss": sum(r["loss"] for r in results),
                **rollout_metrics(record),
                **update_metrics(parts),
                "grad_norm": results[0]["grad_norm"],
                "lr": results[0]["lr"],
                "policy_version": policy_version,
                "staleness/policy_age": age,
                "buffer/batches": stats["batches"],
                "buffer/dropped_stale": stats["dropped_stale"],
                "generations_in_flight": len(pending),
                "time/step_s": step_seconds,
                **timer.metrics(),
                "throughput/train_tokens_per_s": train_tokens / max(timer.seconds["train"], 1e-9),
                "mfu": mfu(n_params=n_params, tokens=train_tokens, seconds=step_seconds,
                           peak_flops_per_second=trainer_cfg.peak_flops_per_second * trainer_cfg.ranks),
            }
            if generated_tokens:
                metrics["time/generate_s"] = generate_seconds
                metrics["throughput/gen_tokens_per_s"] = generated_tokens / max(generate_seconds, 1e-9)
            for i, served in enumerate(service.served):
                metrics[f"generator/replica_{i}_requests"] = served
            recorder.log_many(metrics, step)
            for i in range(min(cfg.eval.rollout_samples, len(record))):
                recorder.rollout(step=step, prompt=record.prompt_texts[i], completion=record.response_texts[i],
                                 reward=record.rewards[i], policy_version=record.policy_version, split="train")
            losses.append(metrics["loss"])
            step_metrics.append(metrics)

            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == trainer_cfg.steps):
                last_eval = run_eval(step)
            if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == trainer_cfg.steps:
                saved = checkpoint(step)

        for generation in pending:  # launched ahead, not needed any more
            for index, future in generation.calls:
                future.get()
                service.done(index)
        recorder.event("staleness_histogram", step=trainer_cfg.steps, counts={str(k): v for k, v in sorted(staleness.items())})
        check_failures()
        trainer.shutdown.call().get()
        return GrpoResult(step=trainer_cfg.steps, losses=losses, first_eval=first_eval, eval=last_eval,
                          checkpoint=saved, metrics=step_metrics, seconds=time.perf_counter() - loop_start)
    finally:
        for mesh in [trainer_procs, *meshes]:
            if mesh is not None:
                _stop_quietly(mesh)
