from __future__ import annotations

import torch
from monarch.actor import endpoint

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.procs import set_proc_threads
from workers.engine.batching import collate_rollouts
from workers.engine.training import resolve_device
from workers.engine.grpo_math import sequence_logprobs
from workers.engine.replay_buffer import RolloutBatchRecord


class ReferenceActor(FaultInjectableActor):
    """The frozen starting model: tempered log-probs of rollout tokens, for the KL penalty."""

    def __init__(self, model_folder: str, dtype: str, device: str):
        from workers.engine.models.hf_folder import load_pretrained  # model code: in the proc only (actors/__init__.py)

        set_proc_threads()
        bind_proc_gpus()  # placement gpus_per_proc: CUDA shows this proc its own GPU only
        loaded = self.unless_refused(load_pretrained, model_folder, dtype=dtype, device=resolve_device(device))
        if loaded is None:  # model.path's error: `pid` raises it
            return
        self.model = loaded.model.eval().requires_grad_(False)
        self.pad_id = loaded.tokenizer.pad_id

    @endpoint
    def ping(self) -> bool:
        return True

    @endpoint
    def logprobs(self, record: RolloutBatchRecord, micro_batch_size: int, temperature: float,
                 packing: bool = False) -> torch.Tensor:
        """[B, L-1] for the batch as `collate_rollouts` pads it (forwards over packed rows with grpo.packing)."""
        self.before_work(record)
        batch = collate_rollouts(record.prompts, record.responses, record.logprobs, record.advantages, pad_id=self.pad_id)
        device = next(self.model.parameters()).device
        return sequence_logprobs(self.model, batch.to(device), micro_batch_size=micro_batch_size,
                                 temperature=temperature, packing=packing).cpu()
