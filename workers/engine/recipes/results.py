"""What the recipes' train functions return (the Monarch recipes the same as the single-process ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workers.engine.training import EvalResult


@dataclass
class GrpoResult:
    step: int
    losses: list[float]
    first_eval: EvalResult | None
    eval: EvalResult | None
    checkpoint: Path | None
    metrics: list[dict[str, float]]  # per step run by this call
    seconds: float = 0.0  # wall time of the training loop (evaluations and checkpoints included)
    trained_samples: dict[int, list[str]] = field(default_factory=dict)  # step -> sample ids it trained on (Monarch)


@dataclass
class SftResult:
    step: int
    losses: list[float]  # one per step run by this call
    eval: EvalResult | None
    checkpoint: Path | None
    first_eval: EvalResult | None = None
    seconds: float = 0.0  # wall time of the training loop (evaluations and checkpoints included)
