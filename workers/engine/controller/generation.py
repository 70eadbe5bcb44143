"""The generation pipeline of a Monarch GRPO run: the newest weights synced to the generators (versioned, timed),
one step's problems sent to the generators, their completions scored by the reward actor and buffered.

  sync, async  `next_batch`: launch generations until max_policy_age + 1 batches are buffered or in flight (each
               launch first syncs the newest weights), await the oldest, score and buffer it, and take the trainer's
               batch from the replay buffer within the age bound. Launched generations keep running on the
               generator procs while the trainer trains: that is the async overlap.
  pipelined    `train_pipelined`: each chunk of the step is scored, gets its reference log-probs and goes to the
               trainer as soon as its generation returns, while the generators work on later chunks; the trainer
               steps once every chunk is in.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine.actors.fleet import Failover, ReplicaGroup
from workers.engine.config import RunConfig
from workers.engine.controller.control_procs import ControlProcs
from workers.engine.controller.drill_targets import DrillTargets
from workers.engine.controller.requests import Request, Router
from workers.engine.controller.state import PendingGeneration, RunState
from workers.engine.controller.supervision import Supervisor
from workers.engine.controller.trainer import TrainerHandle, TrainerLost
from workers.engine.controller.waits import Waits
from workers.engine.grpo_math import check_prompt_lengths
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.replay_buffer import concat_records
from workers.engine.sampler import SamplingParams
from workers.engine.timeline import phase_seconds
from workers.engine.training import PhaseTimer


@dataclass
class Batch:
    """The trainer's batch of one step, and what generating it took this step."""

    record: Any  # a RolloutBatchRecord
    generated_tokens: int = 0
    generate_seconds: float = 0.0  # the slowest replica's


class GenerationPipeline:
    def __init__(self, *, config: RunConfig, tokenizer: ChatTokenizer, groups: Mapping[str, ReplicaGroup],
                 trainer: TrainerHandle, control: ControlProcs, router: Router, supervisor: Supervisor,
                 failover: Failover, waits: Waits, drills: DrillTargets, state: RunState):
        self.config, self.tokenizer, self.groups, self.trainer, self.control = config, tokenizer, groups, trainer, control
        self.router, self.supervisor, self.failover, self.waits = router, supervisor, failover, waits
        self.drills, self.state = drills, state
        self.generators = groups["generator"]
        gen = config.generator
        self.sampling = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p)
        self.max_age = config.grpo.max_policy_age if config.grpo.mode == "async" else 0

    # --- weights and launches -----------------------------------------------------------
    def sync_weights(self, timer: PhaseTimer) -> None:
        """The trainer ranks stage the current policy and every serving generator's inbox reads it from them. Only
        the staging is waited for (`time/weight_sync_s`, the sync's cost on the step's path, with the wait for the
        last publication's reads); each replica swaps the version in before the first request that names it,
        whatever it is still generating."""
        state = self.state
        with timer.phase("weight_sync"):
            replicas = self.generators.live()
            state.publications += 1
            with timer.span_on("trainer 0", "weight_sync"):
                self.trainer.publish_weights(replicas, state.publications)
            state.generator_version = state.policy_version
            for replica in replicas:
                replica.version = state.policy_version
            self.supervisor.repair()

    def launch(self, timer: PhaseTimer, *, chunks: int = 0) -> PendingGeneration:
        """Send one step's problems to the generators: `chunks` requests (whole groups each), or one per serving replica."""
        cfg, state, group_size = self.config, self.state, self.config.grpo.group_size
        self.supervisor.repair()
        if state.generator_version != state.policy_version:
            self.sync_weights(timer)
        data_state = self.control.call(self.control.dataset.state_dict.call_one())
        problems = self.control.call(self.control.dataset.take.call_one(cfg.trainer.batch_size))
        encoded = [self.tokenizer.encode_prompt(p.messages) for p in problems]  # once a group
        prompts = [list(prompt) for prompt in encoded for _ in range(group_size)]
        check_prompt_lengths(prompts, cfg.data.max_prompt_tokens)
        publication = state.publications  # every request of this batch is generated by these weights
        groups_per_call = math.ceil(len(problems) / (chunks or len(self.generators.service.routable())))
        calls, spans = [], []
        for c, first in enumerate(range(0, len(problems), groups_per_call)):
            spans.append((first, min(len(problems), first + groups_per_call)))
            chunk = prompts[first * group_size:(first + groups_per_call) * group_size]
            seed = cfg.trainer.seed * 1_000_003 + state.generations * 1_000 + c
            calls.append(self.router.send(
                self.generators, lambda actor, chunk=chunk, seed=seed: actor.generate.call_one(
                    chunk, self.sampling, seed, publication), key=problems[first].messages[-1]["content"]))
        state.generations += 1
        return PendingGeneration(problems, prompts, calls, data_state, state.generations - 1, spans)

    def received(self, request: Request, timer: PhaseTimer) -> tuple[list[Any], float]:
        """A generation request's completions and the seconds its replica spent generating; the replica's spans go on
        the step's timeline (lane `generator <index>`)."""
        completions, spans = self.router.receive(request)
        now = time.time()
        timer.add_proc(f"generator {request.index}", spans, sent=now - (time.monotonic() - request.sent_at), answered=now)
        return completions, phase_seconds(spans, "generate")

    def score(self, problems: list[Any], prompts: list[list[int]], completions: list[Any], timer: PhaseTimer) -> Any:
        group_size = self.config.grpo.group_size
        with timer.span_on("reward", "reward"):
            return self.router.call(self.groups["reward"], lambda actor: actor.score.call_one(problems, prompts,
                                                                                              completions, group_size))

    def reference_logprobs(self, record: Any, timer: PhaseTimer) -> Any:
        """The reference model's log-probs of the record (for the KL penalty), or None without a reference."""
        if "reference" not in self.groups:
            return None
        micro, temperature = self.config.trainer.micro_batch_size, self.config.generator.temperature
        packing = self.config.grpo.packing
        with timer.phase("reference"), timer.span_on("reference", "reference"):
            return self.router.call(self.groups["reference"],
                                    lambda actor: actor.logprobs.call_one(record, micro, temperature, packing))

    # --- sync and async ---------------------------------------------------------------
    def finish(self, pending: PendingGeneration, timer: PhaseTimer) -> tuple[int, float]:
        """Await a launched generation, score and buffer it; (tokens, slowest replica's seconds)."""
        with timer.phase("generate_wait"):
            completions, busiest = [], 0.0
            for request in pending.calls:
                part, seconds = self.received(request, timer)
                completions.extend(part)
                busiest = max(busiest, seconds)
        with timer.phase("reward"):
            record = self.score(pending.problems, pending.prompts, completions, timer)
            self.control.call(self.control.buffer.put.call_one(record))
        return sum(len(c.token_ids) for c in completions), busiest

    def next_batch(self, timer: PhaseTimer) -> Batch:
        """Generate (launching ahead), score and buffer until the replay buffer gives a batch within the age bound."""
        state, buffer, batch = self.state, self.control.buffer, Batch(record=None)
        while batch.record is None:
            buffered = self.control.call(buffer.stats.call_one())["batches"]
            while buffered + len(state.pending) < self.max_age + 1:
                state.pending.append(self.launch(timer))
                buffered = self.control.call(buffer.stats.call_one())["batches"]
            if buffered == 0:
                tokens, seconds = self.finish(state.pending.popleft(), timer)
                batch.generated_tokens += tokens
                batch.generate_seconds += seconds
            batch.record = self.control.call(buffer.take.call_one(state.policy_version))
        return batch

    # --- pipelined ----------------------------------------------------------------------
    def train_pipelined(self, generation: PendingGeneration, timer: PhaseTimer) -> tuple[Batch, list[dict[str, Any]]]:
        """(the step's batch, every rank's results). TrainerLost when the trainer failed: the step did not happen and
        its rollouts are dropped."""
        self.drills.inject_due()  # before the trainer sees any chunk of this step
        trainer, group_size = self.trainer, self.config.grpo.group_size
        chunks: list[Any] = []
        sent: list[tuple[Any, Any, Any]] = []  # (chunk, reference log-probs, the trainer's pending accumulate)
        tokens, seconds_per_replica = 0, Counter[int]()  # a replica works through its chunks one after another
        for request, (first, last) in zip(generation.calls, generation.spans):
            with timer.phase("generate_wait"):
                completions, seconds = self.received(request, timer)
            tokens += sum(len(c.token_ids) for c in completions)
            seconds_per_replica[request.index] += seconds
            with timer.phase("reward"):
                chunk = self.score(generation.problems[first:last],
                                   generation.prompts[first * group_size:last * group_size], completions, timer)
            ref = self.reference_logprobs(chunk, timer)
            chunks.append(chunk)
            if timer.train_sent is None:
                timer.train_sent = time.time()
            sent.append((chunk, ref, trainer.actors.accumulate.call(chunk, ref)))
        try:
            with timer.phase("train"):
                for chunk, ref, pending_call in sent:
                    trainer.every_rank(lambda chunk=chunk, ref=ref: trainer.actors.accumulate.call(chunk, ref),
                                       what="a pipelined chunk", sent=pending_call)
                results = trainer.every_rank(lambda: trainer.actors.finish_step.call(), what="a pipelined step")
        except TrainerLost:
            self.state.totals.samples_dropped += len(generation.prompts)
            raise
        return Batch(concat_records(chunks), tokens, max(seconds_per_replica.values())), results

    def drain(self, *, dropped: bool) -> None:
        """Finish the generations in flight and throw them away (`dropped`: count their samples as dropped)."""
        while self.state.pending:
            generation = self.state.pending.popleft()
            for request in generation.calls:
                self.router.receive(request)
            if dropped:
                self.state.totals.samples_dropped += len(generation.prompts)
