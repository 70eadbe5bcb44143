"""The data-parallel SFT trainer: one actor per rank (`trainer_rank.py`), each step on its contiguous rows of the
whole packed batch, the loss normalised over the batch's response tokens (`sft_math.sft_update`), so the ranks'
summed gradients are one process's gradient."""

from __future__ import annotations

from typing import Any

from monarch.actor import endpoint

from workers.engine.actors.trainer_rank import TrainerRankActor
from workers.engine.batching import SftBatch
from workers.engine.sft_math import sft_update
from workers.engine.tasks import Problem
from workers.engine.timeline import WorkSpans
from workers.engine.training import held_out_nll


class SftTrainerActor(TrainerRankActor):
    @endpoint
    def sft_step(self, batch: SftBatch) -> dict[str, Any]:
        """One optimizer step; this rank's part of the loss (the parts sum to the step's loss), its rows and its spans."""
        self.before_work(batch)
        cfg = self.config.trainer
        spans = WorkSpans()
        update = sft_update(self.model, self.optimizer, self.scheduler, batch.to(self.device),
                            micro_batch_size=cfg.micro_batch_size, grad_clip=cfg.optimizer.grad_clip, share=self.share(),
                            spans=spans)
        return {"loss": update.loss, "grad_norm": update.grad_norm, "lr": update.lr, "rows": update.rows,
                "update_skipped": update.skipped,
                "spans": spans.items}

    @endpoint
    def held_out_nll(self, problems: list[Problem]) -> float:
        """Mean NLL of the held-out reference replies (every rank of a sharded trainer)."""
        self.model.eval()
        nll = held_out_nll(self.model, self.tokenizer, problems, seq_len=self.config.data.seq_len)
        self.model.train()
        return nll
