"""Request bodies of the node agent API, validated strictly: unknown fields and wrong types are refused."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from forgeboard.api.schemas import Storable

HealthName = Literal["healthy", "degraded", "unhealthy", "unknown"]
Hostname = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Percent = Annotated[float, Field(ge=0, le=100)]
# Bounds keep every integer inside the database column it lands in.
Bytes = Annotated[int, Field(ge=0, le=2**60)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=100), Storable]
LabelValue = Annotated[str, StringConstraints(max_length=200), Storable]

MAX_DEVICES = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DeviceIn(_Strict):
    kind: Literal["gpu", "cpu"]
    index: int = Field(ge=0, le=4095)
    model: Annotated[str, Field(min_length=1, max_length=200), Storable]
    memory_bytes: Bytes = 0
    uuid: Annotated[str, Field(max_length=100), Storable] = ""
    health: HealthName = "healthy"
    utilization: Percent | None = None
    memory_used_bytes: Bytes | None = None


class RegisterIn(_Strict):
    hostname: Hostname
    pool: str = Field(default="default", min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)
    cpu_count: int = Field(ge=0, le=65_535)
    memory_bytes: Bytes
    cpu_utilization: Percent | None = None
    memory_utilization: Percent | None = None
    agent_version: Annotated[str, Field(max_length=50), Storable] = ""
    devices: list[DeviceIn] = Field(default_factory=list, max_length=MAX_DEVICES)


class DeviceSampleIn(_Strict):
    kind: Literal["gpu", "cpu"]
    index: int = Field(ge=0, le=4095)
    health: HealthName = "healthy"
    utilization: Percent | None = None
    memory_used_bytes: Bytes | None = None


class HeartbeatIn(_Strict):
    hostname: Hostname
    cpu_utilization: Percent | None
    memory_utilization: Percent | None
    devices: list[DeviceSampleIn] = Field(default_factory=list, max_length=MAX_DEVICES)
