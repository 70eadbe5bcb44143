"""What a GRPO step will cost with a placement, and how to split devices between generators and trainer ranks.

  Workload      what one step does, from a run config: prompts x group, prompt and response tokens, updates, the
                mode and its overlap (`max_policy_age`, `pipeline_chunks`), a reference, the optimizer
  Placement     how many trainer ranks, generator replicas and reference replicas, and the devices each holds; or
                the trainer's ranks generating themselves (generator.in_trainer, sync mode: no generator replicas)
  predict       the step's phases (costs.py) put together per mode -> StepPrediction: step seconds, tokens/s,
                each role's utilisation, the bottleneck, and whether the model fits the devices
  plan          for several scales (default 3, 12, 48, 192 devices): the placement as written, scaled, and the best
                generator/trainer split, with the predicted gain

How the modes overlap (the controller's loop, controller/generation.py):
  sync       weight sync, then generation, reward, reference and the trainer's work one after another
  async      generation of the next batch, then its reward, runs while the trainer trains on this one: a step is
             the longer of the generators' path (generation, reward) and the trainer's (weight sync, reference,
             training), both slowed when they oversubscribe shared devices. A replica serves one request at a time,
             so `max_policy_age` above 1 adds batches in flight that absorb jitter but not a longer overlap: the
             steady state is the same
  pipelined  a step's generation in `pipeline_chunks` requests; the trainer starts on the first chunk while the
             replicas generate the others: the first chunk's generation and the last chunk's training are exposed,
             the rest overlaps
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers.engine.planning import costs
from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import DeviceSpec
from workers.engine.planning.shapes import BYTES_PER_VALUE, ModelShape

DEFAULT_SCALES = (3, 12, 48, 192)
VLLM_MAX_NUM_SEQS = 256  # vLLM's default cap on the sequences one engine schedules at once
TRAINER_STATE_BYTES_PER_PARAM = {"adamw": 16, "sgd": 8}  # fp32 weights and gradients, and Adam's two moments
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 34  # a transformer layer's saved activations in 16-bit (Korthikanti et al.)


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work, independent of where it runs."""

    prompts: int
    group_size: int
    prompt_tokens: float  # mean per sequence
    response_tokens: float  # mean generated per sequence (what the trainer trains on)
    decode_steps: int  # decode steps of a generate request: its longest response
    updates: int = 1  # optimizer steps per batch (epochs x mini-batches)
    epochs: int = 1
    old_logprobs: bool = False  # the trainer recomputes pi_old before its updates
    reference: bool = False
    mode: str = "sync"
    max_policy_age: int = 0
    pipeline_chunks: int = 2
    dtype: str = "float32"  # the generator's weights, the weight sync's and the trainer's activations (rollout_dtype)
    optimizer: str = "adamw"
    sharding: str = "replicate"
    micro_batch_size: int = 8  # rows a trainer rank runs forward/backward on at once (its activations' memory)
    max_concurrent_sequences: int | None = None  # a replica's cap on sequences decoded at once (vLLM: max_num_seqs)
    shared_prefill: bool = False  # the generator prefills a group's prompt once (the torch sampler)
    shared_prompt_training: bool = False  # grpo.packing: the trainer's and reference's forwards run it once too

    @classmethod
    def from_config(cls, config: Any, *, prompt_tokens: float | None = None,
                    response_tokens: float | None = None) -> "Workload":
        """From a validated `RunConfig`. Without measured lengths a prompt is assumed `data.max_prompt_tokens` long and
        every response runs to `generator.max_new_tokens` (the worst case)."""
        grpo, max_new = config.grpo, config.generator.max_new_tokens
        return cls(
            prompts=config.trainer.batch_size, group_size=grpo.group_size,
            prompt_tokens=float(prompt_tokens if prompt_tokens is not None else config.data.max_prompt_tokens),
            response_tokens=float(response_tokens if response_tokens is not None else max_new),
            decode_steps=max_new, updates=grpo.epochs * grpo.mini_batches, epochs=grpo.epochs,
            old_logprobs=grpo.rollout_correction is not None or grpo.epochs * grpo.mini_batches > 1,
            reference=config.reference.enabled, mode=grpo.mode,
            max_policy_age=grpo.max_policy_age if grpo.mode == "async" else 0, pipeline_chunks=grpo.pipeline_chunks,
            dtype=config.rollout_dtype, optimizer=config.trainer.optimizer.name, sharding=config.trainer.sharding,
            micro_batch_size=config.trainer.micro_batch_size,
            max_concurrent_sequences=VLLM_MAX_NUM_SEQS if config.generator.backend == "vllm" else None,
            shared_prefill=config.generator.backend == "torch", shared_prompt_training=grpo.packing)

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    @property
    def seq_len(self) -> float:
        return self.prompt_tokens + self.response_tokens

    @property
    def trained_tokens(self) -> float:
        """Positions a trainer forward runs per sequence: its prompt's share when a group's prompt runs once."""
        if self.shared_prompt_training:
            return self.response_tokens + self.prompt_tokens / self.group_size
        return self.seq_len

    @property
    def overlapped(self) -> str:
        """The overlap the loop really gets: async with age 0 is sync."""
        return "async" if self.mode == "async" and self.max_policy_age >= 1 else (
            "pipelined" if self.mode == "pipelined" else "sync")


def workload_for(config: Any, *, measured: Workload | None = None) -> Workload:
    """The config's workload, with the prompt and response lengths a measured run had when there is one (a response
    no longer than this config lets it be)."""
    if measured is None:
        return Workload.from_config(config)
    return Workload.from_config(config, prompt_tokens=measured.prompt_tokens,
                                response_tokens=min(measured.response_tokens, config.generator.max_new_tokens))


@dataclass(frozen=True)
class Placement:
    trainer_ranks: int
    generator_replicas: int
    devices_per_rank: int = 1
    devices_per_generator: int = 1
    reference_replicas: int = 0
    devices_per_reference: int = 1
    generator_in_trainer: bool = False  # each trainer rank generates its share on its own devices

    @classmethod
    def from_config(cls, config: Any) -> "Placement":
        """GPUs: a proc's `gpus_per_proc` (at least 1); CPU: its `trainer.threads_per_process` cores."""
        on_cpu = config.trainer.device == "cpu"
        per = lambda rule: config.trainer.threads_per_process if on_cpu else max(1, rule.gpus_per_proc)  # noqa: E731
        place = config.placement
        in_trainer = config.generator.in_trainer
        return cls(trainer_ranks=config.trainer.ranks, generator_replicas=0 if in_trainer else config.generator.replicas,
                   devices_per_rank=per(place.trainer), devices_per_generator=per(place.generator),
                   reference_replicas=config.reference.replicas if config.reference.enabled else 0,
                   devices_per_reference=per(place.reference), generator_in_trainer=in_trainer)

    @property
    def trainer_devices(self) -> int:
        return self.trainer_ranks * self.devices_per_rank

    @property
    def generator_devices(self) -> int:
        return self.generator_replicas * self.devices_per_generator

    @property
    def generating_devices(self) -> int:
        """The devices generation keeps busy: the trainer's when it generates."""
        return self.trainer_devices if self.generator_in_trainer else self.generator_devices

    @property
    def devices(self) -> int:
        return self.trainer_devices + self.generator_devices + self.reference_replicas * self.devices_per_reference

    def describe(self) -> str:
        ref = f" + {self.reference_replicas} reference" if self.reference_replicas else ""
        if self.generator_in_trainer:
            return (f"{self.trainer_ranks} trainer rank{'s' * (self.trainer_ranks != 1)} x {self.devices_per_rank}, "
                    f"generating{ref}")
        return (f"{self.trainer_ranks} trainer rank{'s' * (self.trainer_ranks != 1)} x {self.devices_per_rank} + "
                f"{self.generator_replicas} generator{'s' * (self.generator_replicas != 1)} x "
                f"{self.devices_per_generator}{ref}")


@dataclass(frozen=True)
class StepPrediction:
    placement: Placement
    devices: int
    mode: str
    prompts: int
    phases: dict[str, float]  # seconds of each piece of the step, each on its own (before overlap)
    step_s: float
    sequences_per_s: float
    generated_tokens_per_s: float
    train_tokens_per_s: float
    utilization: dict[str, float]  # each role's busy share of the step
    bottleneck: str
    fits: bool
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["placement"]["description"] = self.placement.describe()
        return data


def _host_count(devices: int, device: DeviceSpec) -> int:
    return 1 if device.shared else math.ceil(devices / device.devices_per_host)


def generate_requests(workload: Workload, placement: Placement) -> tuple[int, int]:
    """(requests the busiest replica serves a step, prompts a request): one request a replica, or in pipelined mode
    `pipeline_chunks` requests spread over the replicas (the trainer's ranks when they generate)."""
    replicas = max(1, placement.trainer_ranks if placement.generator_in_trainer else placement.generator_replicas)
    if workload.overlapped == "pipelined":
        return math.ceil(workload.pipeline_chunks / replicas), math.ceil(workload.prompts / workload.pipeline_chunks)
    return 1, math.ceil(workload.prompts / replicas)


def phase_seconds(shape: ModelShape, workload: Workload, placement: Placement, *, device: DeviceSpec,
                  calibration: Calibration) -> dict[str, float]:
    """Every piece of one step alone on its own devices (no overlap, no sharing), in seconds. `generate` is one
    replica's request (its share of the step's prompts), `generate_chunk` one request of a pipelined step."""
    w, p, cal = workload, placement, calibration
    ranks = p.trainer_ranks
    requests, prompts_per_request = generate_requests(w, p)
    generate = lambda prompts: costs.generation_seconds(  # noqa: E731
        shape, sequences=prompts * w.group_size, prompt_tokens=w.prompt_tokens, response_tokens=w.decode_steps,
        dtype=w.dtype, device=device, calibration=cal,
        devices=p.devices_per_rank if p.generator_in_trainer else p.devices_per_generator,
        max_concurrent=w.max_concurrent_sequences, prefilled=prompts if w.shared_prefill else None)
    rank_tokens = w.sequences / ranks * w.trained_tokens
    per_rank = dict(device=device, calibration=cal, devices=p.devices_per_rank)
    trainer_spans_hosts = _host_count(p.trainer_devices, device) > 1
    rank_params = shape.params() / (ranks if w.sharding == "fsdp" else 1) / p.devices_per_rank
    phases = {
        "weight_sync": costs.weight_copy_seconds(shape, dtype=w.dtype, device=device, calibration=cal)
        if p.generator_in_trainer else
        costs.weight_sync_seconds(shape, ranks=ranks, replicas=p.generator_replicas, dtype=w.dtype,
                                  spans_hosts=_host_count(p.devices, device) > 1, device=device, calibration=cal),
        "generate": requests * generate(prompts_per_request),
        "generate_chunk": generate(prompts_per_request),
        "reward": w.sequences * cal.reward_s_per_sequence,
        "reference": costs.forward_seconds(shape, tokens=w.sequences * w.trained_tokens, seq_len=w.seq_len, device=device,
                                           calibration=cal, devices=p.devices_per_reference)
        if w.reference else 0.0,
        "old_logprobs": costs.forward_seconds(shape, tokens=rank_tokens, seq_len=w.seq_len, **per_rank)
        if w.old_logprobs else 0.0,
        "forward_backward": w.epochs * costs.forward_backward_seconds(shape, tokens=rank_tokens, seq_len=w.seq_len,
                                                                      **per_rank),
        "all_reduce": w.updates * costs.gradient_sync_seconds(shape, ranks=ranks, sharding=w.sharding,
                                                              spans_hosts=trainer_spans_hosts, device=device,
                                                              calibration=cal),
        "optimizer": w.updates * costs.optimizer_seconds(rank_params, optimizer=w.optimizer, device=device,
                                                         calibration=cal),
        "overhead": cal.step_overhead_s,
    }
    return phases


def _memory_notes(shape: ModelShape, workload: Workload, placement: Placement, device: DeviceSpec) -> list[str]:
    w, p = workload, placement
    notes = []
    state = shape.params() * TRAINER_STATE_BYTES_PER_PARAM[w.optimizer]
    state /= p.trainer_ranks if w.sharding == "fsdp" else 1
    rows = max(1.0, min(w.micro_batch_size, w.sequences / p.trainer_ranks))
    activations = (rows * w.seq_len * shape.hidden * shape.layers * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN
                   * BYTES_PER_VALUE[w.dtype] / 2)  # the 34 bytes are 16-bit values
    trainer_need, trainer_have = state + activations, device.memory_bytes * p.devices_per_rank
    one_sequence = (w.prompt_tokens + w.decode_steps) * shape.kv_bytes_per_token(w.dtype)
    gen_need = shape.weight_bytes(w.dtype) + one_sequence  # more sequences than fit run in waves (costs.py)
    if p.generator_in_trainer:
        trainer_need += gen_need
    if trainer_need > trainer_have:
        generating = ", its generator's weights and one sequence's KV cache" if p.generator_in_trainer else ""
        notes.append(f"a trainer rank needs ~{trainer_need / 1e9:.1f} GB (weights, gradients, optimizer state"
                     f"{'' if w.sharding == 'fsdp' else '; fsdp would shard them'}, activations without checkpointing"
                     f"{generating}) and has {trainer_have / 1e9:.0f} GB")
    gen_have = device.memory_bytes * p.devices_per_generator * costs.KV_CACHE_SHARE
    if not p.generator_in_trainer and gen_need > gen_have:
        notes.append(f"a generator replica needs ~{gen_need / 1e9:.1f} GB (weights and one sequence's KV cache) and "
                     f"has {gen_have / 1e9:.0f} GB: give it more devices (tensor parallel)")
    return notes


def predict(shape: ModelShape, workload: Workload, placement: Placement, *, device: DeviceSpec,
            calibration: Calibration, capacity: int | None = None) -> StepPrediction:
    """One steady-state step of `workload` with `placement` on `device`. `capacity`: the devices the procs share
    (unset: a shared device's host, this machine's cores; else each proc's own devices)."""
    w, p = workload, placement
    ph = phase_seconds(shape, w, p, device=device, calibration=calibration)
    capacity = float(capacity or (device.devices_per_host if device.shared else p.devices))
    gen_busy, train_busy = float(p.generating_devices), float(p.trainer_devices)
    stretch = lambda busy: max(1.0, busy / capacity)  # noqa: E731  (work alone on shared devices)
    train = ph["old_logprobs"] + ph["forward_backward"] + ph["all_reduce"] + ph["optimizer"]
    controller_path = ph["weight_sync"] + ph["reward"] + ph["reference"] + ph["overhead"]
    if w.overlapped == "sync":
        step = ph["generate"] * stretch(gen_busy) + train * stretch(train_busy) + controller_path
    elif w.overlapped == "async":  # the next batch is scored while the trainer trains (`score_ahead`)
        trainer_path = train * stretch(train_busy) + ph["weight_sync"] + ph["reference"] + ph["overhead"]
        generator_path = ph["generate"] + ph["reward"]
        step = costs.shared_seconds((generator_path, gen_busy), (trainer_path, train_busy), capacity=capacity)
        step = max(step, trainer_path)
    else:
        chunks = w.pipeline_chunks
        first = ph["generate_chunk"] * stretch(gen_busy)
        chunk_train = (ph["old_logprobs"] + ph["forward_backward"]) / chunks
        overlapped = costs.shared_seconds((ph["generate"] - ph["generate_chunk"], gen_busy),
                                          ((chunks - 1) * chunk_train, train_busy), capacity=capacity)
        step = (first + overlapped + chunk_train * stretch(train_busy)
                + (ph["all_reduce"] + ph["optimizer"]) * stretch(train_busy) + controller_path)
    step = max(step, 1e-9)
    generating = ph["generate"] * stretch(gen_busy)
    training = train * stretch(train_busy)
    trainer_busy = training + (generating if p.generator_in_trainer else 0.0)  # its devices do both, in turn
    utilization = {"generator": min(1.0, generating / step), "trainer": min(1.0, trainer_busy / step)}
    if p.reference_replicas:
        utilization["reference"] = min(1.0, ph["reference"] / step)
    critical = {"generation": generating, "training": training, "weight sync": ph["weight_sync"],
                "reward and reference": ph["reward"] + ph["reference"], "controller overhead": ph["overhead"]}
    bottleneck = max(critical, key=lambda name: critical[name])
    notes = _memory_notes(shape, w, p, device)
    return StepPrediction(
        placement=p, devices=p.devices, mode=w.overlapped, prompts=w.prompts, phases=ph, step_s=step,
        sequences_per_s=w.sequences / step, generated_tokens_per_s=w.sequences * w.response_tokens / step,
        train_tokens_per_s=w.epochs * w.sequences * w.seq_len / step, utilization=utilization, bottleneck=bottleneck,
        fits=not notes, notes=notes)


@dataclass(frozen=True)
class ScalePlan:
    devices: int
    as_written: StepPrediction
    best: StepPrediction
    gain: float  # the as-written step's seconds over the best split's

    def to_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "as_written": self.as_written.to_dict(), "best": self.best.to_dict(),
                "gain": self.gain}


def scaled_placement(placement: Placement, *, devices: int) -> Placement:
    """The placement as written, grown (or shrunk) to `devices` in proportion, each role at least one proc (a
    trainer that generates takes every device the reference leaves)."""
    ratio = devices / placement.devices
    refs = max(1, round(placement.reference_replicas * ratio)) if placement.reference_replicas else 0
    if placement.generator_in_trainer:
        ranks = max(1, (devices - refs * placement.devices_per_reference) // placement.devices_per_rank)
        return replace(placement, trainer_ranks=ranks, reference_replicas=refs)
    ranks = max(1, round(placement.trainer_ranks * ratio))
    left = devices - ranks * placement.devices_per_rank - refs * placement.devices_per_reference
    replicas = max(1, left // placement.devices_per_generator)
    return replace(placement, trainer_ranks=ranks, generator_replicas=replicas, reference_replicas=refs)


def splits(placement: Placement, *, devices: int) -> list[Placement]:
    """Every split of `devices` between trainer ranks and generator replicas (procs of the written sizes), the
    reference replicas scaled as written; a trainer that generates has one way to use them (`scaled_placement`)."""
    if placement.generator_in_trainer:
        return [scaled_placement(placement, devices=devices)]
    refs = scaled_placement(placement, devices=devices).reference_replicas
    free = devices - refs * placement.devices_per_reference
    out = []
    for ranks in range(1, free // placement.devices_per_rank + 1):
        replicas = (free - ranks * placement.devices_per_rank) // placement.devices_per_generator
        if replicas >= 1:
            out.append(replace(placement, trainer_ranks=ranks, generator_replicas=replicas, reference_replicas=refs))
    return out


def plan(shape: ModelShape, workload: Workload, placement: Placement, *, device: DeviceSpec,
         calibration: Calibration, scales: tuple[int, ...] = DEFAULT_SCALES, batch: str = "scaled") -> list[ScalePlan]:
    """At each scale: the placement as written (scaled) and the fastest split that fits. `batch` "scaled": the step's
    prompts grow with the devices (weak scaling, the usual way a run is scaled up); "fixed": the same prompts."""
    if batch not in ("scaled", "fixed"):
        raise ValueError("batch: 'scaled' or 'fixed'")
    out = []
    for devices in scales:
        minimum = placement.devices_per_rank + (0 if placement.generator_in_trainer else placement.devices_per_generator)
        if devices < minimum:
            raise ValueError(f"{devices} devices cannot hold a trainer rank and a generator replica ({minimum})")
        prompts = max(1, round(workload.prompts * devices / placement.devices)) if batch == "scaled" else workload.prompts
        scaled = replace(workload, prompts=prompts)
        shared = devices if device.shared else None  # a scale of shared devices: that many cores
        written = predict(shape, scaled, scaled_placement(placement, devices=devices), device=device,
                          calibration=calibration, capacity=shared)
        candidates = [predict(shape, scaled, split, device=device, calibration=calibration, capacity=shared)
                      for split in splits(placement, devices=devices)]
        fitting = [c for c in candidates if c.fits] or candidates
        best = min(fitting, key=lambda c: c.step_s)
        if written.fits and written.step_s <= best.step_s:
            best = written
        out.append(ScalePlan(devices=devices, as_written=written, best=best, gain=written.step_s / best.step_s))
    return out
