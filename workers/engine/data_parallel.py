"""Data-parallel training pieces shared by the GRPO and SFT trainers: which rows a rank takes, summing the replicas'
gradients, the zero-weighted pass a sharded rank short of rows runs, and one optimizer step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from workers.engine.training import grad_norm_and_clip


class RankRows(Protocol):
    inputs: torch.Tensor

    def rank_rows(self, *, rank: int, world: int) -> tuple[RankRows, int]: ...


Rows = TypeVar("Rows", bound=RankRows)


@dataclass(frozen=True)
class RankShare:
    """This process's place among the data-parallel trainer ranks; the default is a single process."""
    rank: int = 0
    world: int = 1
    sharded: bool = False  # FSDP: every rank runs as many forward/backward passes as rank 0
    reduce_gradients: Callable[[nn.Module], None] | None = None  # replicated ranks: sum the gradients

    def rows(self, batch: Rows, micro_batch_size: int) -> tuple[Rows, int]:
        """(this rank's rows of `batch`, the passes every rank runs: 0 unsharded, as many as it has rows for)."""
        mine, per_rank = batch.rank_rows(rank=self.rank, world=self.world)
        return mine, math.ceil(per_rank / micro_batch_size) if self.sharded else 0  # type: ignore[return-value]


ALL_REDUCE_BUCKET_ELEMENTS = 1 << 24  # gradients are summed in flat buckets of about this many elements (64 MiB fp32)


def all_reduce_gradients(model: nn.Module) -> None:
    """Sum every replicated rank's gradients, a few large all-reduces rather than one per tensor (a rank with no rows
    this step still joins with zeros). A bucket holds one dtype."""
    bucket: list[torch.Tensor] = []
    size = 0
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if bucket and (size >= ALL_REDUCE_BUCKET_ELEMENTS or param.grad.dtype != bucket[0].dtype):
            _all_reduce_flat(bucket)
            bucket, size = [], 0
        bucket.append(param.grad)
        size += param.grad.numel()
    if bucket:
        _all_reduce_flat(bucket)


def _all_reduce_flat(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def rank_share(*, rank: int, world: int, sharded: bool) -> RankShare:
    """A trainer rank's share: replicated ranks sum their gradients after the backward, FSDP reduces in it."""
    return RankShare(rank=rank, world=world, sharded=sharded,
                     reduce_gradients=all_reduce_gradients if world > 1 and not sharded else None)


def zero_weighted_pass(model: nn.Module, filler: RankRows) -> None:
    """A forward and backward that adds nothing to the gradients: a sharded rank's share of a collective."""
    (model(filler.inputs).float().sum() * 0.0).backward()


@dataclass(frozen=True)
class AppliedUpdate:
    grad_norm: float  # before clipping; NaN or infinite when the update was skipped
    lr: float  # the learning rate the update used (or would have)
    skipped: bool  # the gradients were NaN or infinite: the weights and the optimizer's state did not move


# torch's warning when a schedule's first step comes before any optimizer step
SCHEDULE_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, *,
                 grad_clip: float | None) -> AppliedUpdate:
    """Clip, step the optimizer and the schedule. When the gradient's norm is NaN or infinite (its clip would scale by
    0 and write inf x 0 = NaN into the weights, AdamW's step NaN into its moments) the update is skipped: no clip, no
    optimizer step, the gradients zeroed. The norm is global (all-reduced gradients, or FSDP's full norm), so every
    rank skips alike. The schedule still steps, as GradScaler's skipped steps and Megatron's skipped iterations do: the
    learning rate stays the one of the run's step (warm-up and decay are counted in trainer.steps, and a resume at step
    N takes the schedule at N), rather than the run's end coming before its schedule's."""
    grad_norm = grad_norm_and_clip(model, grad_clip)
    lr = scheduler.get_last_lr()[0]
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # torch takes a run's first update, skipped, for a schedule stepped too soon
            warnings.filterwarnings("ignore", message=SCHEDULE_BEFORE_OPTIMIZER, category=UserWarning)
            scheduler.step()
    else:
        optimizer.step()
        scheduler.step()
    return AppliedUpdate(grad_norm=grad_norm, lr=lr, skipped=skipped)
