"""What a run's controller sends to the control plane: numbered batches of metrics, events and log lines.

Shared by the engine's HTTP client and the control plane's ingestion endpoint, so both validate
against the same bounds. Batches are applied exactly once, in order: batch N+1 only after N.

A request is checked item by item (`screen_request`): a malformed envelope (not a list of numbered
batches) refuses the whole request, while a bad metric, event or log line is named by its batch
seq, section and index, so the engine can drop just that item and send the rest again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from workers.engine.wire_limits import MAX_JSON_DEPTH, MAX_REQUEST_BYTES, unstorable_reason

MAX_METRICS_PER_BATCH = 20_000
MAX_EVENTS_PER_BATCH = 1_000
MAX_LOGS_PER_BATCH = 2_000
MAX_BATCHES_PER_REQUEST = 64
MAX_LOG_LINE_CHARS = 8_192
MAX_METRIC_KEYS_PER_RUN = 2_000  # distinct metric keys a run may have: each is a chart on its page and in its stream
MAX_REFUSED_PER_ANSWER = 10_000
MAX_DUPLICATES_LISTED = 1_000
MAX_TIMELINE_LANES = 64
MAX_TIMELINE_SPANS = 2_000
MAX_TIMELINE_PHASES = 64  # phases with a share
MAX_TIMELINE_NAME_CHARS = 64
MAX_SPAN_OFFSET_S = 86_400.0  # a span's start or end, in seconds from its step's start
STEP_TIMELINE = "step_timeline"  # the event kind whose payload is a StepTimeline
# How deep a request body may nest at all (the parser's stack is the limit): deeper than a payload may, so that a
# payload nested too deep is refused as one item, not as the whole request.
MAX_BODY_DEPTH = 2 * MAX_JSON_DEPTH
METRIC_KEY_PATTERN = r"^[^\x00-\x1f\x7f]+$"
__all__ = ["MAX_REQUEST_BYTES"]  # the one request-size limit, re-exported for the engine and the endpoint

EventKindName = Literal[
    "placement_applied", "placement_changed", "fault_injected", "failure_detected", "replica_replaced",
    "recovered", "redirect_started", "redirect_finished", "checkpoint_saved", "command_finished",
    "restarted", "eval", "rollout", "message", "step_timeline",
]
Section = Literal["metrics", "events", "logs"]


def _no_text_or_bool(value: Any) -> Any:
    """JSON numbers only: a boolean or a numeric string is refused; 3.0 is the integer 3."""
    if isinstance(value, (bool, str)):
        raise ValueError("must be a JSON number, not a boolean or text")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


def payload_problem(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why an event payload cannot be stored, else None (see `payload_problem_at`)."""
    found = payload_problem_at(value, max_depth=max_depth)
    return f"{found[0]}: {found[1]}" if found else None


def payload_problem_at(value: Any, *, max_depth: int = MAX_JSON_DEPTH, root: str = "payload") -> tuple[str, str] | None:
    """Where the first reason a JSON value cannot be stored is (a dotted path from `root`) and what it is, else None.

    Keys must be storable text; string values may hold NUL (a random model's completions do: it is
    replaced on storage) but not lone surrogates; numbers must be finite (jsonb has no NaN) and integers
    within a float's range (what reads them, a page or a browser, takes them as floats).
    """
    stack: list[tuple[Any, int, str]] = [(value, 0, root)]
    while stack:
        item, depth, where = stack.pop()
        if depth > max_depth:
            return where, f"nested deeper than {max_depth} levels"
        if isinstance(item, str):
            reason = unstorable_reason(item.replace("\x00", ""))
            if reason:
                return where, reason
        elif isinstance(item, float) and not math.isfinite(item):
            return where, "must be a finite number (JSON has no NaN or infinity)"
        elif isinstance(item, int) and not isinstance(item, bool) and not _fits_a_float(item):
            return where, "must be a number within a float's range"
        elif isinstance(item, dict):
            for key, child in item.items():
                reason = unstorable_reason(key) if isinstance(key, str) else "keys must be text"
                if reason:
                    return where, f"key {key!r} {reason}"
                stack.append((child, depth + 1, f"{where}.{key}"))
        elif isinstance(item, list | tuple):
            stack.extend((child, depth + 1, f"{where}.{i}") for i, child in enumerate(item))
    return None


def _fits_a_float(number: int) -> bool:
    try:
        float(number)
    except OverflowError:
        return False
    return True


def _storable_payload(payload: dict[str, Any]) -> dict[str, Any]:
    reason = payload_problem(payload)
    if reason:
        raise ValueError(reason)
    return payload


def _storable_line(line: str) -> str:
    reason = unstorable_reason(line.replace("\x00", ""))
    if reason:
        raise ValueError(reason)
    return line


# Field bounds go before the validator, or they drop out of the OpenAPI document.
WholeNumber = BeforeValidator(_no_text_or_bool)
Step = Annotated[int, Field(ge=0, le=2**63 - 1), WholeNumber]
WallTime = Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False), WholeNumber]
Number = Annotated[float, WholeNumber]
MetricKey = Annotated[str, Field(min_length=1, max_length=200, pattern=METRIC_KEY_PATTERN),
                      AfterValidator(lambda key: _storable_line(key))]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WireMetric(_Wire):
    key: MetricKey
    step: Step
    value: Number
    time: WallTime


TimelineName = Annotated[str, Field(min_length=1, max_length=MAX_TIMELINE_NAME_CHARS, pattern=METRIC_KEY_PATTERN),
                         AfterValidator(lambda name: _storable_line(name))]
SpanOffset = Annotated[float, Field(ge=-MAX_SPAN_OFFSET_S, le=MAX_SPAN_OFFSET_S, allow_inf_nan=False), WholeNumber]
Share = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False), WholeNumber]
LaneIndex = Annotated[int, Field(ge=0, lt=MAX_TIMELINE_LANES), WholeNumber]


class StepTimeline(_Wire):
    """Where one training step's time went (`workers/engine/timeline.py`): spans of work on each proc ("lane"),
    as [lane index, phase, start, end] in seconds from the step's start (a span launched in the step before starts
    below 0), and each phase's share of the step and each lane's idle share."""

    step: Step
    start: WallTime
    seconds: Annotated[float, Field(ge=0.0, le=MAX_SPAN_OFFSET_S, allow_inf_nan=False), WholeNumber]
    lanes: Annotated[list[TimelineName], Field(max_length=MAX_TIMELINE_LANES)]
    spans: Annotated[list[tuple[LaneIndex, TimelineName, SpanOffset, SpanOffset]], Field(max_length=MAX_TIMELINE_SPANS)]
    shares: Annotated[dict[TimelineName, Share], Field(max_length=MAX_TIMELINE_PHASES)] = Field(default_factory=dict)
    idle: Annotated[dict[TimelineName, Share], Field(max_length=MAX_TIMELINE_LANES)] = Field(default_factory=dict)
    truncated: Annotated[int, Field(ge=0, le=2**31), WholeNumber] = Field(
        0, description="spans left out to keep under the span limit (the shortest)")

    @model_validator(mode="after")
    def _consistent(self) -> StepTimeline:
        if len(set(self.lanes)) != len(self.lanes):
            raise ValueError("lanes: each lane is named once")
        for i, (lane, _, start, end) in enumerate(self.spans):
            if lane >= len(self.lanes):
                raise ValueError(f"spans.{i}: lane {lane} is not one of the {len(self.lanes)} lanes")
            if end < start:
                raise ValueError(f"spans.{i}: ends before it starts")
        return self


class WireEvent(_Wire):
    kind: EventKindName
    payload: Annotated[dict[str, Any], AfterValidator(_storable_payload)] = Field(
        default_factory=dict, description=f"JSON nested at most {MAX_JSON_DEPTH} levels; keys without NUL; "
                                          "a step_timeline's payload is a StepTimeline")
    time: WallTime

    @field_validator("payload")
    @classmethod
    def _timeline_payload(cls, payload: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("kind") == STEP_TIMELINE:
            return StepTimeline.model_validate(payload).model_dump(mode="json")
        return payload


class WireLog(_Wire):
    line: Annotated[str, Field(max_length=MAX_LOG_LINE_CHARS), AfterValidator(_storable_line)]
    time: WallTime


class TelemetryBatch(_Wire):
    seq: Annotated[int, Field(ge=1, le=2**63 - 1), WholeNumber]
    metrics: Annotated[list[WireMetric], Field(max_length=MAX_METRICS_PER_BATCH)] = Field(default_factory=list)
    events: Annotated[list[WireEvent], Field(max_length=MAX_EVENTS_PER_BATCH)] = Field(default_factory=list)
    logs: Annotated[list[WireLog], Field(max_length=MAX_LOGS_PER_BATCH)] = Field(default_factory=list)


class TelemetryRequest(_Wire):
    batches: Annotated[list[TelemetryBatch], Field(max_length=MAX_BATCHES_PER_REQUEST)] = Field(default_factory=list)


class DroppedDuplicate(_Wire):
    """A metric point not stored because the same batch holds a later value for its key and step."""

    seq: int
    key: str
    step: int
    index: int


class TelemetryResponse(_Wire):
    applied_seq: int
    duplicates: int = Field(0, description="batches already applied before, skipped")
    duplicates_dropped: list[DroppedDuplicate] = Field(
        default_factory=list, description=f"the first {MAX_DUPLICATES_LISTED} points dropped for a later value "
                                          "of the same key and step in the same batch (the later value is kept)")
    duplicates_dropped_total: int = 0
    pending_commands: list[int] = Field(default_factory=list)


class RefusedItem(_Wire):
    seq: int
    section: Section
    index: int
    field: str
    reason: str


class FieldError(_Wire):
    field: str
    message: str


class TelemetryRefusal(_Wire):
    """The 422 answer: nothing of the request was stored; send it again without the refused items."""

    code: Literal["items_refused"]
    message: str
    errors: list[FieldError]
    applied_seq: int
    refused: list[RefusedItem]


# --- screening ------------------------------------------------------------------------------------
class _BatchEnvelope(_Wire):
    seq: Annotated[int, Field(ge=1, le=2**63 - 1), WholeNumber]
    metrics: Annotated[list[Any], Field(max_length=MAX_METRICS_PER_BATCH)] = Field(default_factory=list)
    events: Annotated[list[Any], Field(max_length=MAX_EVENTS_PER_BATCH)] = Field(default_factory=list)
    logs: Annotated[list[Any], Field(max_length=MAX_LOGS_PER_BATCH)] = Field(default_factory=list)


class _RequestEnvelope(_Wire):
    batches: Annotated[list[_BatchEnvelope], Field(max_length=MAX_BATCHES_PER_REQUEST)] = Field(default_factory=list)


SECTION_MODELS: dict[str, type[_Wire]] = {"metrics": WireMetric, "events": WireEvent, "logs": WireLog}


@dataclass(frozen=True)
class Screened:
    request: TelemetryRequest  # the good items only
    refused: list[RefusedItem]


def screen_request(data: Any) -> Screened:
    """Validate a decoded request item by item. Raises pydantic's ValidationError for a bad envelope."""
    try:
        return Screened(request=TelemetryRequest.model_validate(data), refused=[])
    except ValidationError:
        pass  # find out which items, below
    envelope = _RequestEnvelope.model_validate(data)
    batches: list[TelemetryBatch] = []
    refused: list[RefusedItem] = []
    for position, batch in enumerate(envelope.batches):
        kept: dict[str, list] = {}
        for section, model in SECTION_MODELS.items():
            kept[section] = []
            for index, item in enumerate(getattr(batch, section)):
                try:
                    kept[section].append(model.model_validate(item))
                except ValidationError as exc:
                    error = exc.errors()[0]
                    where = ".".join(str(p) for p in error["loc"])
                    refused.append(RefusedItem(
                        seq=batch.seq, section=section, index=index,
                        field=f"batches.{position}.{section}.{index}" + (f".{where}" if where else ""),
                        reason=error["msg"].removeprefix("Value error, ")[:300]))
        batches.append(TelemetryBatch.model_construct(seq=batch.seq, **kept))
    return Screened(request=TelemetryRequest.model_construct(batches=batches), refused=refused)


def inline_schema(model: type[BaseModel]) -> dict:
    """A model's JSON schema with its definitions inlined (for an OpenAPI request body)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(definitions[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
