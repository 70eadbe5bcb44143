from __future__ import annotations

import time

from monarch.actor import endpoint

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.procs import set_proc_threads
from workers.engine.models.hf_folder import load_pretrained
from workers.engine.training import resolve_device
from workers.engine.sampler import Completion, SamplingParams, TorchSampler


class GeneratorActor(FaultInjectableActor):
    """One generator replica: the torch KV-cache sampler on its own copy of the weights."""

    def __init__(self, model_folder: str, dtype: str, device: str):
        set_proc_threads()
        bind_proc_gpus()  # placement gpus_per_proc: CUDA shows this proc its own GPU only
        loaded = load_pretrained(model_folder, dtype=dtype, device=resolve_device(device))
        loaded.model.eval().requires_grad_(False)
        self.sampler = TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids,
                                    pad_id=loaded.tokenizer.pad_id, policy_version=0)

    @endpoint
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> tuple[list[Completion], float]:
        """(completions, seconds this replica spent generating them)."""
        self.before_work(prompts)
        start = time.perf_counter()
        completions = self.sampler.generate(prompts, params, seed=seed)
        return completions, time.perf_counter() - start

    @endpoint
    def load_weights(self, state_dict: dict, version: int) -> float:
        self.before_work(state_dict, may_raise=False)
        start = time.perf_counter()
        self.sampler.load_weights(state_dict, version)
        return time.perf_counter() - start

    @endpoint
    def policy_version(self) -> int:
        return self.sampler.policy_version
