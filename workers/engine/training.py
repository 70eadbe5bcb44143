"""Pieces both recipes use: process setup, optimizer and schedule, timing, MFU, evaluation."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workers.engine.batching import collate_sft
from workers.engine.config import OptimizerConfig, RunConfig
from workers.engine.fields import ConfigError
from workers.engine.losses import sft_loss
from workers.engine.metrics import Recorder
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.rewards import CombinedReward, exact_math
from workers.engine.sampler import SamplingParams, TorchSampler
from workers.engine.tasks.problem import Problem
from workers.engine.timeline import on_call_clock, record_step_timeline


def setup_process(*, threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """trainer.device in this process; auto means the same for every role: cuda when this process sees one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is cuda but no CUDA device is available")
    return torch.device(name)


def single_process_device(config: RunConfig) -> torch.device:
    """The device of a recipe run in one process: placement.trainer.gpus_per_proc 1 holds a GPU there, as it does
    for a Monarch trainer rank."""
    if not config.placement.trainer.gpus_per_proc:
        return resolve_device(config.trainer.device)
    if not torch.cuda.is_available():
        raise RuntimeError("placement.trainer.gpus_per_proc is 1 but no CUDA device is available")
    return torch.device("cuda")


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.name == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas)
    return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant / cosine / linear decay to 0 at total_steps."""
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if config.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class PhaseTimer:
    """Wall time per named phase of one step (`with timer.phase("generate"): ...`), and the step's spans for its
    timeline (`workers/engine/timeline.py`): each phase on `lane`, and the procs' spans added with `add_proc`."""

    def __init__(self, *, lane: str = "controller") -> None:
        self.seconds: dict[str, float] = {}
        self.lane = lane
        self.start = time.time()
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, phase, start, end), Unix seconds
        self.train_sent: float | None = None  # the first call to the trainer, when sent before the "train" phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.spans.append((self.lane, name, wall, wall + seconds))

    @contextmanager
    def span_on(self, lane: str, phase: str) -> Iterator[None]:
        """A call to a proc timed here, drawn on the proc's lane (for procs that do not time their own work)."""
        start = time.time()
        try:
            yield
        finally:
            self.spans.append((lane, phase, start, time.time()))

    def add_proc(self, lane: str, items: Any, *, sent: float, answered: float) -> None:
        """A proc's (phase, start, end) spans of one call, moved onto this clock (`timeline.on_call_clock`)."""
        if isinstance(items, list):
            self.spans.extend((lane, phase, s, e) for phase, s, e in on_call_clock(items, sent=sent, answered=answered))

    def split(self, phase: str, parts: list[tuple[str, float, float]]) -> None:
        """This process's `phase` drawn as its parts (`WorkSpans.items` timed inside it, on this clock)."""
        self.spans = [span for span in self.spans if span[1] != phase] + [(self.lane, *part) for part in parts]

    def add_ranks(self, results: list[dict[str, Any]]) -> None:
        """Every trainer rank's spans (its result's "spans"), on lane `trainer <rank>`, within the window from the
        step's first call to the trainer to the end of the controller's "train" wait."""
        trains = [(start, end) for _, phase, start, end in self.spans if phase == "train"]
        if not trains:
            return
        sent = min(trains[0][0], self.train_sent if self.train_sent is not None else math.inf)
        for rank, result in enumerate(results):
            self.add_proc(f"trainer {rank}", result.get("spans"), sent=sent, answered=trains[-1][1])

    def record_timeline(self, recorder: Recorder, *, step: int) -> dict[str, float]:
        """Record where the step went, from this timer's start to now (`timeline.record_step_timeline`)."""
        return record_step_timeline(recorder, step=step, start=self.start, end=time.time(), spans=self.spans)

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": value for name, value in self.seconds.items()}


def mfu(*, n_params: int, tokens: int, seconds: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation with the 6 * params * tokens estimate (forward + backward)."""
    return 6.0 * n_params * tokens / max(seconds, 1e-9) / peak_flops_per_second


def train_tokens_per_second(*, tokens: int, step_seconds: float) -> float:
    """`throughput/train_tokens_per_s` in every recipe and mode: the step's trained tokens (the padded
    rows the trainer ran forward and backward, prompts included) over the step's wall time (`time/step_s`:
    generation, scoring and training, overlapped or not; evaluation and checkpoints excluded). Runs compare
    by it whatever overlaps inside a step, and a run's tokens are the sum of rate x step time."""
    return tokens / max(step_seconds, 1e-9)


def grad_norm_and_clip(model: nn.Module, max_norm: float | None) -> float:
    """The gradient's global norm (over every shard of a sharded model), clipped to max_norm when given (a NaN or
    infinite norm's gradients are dropped by data_parallel.apply_update, which decides on the norm alone)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):  # FSDP: each rank holds a partial norm of its shards
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


UPDATE_SKIPPED = "train/update_skipped"  # a step's metric: its optimizer updates skipped on NaN or infinite gradients


class RunDiverged(ConfigError):
    """Updates skipped on NaN or infinite gradients `trainer.max_skipped_updates` steps in a row (`SkippedUpdates`): on
    the field to change, as a config's error, under its own heading."""

    heading = "the run diverged"


class SkippedUpdates:
    """Says on the run page each step whose update was skipped (data_parallel.apply_update: NaN or infinite gradients),
    and ends a run with `limit` (trainer.max_skipped_updates) such steps in a row: its weights no longer train. Every
    recipe's `StepEnd.after` calls `check` with each step's logged metrics, before the step's eval and checkpoint."""

    def __init__(self, *, limit: int, recorder: Recorder):
        self.limit, self.recorder = limit, recorder
        self.in_a_row = 0
        self.first_step = 0  # the first step of the current row

    def check(self, metrics: dict[str, float], *, step: int) -> None:
        """RunDiverged on trainer.optimizer.lr when this step makes `limit` in a row."""
        if not metrics[UPDATE_SKIPPED]:
            self.in_a_row = 0
            return
        if self.in_a_row == 0:
            self.first_step = step
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise RunDiverged.on("trainer.optimizer.lr", (
                f"the gradients were NaN or infinite for {self.in_a_row} steps in a row from step {self.first_step}: "
                "the run diverged; lower trainer.optimizer.lr or resume from an earlier checkpoint"))
        self.recorder.event("message", step=step, text=(
            f"the gradients of step {step} were NaN or infinite: its update was skipped, the weights are those of the "
            f"step before ({self.in_a_row} in a row; trainer.max_skipped_updates {self.limit} in a row end the run)"))


@torch.no_grad()
def held_out_nll(model: nn.Module, tokenizer: ChatTokenizer, problems: list[Problem], *, seq_len: int, batch_size: int = 32) -> float:
    """Mean negative log-likelihood per reference-response token (SFT eval; needs no answers)."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0.0
    for start in range(0, len(problems), batch_size):
        examples = [tokenizer.encode_exchange(p.messages, p.response) for p in problems[start: start + batch_size]]
        batch = collate_sft(examples, seq_len=seq_len, pad_id=tokenizer.pad_id, packing=False).to(device)
        _, metrics = sft_loss(model(batch.inputs, positions=batch.positions), batch.targets, batch.loss_mask)
        total += metrics["nll"] * metrics["tokens"]
        tokens += metrics["tokens"]
    return total / max(tokens, 1.0)


@dataclass
class EvalResult:
    accuracy: float  # fraction of held-out problems whose greedy answer is exactly right
    reward_mean: float  # mean combined reward of the greedy completions
    samples: list[tuple[str, str, float]]  # (prompt, completion, reward) of the first few


def record_eval(recorder: Recorder, result: EvalResult, step: int) -> None:
    """A held-out evaluation's accuracy and mean reward as metrics and as an `eval` event (a line on the run's
    timeline), its kept samples as held-out rollouts."""
    recorder.log_many({"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean}, step)
    recorder.event("eval", step=step, accuracy=result.accuracy, reward_mean=result.reward_mean)
    for prompt, completion, score in result.samples:
        recorder.rollout(step=step, prompt=prompt, completion=completion, reward=score, split="held_out")


def evaluate(
    sampler: TorchSampler,
    tokenizer: ChatTokenizer,
    problems: list[Problem],
    reward: CombinedReward,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    keep_samples: int = 4,
) -> EvalResult:
    """Greedy completions of held-out problems, scored by the run's reward and by exact match."""
    correct, total_reward, samples = 0.0, 0.0, []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start: start + batch_size]
        prompts = [tokenizer.encode_prompt(p.messages) for p in chunk]
        completions = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True), seed=0)
        for problem, completion in zip(chunk, completions):
            text = tokenizer.decode_reply(completion.token_ids)
            score = reward(problem, text, completion.finished)
            total_reward += score.total
            if problem.answer is not None:
                correct += exact_math(problem, text, completion.finished)
            if len(samples) < keep_samples:
                samples.append((problem.messages[-1]["content"], text, score.total))
    n = max(len(problems), 1)
    return EvalResult(accuracy=correct / n, reward_mean=total_reward / n, samples=samples)
