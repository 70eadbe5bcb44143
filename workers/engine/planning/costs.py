"""Every formula of the step-cost model, in one place: what one piece of a GRPO step costs in seconds on a device with
the efficiencies of a `Calibration`. `whatif.predict` adds the pieces up per mode.

  compute        FLOPs / (peak FLOP/s x efficiency x devices)
  memory         bytes / (bandwidth x efficiency)
  a message      alpha + bytes / (bandwidth x link efficiency)           (the latency-bandwidth model)
  ring all-reduce   2 (n - 1) messages of S / n bytes each per rank      (reduce-scatter, then all-gather)
  decode step    overhead + max(compute, memory): memory is the weights plus the KV cache read once a step
  processor sharing  procs that oversubscribe shared devices all slow down alike until one ends
"""

from __future__ import annotations

import math

from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import DeviceSpec
from workers.engine.planning.shapes import BYTES_PER_VALUE, ModelShape

GRADIENT_DTYPE = "float32"  # the trainer's master weights and gradients
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 28, "sgd": 12}  # fp32 reads of p, g, m, v and writes of p, m, v (sgd: p, g, p)


def compute_seconds(flops: float, *, device: DeviceSpec, efficiency: float, devices: int = 1) -> float:
    return flops / (device.peak_flops * efficiency * max(1, devices))


def message_seconds(nbytes: float, *, bandwidth: float, latency_s: float, efficiency: float) -> float:
    return latency_s + nbytes / (bandwidth * efficiency)


def ring_all_reduce_bytes(nbytes: float, *, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2 (n - 1) / n x nbytes."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes


def ring_all_gather_bytes(nbytes: float, *, ranks: int) -> float:
    """Bytes each rank sends to all-gather (or reduce-scatter) a tensor of `nbytes` in total: (n - 1) / n x nbytes."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes


def ring_seconds(sent_bytes: float, *, ranks: int, steps_per_rank: int, bandwidth: float, latency_s: float,
                 efficiency: float) -> float:
    """A ring collective: `steps_per_rank` x (n - 1) messages, `sent_bytes` in all per rank."""
    if ranks <= 1:
        return 0.0
    return steps_per_rank * (ranks - 1) * latency_s + sent_bytes / (bandwidth * efficiency)


def link_bandwidth(device: DeviceSpec, *, spans_hosts: bool) -> float:
    """A ring is as fast as its slowest link: between hosts once its ranks span hosts."""
    return device.inter_host_bandwidth if spans_hosts else device.intra_host_bandwidth


def prefill_seconds(shape: ModelShape, *, sequences: int, prompt_tokens: float, device: DeviceSpec,
                    calibration: Calibration, devices: int) -> float:
    flops = sequences * prompt_tokens * shape.forward_flops_per_token(context=prompt_tokens)
    return compute_seconds(flops, device=device, efficiency=calibration.compute_efficiency, devices=devices)


def decode_step_seconds(shape: ModelShape, *, sequences: int, context: float, dtype: str, device: DeviceSpec,
                        calibration: Calibration, devices: int) -> float:
    """One decode step of a batch: the per-step overhead plus the longer of its compute and its memory traffic (each
    device of a tensor-parallel replica reads its share of the weights and of the KV cache)."""
    flops = sequences * shape.forward_flops_per_token(context=context)
    compute = compute_seconds(flops, device=device, efficiency=calibration.compute_efficiency, devices=devices)
    nbytes = (shape.weight_bytes(dtype) + sequences * context * shape.kv_bytes_per_token(dtype)) / max(1, devices)
    memory = nbytes / (device.memory_bandwidth * calibration.memory_efficiency)
    return calibration.decode_step_overhead_s + max(compute, memory)


KV_CACHE_SHARE = 0.9  # of a replica's memory left after its weights that holds the KV cache (vLLM's gpu_memory_utilization)


def concurrent_sequences(shape: ModelShape, *, prompt_tokens: float, response_tokens: float, dtype: str,
                         device: DeviceSpec, devices: int, limit: int | None) -> int | None:
    """How many sequences a replica decodes at once: `limit` (the engine's cap, vLLM's max_num_seqs) and what its KV
    cache holds at full length; None: no cap (a torch generator on this machine's memory decodes the whole batch)."""
    if device.shared:
        return limit
    free = (device.memory_bytes * devices * KV_CACHE_SHARE) - shape.weight_bytes(dtype)
    fit = max(1, int(free // max(1.0, (prompt_tokens + response_tokens) * shape.kv_bytes_per_token(dtype))))
    return min(fit, limit) if limit else fit


def generation_seconds(shape: ModelShape, *, sequences: int, prompt_tokens: float, response_tokens: float,
                       dtype: str, device: DeviceSpec, calibration: Calibration, devices: int,
                       max_concurrent: int | None = None, prefilled: int | None = None) -> float:
    """One generate request: the prompts' prefill (of `prefilled` sequences: a generator that prefills a group's
    prompt once; None: every sequence), then one decode step per response token at the mean context; a request of
    more sequences than a replica decodes at once runs in waves."""
    if sequences <= 0:
        return 0.0
    cap = concurrent_sequences(shape, prompt_tokens=prompt_tokens, response_tokens=response_tokens, dtype=dtype,
                               device=device, devices=devices, limit=max_concurrent)
    waves = math.ceil(sequences / cap) if cap else 1
    wave = math.ceil(sequences / waves)
    prefill = prefill_seconds(shape, sequences=sequences if prefilled is None else prefilled,
                              prompt_tokens=prompt_tokens, device=device, calibration=calibration, devices=devices)
    step = decode_step_seconds(shape, sequences=wave, context=prompt_tokens + response_tokens / 2, dtype=dtype,
                               device=device, calibration=calibration, devices=devices)
    return prefill + waves * math.ceil(response_tokens) * step


def forward_backward_seconds(shape: ModelShape, *, tokens: float, seq_len: float, device: DeviceSpec,
                             calibration: Calibration, devices: int) -> float:
    flops = tokens * shape.training_flops_per_token(seq_len=seq_len)
    return compute_seconds(flops, device=device, efficiency=calibration.train_efficiency, devices=devices)


def forward_seconds(shape: ModelShape, *, tokens: float, seq_len: float, device: DeviceSpec,
                    calibration: Calibration, devices: int) -> float:
    """A forward without a backward (pi_old or reference log-probs), at the trainer's efficiency."""
    flops = tokens * shape.forward_flops_per_token(context=seq_len)
    return compute_seconds(flops, device=device, efficiency=calibration.train_efficiency, devices=devices)


def optimizer_seconds(params: float, *, optimizer: str, device: DeviceSpec, calibration: Calibration) -> float:
    """An optimizer step is memory-bound: every fp32 state of the rank's parameters read and written once."""
    nbytes = params * OPTIMIZER_BYTES_PER_PARAM[optimizer]
    return nbytes / (device.memory_bandwidth * calibration.optimizer_efficiency)


def gradient_sync_seconds(shape: ModelShape, *, ranks: int, sharding: str, spans_hosts: bool, device: DeviceSpec,
                          calibration: Calibration) -> float:
    """Replicated ranks all-reduce their gradients; FSDP ranks all-gather the weights for the forward and again for the
    backward and reduce-scatter the gradients (3 x (n - 1) / n of the model's bytes)."""
    nbytes = shape.params() * BYTES_PER_VALUE[GRADIENT_DTYPE]
    bandwidth = link_bandwidth(device, spans_hosts=spans_hosts)
    if sharding == "fsdp":
        sent, steps = 3 * ring_all_gather_bytes(nbytes, ranks=ranks), 3 * shape.layers
    else:
        sent, steps = ring_all_reduce_bytes(nbytes, ranks=ranks), 2
    return ring_seconds(sent, ranks=ranks, steps_per_rank=steps, bandwidth=bandwidth, latency_s=device.link_latency_s,
                        efficiency=calibration.link_efficiency)


def weight_sync_seconds(shape: ModelShape, *, ranks: int, replicas: int, dtype: str, spans_hosts: bool,
                        device: DeviceSpec, calibration: Calibration) -> float:
    """Every trainer rank serves its 1/ranks of the policy and every generator replica reads all of them at once
    (`actors/weight_outbox.py`): a replica takes in the whole model, a rank sends its part to every replica, and the
    busier end bounds the sync."""
    nbytes = shape.weight_bytes(dtype)
    busiest = max(nbytes, replicas * nbytes / max(1, ranks))
    return message_seconds(busiest, bandwidth=link_bandwidth(device, spans_hosts=spans_hosts),
                           latency_s=device.link_latency_s, efficiency=calibration.sync_efficiency)


def weight_copy_seconds(shape: ModelShape, *, dtype: str, device: DeviceSpec, calibration: Calibration) -> float:
    """generator.in_trainer: a rank copies its float32 weights into its generator's `dtype` copy, in its own memory
    (read once, written once)."""
    nbytes = shape.weight_bytes("float32") + shape.weight_bytes(dtype)
    return nbytes / (device.memory_bandwidth * calibration.memory_efficiency)


def shared_seconds(*works: tuple[float, float], capacity: float) -> float:
    """How long work of several kinds started together takes on `capacity` shared devices: each (seconds alone,
    devices it keeps busy) runs at full speed while the devices suffice; once they are oversubscribed every
    running work slows by the same factor (processor sharing, as an OS scheduler shares cores), until one ends and
    leaves its share to the others. The last one's end (a serial path cannot use the devices another left idle)."""
    left = [seconds for seconds, busy in works if seconds > 0 and busy > 0]
    busy = [busy for seconds, busy in works if seconds > 0 and busy > 0]
    elapsed = 0.0
    running = list(range(len(left)))
    while running:
        rate = min(1.0, capacity / sum(busy[i] for i in running))
        step = min(left[i] for i in running) / rate
        elapsed += step
        for i in running:
            left[i] -= step * rate
        running = [i for i in running if left[i] > 1e-12]
    return elapsed
