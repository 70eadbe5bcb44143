"""trainer.mixed_precision on a model that is not FSDP-sharded: float32 weights, gradients and optimizer state,
every forward computed in bfloat16 (torch.autocast around the model's forward, as Hugging Face Accelerate and
Lightning do). A sharded model gets the same from FSDP's MixedPrecisionPolicy instead (`sharding.shard_model`).

The generator and the reference hold bfloat16 copies of the weights (`RunConfig.rollout_dtype`): the weights the
trainer's autocast computes with, so the generator's log-probs and the trainer's differ only by where each rounds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # model.dtype and RunConfig.rollout_dtype
COMPUTE_DTYPES = {"bf16": torch.bfloat16}  # trainer.mixed_precision


class AutocastForward:
    """A model's forward run under torch.autocast on the device of its parameters. Autocast casts each weight to the
    compute dtype once per forward, and backward follows the forward's dtypes."""

    def __init__(self, forward: Any, *, dtype: torch.dtype) -> None:
        self.forward = forward
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = next(self.forward.__self__.parameters()).device.type
        with torch.autocast(device_type=device_type, dtype=self.dtype):
            return self.forward(*args, **kwargs)


def apply_mixed_precision(model: nn.Module, *, mixed_precision: str) -> nn.Module:
    """Compute `model`'s forwards in the mixed precision named by trainer.mixed_precision ("off": unchanged)."""
    if mixed_precision != "off" and not isinstance(model.forward, AutocastForward):
        model.forward = AutocastForward(model.forward, dtype=COMPUTE_DTYPES[mixed_precision])
    return model


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype `apply_mixed_precision` computes `model` in, None when it does not."""
    forward = model.forward
    return forward.dtype if isinstance(forward, AutocastForward) else None
