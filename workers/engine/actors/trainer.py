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
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import endpoint
from torch import nn

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.procs import set_proc_threads
from workers.engine.batching import RolloutBatch, collate_record
from workers.engine.behaviour_weights import BehaviourWeights
from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.config import RunConfig
from workers.engine.env import LOCAL_RANK_ENV, MASTER_ADDR_ENV, read_env, read_number
from workers.engine.grpo_math import (RankShare, accumulate_gradients, apply_update, kl_reward_advantages, loss_normalizer,
                                      policy_update, prepare_old_logprobs, zero_weighted_pass)
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.models.titan import count_parameters
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import TorchSampler
from workers.engine.sharding import full_model_state, full_optimizer_state, set_gradient_sync, shard_model
from workers.engine.tasks import Problem
from workers.engine.training import EvalResult, build_optimizer, build_scheduler, evaluate, resolve_device, setup_process


def _new_step() -> dict[str, Any]:
    """What a pipelined step's chunks have added so far."""
    return {"loss": 0.0, "normalizer": 0.0, "parts": [], "train_tokens": 0, "filler": None, "shaping": {}, "rows": 0}


def all_reduce_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        if param.grad is None:  # a rank with no rows this step still joins the collective
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


class TrainerActor(FaultInjectableActor):
    def __init__(self, config: RunConfig):
        set_proc_threads()
        self.config = config
        self.own_gpu = bind_proc_gpus() is not None  # placement.trainer.gpus_per_proc: this rank's GPU is cuda:0
        self.device = torch.device("cuda", 0) if self.own_gpu else resolve_device(config.trainer.device)

    @endpoint
    def setup(self, master_addr: str | None = None) -> dict[str, Any]:
        """Join the process group (env from monarch's setup_torch_elastic_env), then build the model.

        `master_addr`: how the other hosts reach rank 0's host, when the ranks span hosts (monarch names it by its
        hostname, which a pod's peers cannot resolve)."""
        cfg = self.config
        if master_addr:
            os.environ[MASTER_ADDR_ENV] = master_addr
        if self.device.type == "cuda" and not self.own_gpu:  # one GPU per rank on its host (LOCAL_RANK from monarch)
            self.device = torch.device("cuda", read_number(LOCAL_RANK_ENV) % torch.cuda.device_count())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # bounded: a rank whose peer died must not wait in a collective for the default 30 min
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timedelta(minutes=5))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        setup_process(threads=torch.get_num_threads(), seed=cfg.trainer.seed)
        loaded = load_pretrained(cfg.model.path, family=cfg.model.family, dtype=cfg.model.dtype, device=self.device)
        self.model, self.tokenizer = loaded.model.train(), loaded.tokenizer
        n_params = count_parameters(self.model)
        self.sharded = cfg.trainer.sharding == "fsdp"
        if self.sharded:
            shard_model(self.model, mixed_precision=cfg.trainer.mixed_precision)
        self.optimizer = build_optimizer(self.model, cfg.trainer.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.trainer.optimizer, cfg.trainer.steps * cfg.grpo.updates_per_step)
        correcting = cfg.grpo.mode == "async" and cfg.grpo.rollout_correction is not None
        self.behaviour = BehaviourWeights(max_policy_age=cfg.grpo.max_policy_age if correcting else 0)
        self._step_so_far = _new_step()
        return {"rank": self.rank, "world": self.world, "n_params": n_params, "master_addr": read_env(MASTER_ADDR_ENV)}

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

    def _share(self) -> RankShare:
        return RankShare(rank=self.rank, world=self.world, sharded=self.sharded,
                         reduce_gradients=all_reduce_gradients if self.world > 1 and not self.sharded else None)

    @endpoint
    def train_step(self, record: RolloutBatchRecord, ref_logprobs: torch.Tensor | None, policy_version: int) -> dict[str, Any]:
        """One step on a rollout batch at the trainer's `policy_version`: epochs x mini_batches updates, each on this
        rank's rows of the update."""
        self.before_work(record, ref_logprobs)
        cfg = self.config
        if not self.behaviour.has(policy_version):  # the starting (or resumed) weights
            self.behaviour.record(self.model, version=policy_version)
        batch, shaping = self._batch(record, ref_logprobs)
        shaping.update(prepare_old_logprobs(
            self.model, batch, grpo=cfg.grpo, temperature=cfg.generator.temperature,
            micro_batch_size=cfg.trainer.micro_batch_size, policy_age=policy_version - record.policy_version,
            batch_version=record.policy_version, behaviour=self.behaviour))
        update = policy_update(
            self.model, self.optimizer, self.scheduler, batch, grpo=cfg.grpo, temperature=cfg.generator.temperature,
            micro_batch_size=cfg.trainer.micro_batch_size, grad_clip=cfg.trainer.optimizer.grad_clip,
            max_new_tokens=cfg.generator.max_new_tokens, share=self._share(),
            seed=cfg.trainer.seed * 1_000_003 + policy_version,
        )
        self.behaviour.record(self.model, version=policy_version + 1)
        mine, _ = batch.rank_rows(rank=self.rank, world=self.world)
        return {"loss": update.loss, "parts": update.parts, "grad_norm": update.grad_norm, "lr": update.lr,
                "updates": update.updates, "shaping": shaping, "train_tokens": int(mine.inputs.numel())}

    @endpoint
    def accumulate(self, record: RolloutBatchRecord, ref_logprobs: torch.Tensor | None) -> int:
        """Pipelined GRPO: add one chunk of a step's rollouts (whole groups) to the gradients while later chunks
        are still generated. The step's normaliser is known only when every chunk is in, so chunks add summed
        losses and finish_step divides. Chunks may come in any order. Returns this rank's rows."""
        self.before_work(record, ref_logprobs)
        cfg = self.config
        batch, shaping = self._batch(record, ref_logprobs)
        shard, passes = self._share().rows(batch, cfg.trainer.micro_batch_size)
        loss, parts = accumulate_gradients(
            self.model, shard, grpo=cfg.grpo, temperature=cfg.generator.temperature,
            micro_batch_size=cfg.trainer.micro_batch_size, normalizer=1.0, passes=passes, filler=batch.rows(0, 1),
            sync=False,
        )
        step = self._step_so_far
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
        if self.sharded:  # FSDP reduces in a backward: one more pass, weighted 0, with gradient sync on
            set_gradient_sync(self.model, enabled=True)
            zero_weighted_pass(self.model, step["filler"])
        elif self.world > 1:
            all_reduce_gradients(self.model)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(step["normalizer"])
        grad_norm, lr = apply_update(self.model, self.optimizer, self.scheduler, grad_clip=self.config.trainer.optimizer.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        self._step_so_far = _new_step()
        return {"loss": step["loss"] / step["normalizer"], "parts": step["parts"], "grad_norm": grad_norm, "lr": lr,
                "updates": 1, "shaping": {key: value / step["rows"] for key, value in step["shaping"].items()},
                "train_tokens": step["train_tokens"]}

    @endpoint
    def pids(self) -> int:
        return os.getpid()

    @endpoint
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on CPU (every replicated rank; only rank 0 of a sharded trainer)."""
        state = full_model_state(self.model)
        return state if self.rank == 0 or not self.sharded else None

    @endpoint
    def evaluate(self, problems: list[Problem], keep_samples: int) -> EvalResult:
        cfg = self.config
        sampler = TorchSampler(self.model, eos_token_ids=self.tokenizer.eos_token_ids, pad_id=self.tokenizer.pad_id)
        self.model.eval()
        result = evaluate(sampler, self.tokenizer, problems, CombinedReward(cfg.reward.functions, cfg.reward.weights),
                          max_new_tokens=cfg.generator.max_new_tokens, keep_samples=keep_samples)
        self.model.train()
        return result

    @endpoint
    def save(self, step: int, progress: dict[str, Any]) -> str | None:
        """Rank 0 writes the checkpoint (full states, whatever the sharding); its path, None on the other ranks."""
        if self.rank != 0 and not self.sharded:
            return None
        model_state = full_model_state(self.model)
        optimizer_state = full_optimizer_state(self.model, self.optimizer)
        if self.rank != 0:
            return None
        cfg = self.config.checkpoint
        path = save_checkpoint(cfg.folder, step=step, model_state=model_state, optimizer_state=optimizer_state,
                               scheduler_state=self.scheduler.state_dict(), progress=progress,
                               model_folder=self.config.model.path, keep_last=cfg.keep_last)
        return str(path)

    @endpoint
    def load(self, path: str) -> dict[str, Any]:
        return load_checkpoint(Path(path), model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    @endpoint
    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
