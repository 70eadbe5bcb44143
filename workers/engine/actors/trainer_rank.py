"""What every data-parallel trainer rank does, whatever it trains: join the process group, load and (with
`trainer.sharding: fsdp`) shard the model, build the optimizer and schedule, hand out its weights, save and load
checkpoints. The GRPO trainer (`trainer.py`) and the SFT trainer (`sft_trainer.py`) add their steps.

Checkpoints hold full (unsharded) states, so a run resumes on any number of ranks, sharded or not."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import endpoint
from torch.utils.hooks import RemovableHandle

from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.procs import set_proc_threads
from workers.engine.actors.weight_outbox import WeightOutbox, WeightPart
from workers.engine.checkpoint import load_checkpoint, save_checkpoint
from workers.engine.checkpoint_folders import resume_field
from workers.engine.config import RunConfig
from workers.engine.data_parallel import RankShare, rank_share
from workers.engine.env import LOCAL_RANK_ENV, MASTER_ADDR_ENV, read_env, read_number
from workers.engine.precision import DTYPES, apply_mixed_precision
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import TorchSampler
from workers.engine.sharding import full_model_state, full_optimizer_state, shard_model
from workers.engine.tasks import Problem
from workers.engine.training import EvalResult, build_optimizer, build_scheduler, evaluate, resolve_device, setup_process


class NanGradients:
    """The nan_gradients drill on one rank: once armed, the first parameter gradient accumulated (in the next update's
    first backward) is filled with NaN. Accumulation keeps it NaN through the update's other micro-batches and the
    ranks' all-reduce (FSDP: the hook runs once it is reduced into this rank's shard, whose norm every rank sums), so
    the update's norm is NaN and data_parallel.apply_update skips it on every rank. Hooks on the accumulated gradients
    hit the update whichever forward made them (the fused head's too), and not the no-grad ones (old log-probs, eval)."""

    def __init__(self) -> None:
        self.armed = False
        self.hooks: dict[int, RemovableHandle] = {}  # by id(parameter)

    def arm(self, model: torch.nn.Module) -> None:
        self.disarm()
        self.armed = True
        self.hooks = {id(param): param.register_post_accumulate_grad_hook(self._fill)
                      for param in model.parameters() if param.requires_grad}

    def disarm(self) -> None:
        for hook in self.hooks.values():
            hook.remove()
        self.hooks = {}

    def _fill(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.armed = False
        param.grad.fill_(math.nan)
        # the other hooks go now; this one at the next arming (its own parameter's hooks are being run)
        for key, hook in self.hooks.items():
            if key != id(param):
                hook.remove()
        self.hooks = {id(param): self.hooks[id(param)]}


class TrainerRankActor(FaultInjectableActor):
    nan_gradients: NanGradients | None = None  # made when a nan_gradients drill first arms this rank

    def __init__(self, config: RunConfig):
        set_proc_threads()
        self.config = config
        self.own_gpu = bind_proc_gpus() is not None  # placement.trainer.gpus_per_proc: this rank's GPU is cuda:0
        self.device = torch.device("cuda", 0) if self.own_gpu else resolve_device(config.trainer.device)
        self.outbox = WeightOutbox()

    def arm_fault(self, kind: str, *, duration_s: float, latency_ms: float | None, bandwidth_mbps: float | None) -> None:
        """A trainer rank also takes nan_gradients: its gradients of the next update are NaN (`NanGradients`)."""
        if kind != "nan_gradients":
            super().arm_fault(kind, duration_s=duration_s, latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps)
            return
        if self.nan_gradients is None:
            self.nan_gradients = NanGradients()
        self.nan_gradients.arm(self.model)

    def scheduled_updates(self) -> int:
        """Optimizer steps the learning-rate schedule spans."""
        return self.config.trainer.steps

    def keep_starting_model(self, model: torch.nn.Module) -> None:
        """Copy what a trainer needs of the model as loaded, before it is sharded or wrapped for mixed precision."""

    def prepare_steps(self) -> None:
        """What a trainer keeps between its steps, made once the model is built."""

    @endpoint
    def setup(self, master_addr: str | None = None) -> dict[str, Any]:
        """Join the process group (env from monarch's setup_torch_elastic_env), then build the model.

        `master_addr`: how the other hosts reach rank 0's host, when the ranks span hosts (monarch names it by its
        hostname, which a pod's peers cannot resolve)."""
        from workers.engine.models.hf_folder import load_pretrained  # model code: in the proc only (actors/__init__.py)
        from workers.engine.models.titan import count_parameters

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
        self.keep_starting_model(self.model)
        self.sharded = cfg.trainer.sharding == "fsdp"
        if self.sharded:
            shard_model(self.model, mixed_precision=cfg.trainer.mixed_precision)
        else:
            apply_mixed_precision(self.model, mixed_precision=cfg.trainer.mixed_precision)
        self.optimizer = build_optimizer(self.model, cfg.trainer.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.trainer.optimizer, self.scheduled_updates())
        self.prepare_steps()
        return {"rank": self.rank, "world": self.world, "n_params": n_params, "master_addr": read_env(MASTER_ADDR_ENV)}

    def share(self) -> RankShare:
        return rank_share(rank=self.rank, world=self.world, sharded=self.sharded)

    @endpoint
    def pids(self) -> int:
        return os.getpid()

    @endpoint
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on CPU (every replicated rank; only rank 0 of a sharded trainer)."""
        state = full_model_state(self.model)
        return state if self.rank == 0 or not self.sharded else None

    @endpoint
    def stage_weights(self, reuse: bool) -> WeightPart | None:
        """Stage this rank's part of the current weights for the generators' inboxes to read
        (`actors/weight_outbox.py`), in place of the last one (in its memory with `reuse`: every read of it ended);
        the part (None when this rank serves none). The controller times the call: the sync's cost on the trainer's
        path (`weight_sync` on the step's timeline). An FSDP rank stages its own shards: no collective. The
        weights are staged in the generators' dtype (`RunConfig.rollout_dtype`)."""
        return self.outbox.stage(self.model.state_dict(), rank=self.rank, world=self.world, sharded=self.sharded,
                                 reuse=reuse, dtype=DTYPES[self.config.rollout_dtype])

    @endpoint
    def evaluate(self, problems: list[Problem], keep_samples: int) -> EvalResult:
        """Greedy completions of held-out problems, scored by the run's reward (every rank of a sharded trainer)."""
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
        path = save_checkpoint(cfg.folder, step=step, recipe=self.config.recipe, model_state=model_state,
                               optimizer_state=optimizer_state, scheduler_state=self.scheduler.state_dict(),
                               progress=progress, model_folder=self.config.model.path, keep_last=cfg.keep_last)
        return str(path)

    @endpoint
    def load(self, path: str) -> dict[str, Any]:
        """Back to the checkpoint at `path`; one it refuses is a ConfigError on the field that named it: the run's own
        checkpoints are checkpoint.folder's."""
        cfg = self.config.checkpoint
        field = resume_field(self.config) if path == cfg.resume_from else "checkpoint.folder"
        return load_checkpoint(Path(path), model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                               field=field)

    @endpoint
    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
