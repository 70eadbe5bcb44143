"""The SFT step's maths, shared by the single-process recipe and the Monarch trainer ranks: one optimizer step on a
packed batch, split over data-parallel ranks with the loss normalised by the whole batch's response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.engine.batching import SftBatch, collate_sft
from workers.engine.config import DataConfig
from workers.engine.data_parallel import RankShare, apply_update, zero_weighted_pass
from workers.engine.losses import sft_loss
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.sharding import set_gradient_sync
from workers.engine.tasks import Problem
from workers.engine.timeline import WorkSpans
from workers.engine.training import UPDATE_SKIPPED, PhaseTimer, mfu, train_tokens_per_second


@dataclass(frozen=True)
class SftUpdate:
    loss: float  # this rank's part of the step's loss: the ranks' parts sum to one process's loss
    grad_norm: float  # before clipping, of the whole (summed) gradient
    lr: float
    rows: int  # this rank's rows
    skipped: bool  # the gradients were NaN or infinite: no update (data_parallel.apply_update)


def sft_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: SftBatch,
    *,
    micro_batch_size: int,
    grad_clip: float | None,
    share: RankShare = RankShare(),
    spans: WorkSpans | None = None,
) -> SftUpdate:
    """One optimizer step on a step's batch (the whole batch, on every rank): this rank's contiguous rows in
    micro-batches, each loss divided by the batch's response tokens, so summing the ranks' gradients
    (`share.reduce_gradients`, or FSDP's reduce-scatter in the last pass) gives one process's gradient. A sharded rank
    short of rows runs zero-weighted passes to keep its peers' collectives matched. `spans`: where its time went."""
    span = (spans or WorkSpans()).span
    normalizer = max(float(batch.loss_mask.sum()), 1.0)
    mine, passes = share.rows(batch, micro_batch_size)
    starts = list(range(0, len(mine), micro_batch_size))
    total = max(len(starts), passes)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    with span("forward_backward"):
        for i in range(total):
            set_gradient_sync(model, enabled=i == total - 1)
            if i >= len(starts):
                zero_weighted_pass(model, batch.rows(0, 1))
                continue
            micro = mine.rows(starts[i], starts[i] + micro_batch_size)
            logits = model(micro.inputs, positions=micro.positions, attention_masks=micro.attention_mask)
            loss, _ = sft_loss(logits, micro.targets, micro.loss_mask, normalizer=normalizer)
            loss.backward()
            loss_sum += float(loss.detach())
    if share.reduce_gradients is not None:
        with span("all_reduce"):
            share.reduce_gradients(model)
    with span("optimizer"):
        applied = apply_update(model, optimizer, scheduler, grad_clip=grad_clip)
    return SftUpdate(loss=loss_sum, grad_norm=applied.grad_norm, lr=applied.lr, rows=len(mine), skipped=applied.skipped)


def sft_batch(problems: list[Problem], *, tokenizer: ChatTokenizer, data: DataConfig) -> SftBatch:
    """A step's examples as rows of at most data.seq_len tokens, packed when data.packing."""
    examples = [tokenizer.encode_exchange(p.messages, p.response) for p in problems]
    return collate_sft(examples, seq_len=data.seq_len, pad_id=tokenizer.pad_id, packing=data.packing)


def held_out_dropped(problems: list[Problem], *, tokenizer: ChatTokenizer, seq_len: int) -> int:
    """How many held-out examples eval/nll leaves out: a prompt longer than seq_len cuts off the whole response (which
    always holds at least the end of turn), so `collate_sft` leaves none of it to score. Preflight warns of them."""
    return sum(len(tokenizer.encode_prompt(problem.messages)) > seq_len for problem in problems)


def sft_step_metrics(*, update_loss: float, grad_norm: float, update_skipped: bool, lr: float, batch: SftBatch,
                     step_seconds: float, timer: PhaseTimer, n_params: int, peak_flops_per_second: float,
                     epoch: int) -> dict[str, float]:
    """What either SFT recipe logs for a step (`update_loss`: the step's loss, summed over the ranks)."""
    tokens = int(batch.inputs.numel())
    return {
        "loss": update_loss,
        "grad_norm": grad_norm,
        UPDATE_SKIPPED: int(update_skipped),
        "lr": lr,
        "time/step_s": step_seconds,
        **timer.metrics(),
        "throughput/train_tokens_per_s": train_tokens_per_second(tokens=tokens, step_seconds=step_seconds),
        "data/train_tokens": tokens,
        "data/response_tokens": int(batch.loss_mask.sum()),
        "data/no_response_share": batch.examples_cut / max(batch.examples, 1),  # cut off whole by data.seq_len
        "mfu": mfu(n_params=n_params, tokens=tokens, seconds=step_seconds, peak_flops_per_second=peak_flops_per_second),
        "data/epoch": epoch,
    }
