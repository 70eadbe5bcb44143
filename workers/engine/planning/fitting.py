"""A `Calibration` fitted from what a run recorded: its `step_timeline` events (the per-step spans of every proc,
timeline.py) and its step metrics. Each efficiency is the model's seconds at efficiency 1 over the measured seconds,
medians over the steps after the warm-up; what the model has no formula for (the controller's own work per step, a
decode step's fixed cost) is the remainder.

The run should be a sync one (its phases do not overlap, so each span is a phase alone); on shared devices (this
machine's cores) the spans of procs that oversubscribe the cores are de-stretched the way `whatif.predict` stretches
them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from workers.engine.planning import costs
from workers.engine.planning.calibration import Calibration
from workers.engine.planning.devices import DeviceSpec
from workers.engine.planning.shapes import ModelShape
from workers.engine.planning.whatif import Placement, Workload, generate_requests, phase_seconds, predict

DEFAULT_WARMUP_STEPS = 2
TRAINER_PHASES = ("forward_backward", "optimizer", "all_reduce", "old_logprobs", "weight_sync")


@dataclass(frozen=True)
class MeasuredStep:
    """One step's seconds per phase: the trainer's as the mean over its ranks (weight_sync: rank 0's), generation
    as the slowest replica's (the slowest rank's when the trainer generates)."""

    step: int
    seconds: float
    phases: dict[str, float]


def measured_steps(timelines: Iterable[Mapping[str, Any]]) -> list[MeasuredStep]:
    """The phases of each `step_timeline` payload, in step order."""
    out = []
    for timeline in timelines:
        lanes = list(timeline.get("lanes") or [])
        per_lane: dict[str, dict[str, float]] = {}
        for lane_index, phase, start, end in timeline.get("spans") or []:
            if 0 <= lane_index < len(lanes):
                lane = per_lane.setdefault(lanes[lane_index], {})
                lane[phase] = lane.get(phase, 0.0) + float(end) - float(start)
        trainers = [spans for lane, spans in per_lane.items() if lane.startswith("trainer ")]
        generators = [spans for lane, spans in per_lane.items() if lane.startswith("generator ")] or trainers
        phases = {phase: statistics.fmean(t.get(phase, 0.0) for t in trainers) if trainers else 0.0
                  for phase in TRAINER_PHASES}
        rank0 = per_lane.get("trainer 0", {})  # its weight_load: the copy of a trainer that generates
        phases["weight_sync"] = rank0.get("weight_sync", 0.0) + rank0.get("weight_load", 0.0)
        phases["generate"] = max((g.get("generate", 0.0) for g in generators), default=0.0)
        phases["reward"] = per_lane.get("reward", {}).get("reward", 0.0)
        phases["reference"] = per_lane.get("reference", {}).get("reference", 0.0)
        out.append(MeasuredStep(step=int(timeline["step"]), seconds=float(timeline["seconds"]), phases=phases))
    return sorted(out, key=lambda s: s.step)


def median_step(steps: list[MeasuredStep], *, warmup: int = DEFAULT_WARMUP_STEPS) -> MeasuredStep:
    """The median of every phase (and of the step's seconds) over the steps after `warmup`."""
    kept = [s for s in steps if s.step > warmup] or steps
    if not kept:
        raise ValueError("the run recorded no step_timeline events to calibrate from")
    phases = {name: statistics.median(s.phases.get(name, 0.0) for s in kept) for name in kept[0].phases}
    return MeasuredStep(step=len(kept), seconds=statistics.median(s.seconds for s in kept), phases=phases)


UNIT = Calibration(train_efficiency=1.0, compute_efficiency=1.0, memory_efficiency=1.0, decode_step_overhead_s=0.0,
                   optimizer_efficiency=1.0, link_efficiency=1.0, sync_efficiency=1.0, reward_s_per_sequence=0.0,
                   step_overhead_s=0.0)


def _efficiency(ideal: float, measured: float, *, default: float) -> float:
    return ideal / measured if ideal > 0 and measured > 0 else default


def calibrate(shape: ModelShape, workload: Workload, placement: Placement, *, device: DeviceSpec,
              measured: MeasuredStep, source: Mapping[str, Any] | None = None) -> Calibration:
    """The coefficients under which `predict` reproduces `measured` for this workload and placement."""
    base = Calibration()
    ideal = phase_seconds(shape, workload, placement, device=device, calibration=UNIT)
    m = measured.phases
    capacity = float(device.devices_per_host if device.shared else placement.devices)
    train_stretch = max(1.0, placement.trainer_devices / capacity)
    gen_stretch = max(1.0, placement.generating_devices / capacity)
    alone = {name: value / train_stretch for name, value in m.items() if name in TRAINER_PHASES}
    train_efficiency = _efficiency(ideal["forward_backward"], alone["forward_backward"], default=base.train_efficiency)
    updates = max(1, workload.updates)
    latency = costs.ring_seconds(0.0, ranks=placement.trainer_ranks, steps_per_rank=2, bandwidth=1.0,
                                 latency_s=device.link_latency_s, efficiency=1.0) * updates
    sync_latency = device.link_latency_s
    sync_efficiency = _efficiency(ideal["weight_sync"] - sync_latency, m["weight_sync"] - sync_latency,
                                  default=base.sync_efficiency)
    # one rank has no collective to measure: its links are the ones the weights went over
    link_efficiency = _efficiency(ideal["all_reduce"] - latency, alone["all_reduce"] - latency,
                                  default=base.link_efficiency) if placement.trainer_ranks > 1 else sync_efficiency
    cal = replace(
        base, device=device.name, train_efficiency=train_efficiency,
        optimizer_efficiency=_efficiency(ideal["optimizer"], alone["optimizer"], default=base.optimizer_efficiency),
        link_efficiency=link_efficiency, sync_efficiency=sync_efficiency,
        reward_s_per_sequence=m["reward"] / max(1, workload.sequences),
        compute_efficiency=train_efficiency, source=dict(source or {}))
    cal = _fit_generation(shape, workload, placement, device=device, calibration=cal,
                          measured=m["generate"] / gen_stretch)
    modelled = predict(shape, workload, placement, device=device, calibration=replace(cal, step_overhead_s=0.0))
    return replace(cal, step_overhead_s=max(0.0, measured.seconds - modelled.step_s))


def _fit_generation(shape: ModelShape, workload: Workload, placement: Placement, *, device: DeviceSpec,
                    calibration: Calibration, measured: float) -> Calibration:
    """A generate request's seconds split into its FLOPs and bytes (at the trainer's efficiency) and a fixed cost per
    decode step (the remainder). When the FLOPs alone take longer than measured, there is no fixed cost and the
    efficiencies are raised to match."""
    if measured <= 0:
        return calibration
    no_overhead = replace(calibration, decode_step_overhead_s=0.0)
    modelled = phase_seconds(shape, workload, placement, device=device, calibration=no_overhead)["generate"]
    steps = max(1, workload.decode_steps) * generate_requests(workload, placement)[0]
    if modelled <= measured:
        return replace(calibration, decode_step_overhead_s=(measured - modelled) / steps)
    factor = modelled / measured
    return replace(no_overhead, compute_efficiency=calibration.compute_efficiency * factor,
                   memory_efficiency=calibration.memory_efficiency * factor)


def calibrate_from_records(shape: ModelShape, *, config: Any, records: Iterable[Mapping[str, Any]],
                           device: DeviceSpec, warmup: int = DEFAULT_WARMUP_STEPS,
                           source: Mapping[str, Any] | None = None) -> tuple[Calibration, Workload, Placement]:
    """From a run's telemetry records (a JSONL file's lines or the control plane's stored events and metrics):
    the calibration, and the workload with the lengths the run really had."""
    timelines, metrics = [], {}
    for record in records:
        if record.get("kind") == "event" and record.get("name") == "step_timeline":
            timelines.append(record)
        elif record.get("kind") == "metric" and isinstance(record.get("step"), int):
            metrics.setdefault(record["step"], {})[record.get("key")] = record.get("value")
    workload = measured_workload(config, metrics=metrics, warmup=warmup)
    placement = Placement.from_config(config)
    step = median_step(measured_steps(timelines), warmup=warmup)
    meta = {"steps": step.step, "placement": placement.describe(), "mode": workload.overlapped, **(source or {})}
    return calibrate(shape, workload, placement, device=device, measured=step, source=meta), workload, placement


def measured_workload(config: Any, *, metrics: Mapping[int, Mapping[str, Any]],
                      warmup: int = DEFAULT_WARMUP_STEPS) -> Workload:
    """The config's workload with the run's mean lengths: responses from `response_length/mean`, and the trained
    sequence's length from `data/train_tokens` (padding counted: the trainer computes on it)."""
    workload = Workload.from_config(config)
    kept = [values for step, values in sorted(metrics.items()) if step > warmup] or list(metrics.values())
    responses = [float(v["response_length/mean"]) for v in kept if "response_length/mean" in v]
    trained = [float(v["data/train_tokens"]) for v in kept if "data/train_tokens" in v]
    if not responses:
        return workload
    response = statistics.median(responses)
    seq_len = statistics.median(trained) / workload.sequences if trained else workload.seq_len
    return replace(workload, response_tokens=response, prompt_tokens=max(1.0, seq_len - response))
