from __future__ import annotations

from monarch.actor import endpoint

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.procs import set_proc_threads
from workers.engine.actors.weight_inbox import PublishedWeights
from workers.engine.training import resolve_device
from workers.engine.sampler import Completion, SamplingParams, TorchSampler
from workers.engine.timeline import ProcSpan, WorkSpans


class GeneratorActor(FaultInjectableActor, PublishedWeights):
    """One generator replica: the torch KV-cache sampler on its own copy of the weights, which the trainer publishes
    to the replica's WeightInboxActor (`actors/weight_inbox.py`)."""

    def __init__(self, model_folder: str, dtype: str, device: str):
        from workers.engine.models.hf_folder import load_pretrained  # model code: in the proc only (actors/__init__.py)

        set_proc_threads()
        bind_proc_gpus()  # placement gpus_per_proc: CUDA shows this proc its own GPU only
        loaded = self.unless_refused(load_pretrained, model_folder, dtype=dtype, device=resolve_device(device))
        if loaded is None:  # model.path's error: `pid` raises it
            return
        loaded.model.eval().requires_grad_(False)
        self.sampler = TorchSampler(loaded.model, eos_token_ids=loaded.tokenizer.eos_token_ids,
                                    pad_id=loaded.tokenizer.pad_id, policy_version=0)

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    def install_weights(self, state_dict: dict, version: int) -> None:
        self.before_work(state_dict, may_raise=False)  # a slow_host drill slows the weights' arrival too
        self.sampler.load_weights(state_dict, version)

    @endpoint
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                 publication: int | None = None) -> tuple[list[Completion], list[ProcSpan]]:
        """(completions by the weights of `publication`, this replica's spans: weight_load when it swapped weights in,
        generate)."""
        self.before_work(prompts)
        spans = WorkSpans()
        with spans.span("weight_load"):
            self.use_publication(publication)
        with spans.span("generate"):
            completions = self.sampler.generate(prompts, params, seed=seed)
        return completions, spans.items

    @endpoint
    def take_weights(self, publication: int) -> int:
        """A new replica's first weights: wait for `publication` in the inbox and load it; its policy version."""
        self.use_publication(publication)
        return self.sampler.policy_version
