"""The data-parallel GRPO trainer: one actor per rank, gradients summed over gloo (CPU) or NCCL.

Every rank receives the whole step's rollout batch, pads it identically, and trains on its
contiguous slice of rows. The loss normaliser counts the whole batch, so the sum of the
ranks' gradients is exactly the single-process gradient.

`trainer.sharding: replicate`: every rank holds the whole model; gradients are all-reduced,
every rank clips and steps the same way and the replicas stay identical. Only rank 0 is
asked for weights, evaluation and checkpoints.
`trainer.sharding: fsdp`: FSDP2 (`workers/engine/sharding.py`) shards parameters, gradients
and optimizer state; every rank runs the same number of forward/backward passes (a rank
short of rows runs a zero-weighted one), and weights, evaluation and checkpoints are
collectives every rank takes part in.
Joining the group, building the model, weights and checkpoints: `trainer_rank.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from monarch.actor import endpoint

from workers.engine.actors.trainer_rank import TrainerRankActor
from workers.engine.batching import RolloutBatch, collate_record
from workers.engine.behaviour_weights import BehaviourWeights
from workers.engine.data_parallel import all_reduce_gradients, apply_update, zero_weighted_pass
from workers.engine.grpo_math import (accumulate_gradients, kl_reward_advantages, loss_normalizer, policy_update,
                                      prepare_old_logprobs)
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.sharding import set_gradient_sync
from workers.engine.timeline import WorkSpans


def _new_step() -> dict[str, Any]:
    """What a pipelined step's chunks have added so far."""
    return {"loss": 0.0, "normalizer": 0.0, "parts": [], "train_tokens": 0, "filler": None, "shaping": {}, "rows": 0,
            "spans": WorkSpans()}


class TrainerActor(TrainerRankActor):
    def scheduled_updates(self) -> int:
        return self.config.trainer.steps * self.config.grpo.updates_per_step

    def prepare_steps(self) -> None:
        grpo = self.config.grpo
        correcting = grpo.mode == "async" and grpo.rollout_correction is not None
        self.behaviour = BehaviourWeights(max_policy_age=grpo.max_policy_age if correcting else 0)
        self._step_so_far = _new_step()

    def _batch(self, record: RolloutBatchRecord, ref_logprobs: torch.Tensor | None) -> tuple[RolloutBatch, dict[str, float]]:
        """The whole padded batch with its reference log-probs, the KL in its advantages when grpo.kl_in is reward."""
        cfg = self.config
        batch = collate_record(record, pad_id=self.tokenizer.pad_id, mask_truncated=cfg.grpo.overlong.filter).to(self.device)
        shaping = {}
        if ref_logprobs is not None:
            batch.ref_logprobs = ref_logprobs.to(self.device)
            if cfg.grpo.kl_in == "reward":
                shaping["kl/reward_penalty"] = kl_reward_advantages(batch, record.rewards, grpo=cfg.grpo)
        return batch, shaping

    @endpoint
    def train_step(self, record: RolloutBatchRecord, ref_logprobs: torch.Tensor | None, policy_version: int) -> dict[str, Any]:
        """One step on a rollout batch at the trainer's `policy_version`: epochs x mini_batches updates, each on this
        rank's rows of the update."""
        self.before_work(record, ref_logprobs)
        cfg = self.config
        if not self.behaviour.has(policy_version):  # the starting (or resumed) weights
            self.behaviour.record(self.model, version=policy_version)
        spans = WorkSpans()
        batch, shaping = self._batch(record, ref_logprobs)
        with spans.span("old_logprobs"):
            shaping.update(prepare_old_logprobs(
                self.model, batch, grpo=cfg.grpo, temperature=cfg.generator.temperature,
                micro_batch_size=cfg.trainer.micro_batch_size, policy_age=policy_version - record.policy_version,
                batch_version=record.policy_version, behaviour=self.behaviour))
        update = policy_update(
            self.model, self.optimizer, self.scheduler, batch, grpo=cfg.grpo, temperature=cfg.generator.temperature,
            micro_batch_size=cfg.trainer.micro_batch_size, grad_clip=cfg.trainer.optimizer.grad_clip,
            max_new_tokens=cfg.generator.max_new_tokens, share=self.share(),
            seed=cfg.trainer.seed * 1_000_003 + policy_version, spans=spans,
        )
        self.behaviour.record(self.model, version=policy_version + 1)
        mine, _ = batch.rank_rows(rank=self.rank, world=self.world)
        return {"loss": update.loss, "parts": update.parts, "grad_norm": update.grad_norm, "lr": update.lr,
                "updates": update.updates, "shaping": shaping, "train_tokens": int(mine.inputs.numel()),
                "spans": spans.items}

    @endpoint
    def accumulate(self, record: RolloutBatchRecord, ref_logprobs: torch.Tensor | None) -> int:
        """Pipelined GRPO: add one chunk of a step's rollouts (whole groups) to the gradients while later chunks
        are still generated. The step's normaliser is known only when every chunk is in, so chunks add summed
        losses and finish_step divides. Chunks may come in any order. Returns this rank's rows."""
        self.before_work(record, ref_logprobs)
        cfg = self.config
        batch, shaping = self._batch(record, ref_logprobs)
        shard, passes = self.share().rows(batch, cfg.trainer.micro_batch_size)
        step = self._step_so_far
        with step["spans"].span("forward_backward"):
            loss, parts = accumulate_gradients(
                self.model, shard, grpo=cfg.grpo, temperature=cfg.generator.temperature,
                micro_batch_size=cfg.trainer.micro_batch_size, normalizer=1.0, passes=passes, filler=batch.rows(0, 1),
                sync=False,
            )
        for key, value in shaping.items():  # the chunk's mean, weighted by its rows
            step["shaping"][key] = step["shaping"].get(key, 0.0) + value * len(batch)
        step["rows"] += len(batch)
        step["loss"] += loss
        step["normalizer"] += loss_normalizer(batch, cfg.grpo.aggregation, max_new_tokens=cfg.generator.max_new_tokens)
        step["parts"].extend(parts)
        step["train_tokens"] += int(shard.inputs.numel())
        step["filler"] = batch.rows(0, 1)
        return len(shard)

    @endpoint
    def finish_step(self) -> dict[str, Any]:
        """Pipelined GRPO: reduce the accumulated gradients over the ranks, divide by the step's normaliser, step."""
        step = self._step_so_far
        if step["filler"] is None:
            raise RuntimeError("finish_step without any accumulated chunk")
        spans = step["spans"]
        with spans.span("all_reduce"):
            if self.sharded:  # FSDP reduces in a backward: one more pass, weighted 0, with gradient sync on
                set_gradient_sync(self.model, enabled=True)
                zero_weighted_pass(self.model, step["filler"])
            elif self.world > 1:
                all_reduce_gradients(self.model)
        with spans.span("optimizer"):
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.div_(step["normalizer"])
            grad_norm, lr = apply_update(self.model, self.optimizer, self.scheduler,
                                         grad_clip=self.config.trainer.optimizer.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        self._step_so_far = _new_step()
        return {"loss": step["loss"] / step["normalizer"], "parts": step["parts"], "grad_norm": grad_norm, "lr": lr,
                "updates": 1, "shaping": {key: value / step["rows"] for key, value in step["shaping"].items()},
                "train_tokens": step["train_tokens"], "spans": spans.items}
