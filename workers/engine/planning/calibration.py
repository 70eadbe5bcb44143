"""The model's coefficients: how much of a device's peaks a run achieves. The defaults are for a device kind never
measured (typical of well-tuned bf16 training and vLLM decoding on the data-sheet GPUs); `fitting.calibrate` replaces
them with what a recorded run achieved. This is the one place their defaults are written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Calibration:
    device: str = ""  # the device kind the coefficients were measured on ("" : the defaults)
    train_efficiency: float = 0.40  # model FLOPs utilisation of forward and backward
    compute_efficiency: float = 0.50  # of peak FLOP/s in generation's prefill and decode
    memory_efficiency: float = 0.70  # of HBM bandwidth when decoding
    decode_step_overhead_s: float = 2e-3  # a decode step's fixed cost (scheduling, sampling, kernel launches)
    optimizer_efficiency: float = 0.50  # of memory bandwidth in the optimizer step
    link_efficiency: float = 0.70  # of link bandwidth in the trainer's collectives
    sync_efficiency: float = 0.50  # of link bandwidth when the trainer sends weights to a generator
    reward_s_per_sequence: float = 1e-4
    step_overhead_s: float = 0.05  # the controller's own seconds per step (routing, scoring calls, bookkeeping)
    source: dict[str, Any] = field(default_factory=dict)  # what it was fitted from: run, placement, steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibration":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown calibration fields: {', '.join(unknown)}")
        for name, value in data.items():
            if name not in ("device", "source") and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name}: must be a number >= 0")
        return cls(**data)
