"""Request and response shapes of /api/v1 (the OpenAPI document is generated from them)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from ninja import Schema

from forgeboard.telemetry.ingest import wire_number
from workers.engine.telemetry_wire import WholeNumber
from pydantic import Field

Name = Annotated[str, Field(min_length=1, max_length=200)]
Priority = Annotated[int, Field(ge=-100, le=100), WholeNumber]


class ProjectOut(Schema):
    slug: str
    name: str
    description: str
    created_at: datetime


class ExperimentIn(Schema):
    name: Name
    recipe: Annotated[str, Field(max_length=16)]
    description: Annotated[str, Field(max_length=10_000)] = ""
    tags: Annotated[list[Annotated[str, Field(max_length=50)]], Field(max_length=20)] = []


class ExperimentOut(Schema):
    id: int
    name: str
    recipe: str
    description: str
    tags: list[str]
    created_at: datetime


class RunIn(Schema):
    config_yaml: Annotated[str, Field(max_length=64 * 1024)]
    overrides: Annotated[list[Annotated[str, Field(max_length=1000)]], Field(max_length=100)] = []
    priority: Priority = 0


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
    kind: Annotated[str, Field(max_length=32)]
    payload: dict[str, Any] = {}


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
    state: str
    health: str
    cpu_count: int
    memory_bytes: int
    last_heartbeat_at: datetime | None
    devices: list[DeviceOut]


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


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 429: ErrorOut}
