"""What a run's controller sends to the control plane: numbered batches of metrics, events and log lines.

Shared by the engine's HTTP client and the control plane's ingestion endpoint, so both validate
against the same bounds. Batches are applied exactly once, in order: batch N+1 only after N.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_METRICS_PER_BATCH = 20_000
MAX_EVENTS_PER_BATCH = 1_000
MAX_LOGS_PER_BATCH = 2_000
MAX_BATCHES_PER_REQUEST = 64
MAX_LOG_LINE_CHARS = 8_192
MAX_REQUEST_BYTES = 8 * 1024 * 1024

EventKindName = Literal[
    "placement_applied", "placement_changed", "fault_injected", "failure_detected", "replica_replaced",
    "recovered", "redirect_started", "redirect_finished", "checkpoint_saved", "command_finished",
    "restarted", "eval", "rollout", "message",
]


def _no_text_or_bool(value: Any) -> Any:
    """JSON numbers only: a boolean or a numeric string is refused; 3.0 is the integer 3."""
    if isinstance(value, (bool, str)):
        raise ValueError("must be a JSON number, not a boolean or text")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


# Field bounds go before the validator, or they drop out of the OpenAPI document.
WholeNumber = BeforeValidator(_no_text_or_bool)
Step = Annotated[int, Field(ge=0, le=2**63 - 1), WholeNumber]
WallTime = Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False), WholeNumber]
Number = Annotated[float, WholeNumber]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WireMetric(_Wire):
    key: Annotated[str, Field(min_length=1, max_length=200)]
    step: Step
    value: Number
    time: WallTime


class WireEvent(_Wire):
    kind: EventKindName
    payload: dict[str, Any] = Field(default_factory=dict)
    time: WallTime


class WireLog(_Wire):
    line: Annotated[str, Field(max_length=MAX_LOG_LINE_CHARS)]
    time: WallTime


class TelemetryBatch(_Wire):
    seq: Annotated[int, Field(ge=1, le=2**63 - 1), WholeNumber]
    metrics: Annotated[list[WireMetric], Field(max_length=MAX_METRICS_PER_BATCH)] = Field(default_factory=list)
    events: Annotated[list[WireEvent], Field(max_length=MAX_EVENTS_PER_BATCH)] = Field(default_factory=list)
    logs: Annotated[list[WireLog], Field(max_length=MAX_LOGS_PER_BATCH)] = Field(default_factory=list)


class TelemetryRequest(_Wire):
    batches: Annotated[list[TelemetryBatch], Field(max_length=MAX_BATCHES_PER_REQUEST)] = Field(default_factory=list)


class TelemetryResponse(_Wire):
    applied_seq: int
    duplicates: int = 0
    pending_commands: list[int] = Field(default_factory=list)
