"""Request and response shapes of /api/v1 (the OpenAPI document is generated from them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import AfterValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from forgeboard.cluster.services import MAX_INTENT_REASON_LENGTH
from forgeboard.telemetry.ingest import wire_number
from workers.engine.telemetry_wire import StepTimeline, WholeNumber
from workers.engine.wire_limits import MAX_REQUEST_BYTES, unstorable_in, unstorable_reason


def _storable_json(value: Any) -> Any:
    reason = unstorable_in(value)
    if reason:
        raise ValueError(reason)
    return value


StorableJson = AfterValidator(_storable_json)
JsonObject = Annotated[dict[str, Any], StorableJson]

# The patterns the document states for text: no NUL (PostgreSQL cannot store it); NOT_BLANK: also a character
# that str.strip() keeps (\s, plus the separators \x1c-\x1f that Python strips too); OVERRIDE: section.key=value
# with a key that is not blank before the first "=".
STORABLE = r"^[^\x00]*$"
NOT_BLANK = r"^[^\x00]*[^\s\x00\x1c-\x1f][^\x00]*$"
OVERRIDE = r"^[^=\x00]*[^=\s\x00\x1c-\x1f][^=\x00]*=[^\x00]*$"
PATTERN_MESSAGES = {NOT_BLANK: "must not be blank", OVERRIDE: "must look like section.key=value"}


@dataclass(frozen=True)
class _StorableText:
    """Refuses what the database cannot store (NUL, lone surrogates) and what `pattern` does not match, with a
    message that says which; the document states the pattern. Runs after the str checks, so Field's bounds
    stay in the document."""

    pattern: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:  # noqa: ANN401
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        return handler(schema) | {"pattern": self.pattern}

    def _check(self, value: str) -> str:
        reason = unstorable_reason(value)
        if reason:
            raise ValueError(reason)
        if self.pattern != STORABLE and not re.search(self.pattern, value):
            raise ValueError(PATTERN_MESSAGES.get(self.pattern, f"must match {self.pattern}"))
        return value


Storable = _StorableText(STORABLE)


def text(*, max_length: int, min_length: int = 0, pattern: str = STORABLE) -> Any:  # noqa: ANN401
    """A text field the database can store (no NUL, no lone surrogate), its bounds and pattern in the schema."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), _StorableText(pattern)]


Name = text(min_length=1, max_length=200, pattern=NOT_BLANK)
Override = text(max_length=1000, pattern=OVERRIDE)
Priority = Annotated[int, Field(ge=-100, le=100), WholeNumber]
RecipeName = Literal["grpo", "sft"]
# Every kind an operator may send here (a cancel goes through POST /runs/{id}/cancel).
CommandKindName = Literal["pause", "resume", "checkpoint", "placement_change", "fault_drill", "load_redirect"]


class ProjectOut(Schema):
    slug: str
    name: str
    description: str
    created_at: datetime


class ExperimentIn(Schema):
    name: Name
    recipe: RecipeName
    description: text(max_length=10_000) = ""
    tags: Annotated[list[text(max_length=50)], Field(max_length=20)] = []


class ExperimentOut(Schema):
    id: int
    name: str
    recipe: str
    description: str
    tags: list[str]
    created_at: datetime


class RunIn(Schema):
    config_yaml: text(max_length=64 * 1024)
    overrides: Annotated[list[Override], Field(max_length=100)] = []
    priority: Priority = 0


class CheckpointRunIn(Schema):
    experiment_id: int | None = Field(default=None, ge=1, le=2**63 - 1,
                                      description="the child's experiment, any recipe, in the parent's project "
                                                  "(default: the parent's)")
    config_yaml: text(max_length=64 * 1024) | None = Field(
        default=None, description="the child's config (default: the parent's, with the parent's overrides)")
    overrides: Annotated[list[Override], Field(max_length=100)] = []
    priority: Priority | None = Field(default=None, description="default: the parent's")


class RunOut(Schema):
    id: int
    experiment_id: int
    number: int
    state: str
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    restart_count: int
    max_restarts: int
    exit_reason: str
    host: str
    launched_by: str | None = None

    @staticmethod
    def resolve_launched_by(run) -> str | None:  # noqa: ANN001
        return run.launched_by.username if run.launched_by_id else None


class RunDetailOut(RunOut):
    config_yaml: str
    config: dict[str, Any]
    placement_plan: dict[str, Any]

    @staticmethod
    def resolve_config_yaml(run) -> str:  # noqa: ANN001
        return run.config.yaml_text

    @staticmethod
    def resolve_config(run) -> dict:  # noqa: ANN001
        return run.config.parsed


class CommandIn(Schema):
    kind: CommandKindName
    payload: JsonObject = Field({}, description="the command's options (fault_drill, placement_change and "
                                "load_redirect: see the engine's operations; at most 64 KiB as JSON)")


class CommandOut(Schema):
    id: int
    kind: str
    payload: dict[str, Any]
    state: str
    created_at: datetime
    acknowledged_at: datetime | None
    result: dict[str, Any]


class SeriesOut(Schema):
    key: str
    point_count: int
    first_step: int | None
    last_step: int | None
    last_value: float | None
    min_value: float | None
    max_value: float | None

    @staticmethod
    def resolve_last_value(series) -> float | None:  # noqa: ANN001
        return wire_number(series.last_value)


class PointsOut(Schema):
    key: str
    downsampled: bool
    steps: list[int]
    values: list[float | None]
    low: list[float | None] | None = None
    high: list[float | None] | None = None
    wall_times: list[float | None] | None = Field(
        None, description="Unix seconds (the engine's clock) of each point; downsampled: the latest in its slice"
    )


class TimelinesOut(Schema):
    run: int
    timelines: list[StepTimeline]


class EventOut(Schema):
    seq: int
    kind: str
    payload: dict[str, Any]
    occurred_at: datetime


class DeviceOut(Schema):
    kind: str
    index: int
    model: str
    memory_bytes: int
    health: str
    utilization: float | None


class HostOut(Schema):
    hostname: str
    pool: str
    state: str = Field(description="up, draining, cordoned or down, from the two fields below: down when `liveness` "
                                   "is down, else `intent` (up when schedulable)")
    liveness: str = Field(description="up or down: from the host's heartbeats (down once they stop)")
    intent: str = Field(description="schedulable, draining or cordoned: what an operator wants of the host; only a "
                                    "schedulable host that is up and healthy is given new work")
    health: str
    cpu_count: int
    memory_bytes: int
    last_heartbeat_at: datetime | None
    devices: list[DeviceOut]


HostIntentName = Literal["schedulable", "draining", "cordoned"]


class HostIntentIn(Schema):
    intent: HostIntentName = Field(description="schedulable: the host may be given new work; draining or cordoned: it "
                                               "is given none")
    reason: text(max_length=MAX_INTENT_REASON_LENGTH) = Field("", description="why, kept in the audit log")


class FieldErrorOut(Schema):
    field: str
    message: str


class ErrorOut(Schema):
    code: str
    message: str
    errors: list[FieldErrorOut]
    expected_seq: int | None = None


class CheckpointExportOut(Schema):
    run_id: int
    step: int
    state: str = Field(description="queued, running, done or failed")
    path: str | None = Field(description="the exported Hugging Face folder, once done")
    error: str = Field(description="why it failed, when it did")
    updated_at: datetime | None
    requeues: int = Field(description="how often it was lost (its worker stopped, or its task was lost) and queued "
                                      "again since it was asked for: 0 for a fresh request")
    max_requeues: int = Field(description="how often a lost export is queued again (FORGEBOARD_EXPORT_REQUEUES); lost "
                                          "once more, it fails")
    summary: str = Field(description="how it stands, in words, as the run page's checkpoints table says it: queued, "
                                     "queued again after it was lost (requeue 1 of 2), running, exported, failed: why")


# 503 `database_busy` (with Retry-After) when the database stayed locked past its timeout: nothing was changed.
ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 429: ErrorOut, 503: ErrorOut}
# Operations with a request body also answer 413 `payload_too_large` for a body over MAX_REQUEST_BYTES.
BODY_ERRORS = {**ERRORS, 413: ErrorOut}
# Operations that honour an Idempotency-Key (api/idempotent.py) answer 422 for a key reused with another request.
IDEMPOTENT_ERRORS = {422: ErrorOut}
BODY_LIMIT_NOTE = f"The body is at most {MAX_REQUEST_BYTES} bytes (413 `payload_too_large` above it)."
