"""Operator commands that act on a running Monarch GRPO run: typed payloads, one parser.

The control plane validates a command with `parse_operation` before storing it, the dashboard
builds its forms from `operation_json_schemas()`, the run config carries scheduled drills as
`drills: [FaultDrillRequest, ...]`, and the engine executes the parsed objects. Unknown keys
are errors; every problem is reported as a (field, reason) pair. Imports pydantic only.

fault_drill (FaultDrillRequest)
    kind           "kill" | "hang" | "raise" | "latency" | "bandwidth" | "slow_host" | "nan_gradients"
                   nan_gradients: the target rank's gradients of the trainer's next update are NaN, so every rank
                   skips that update (the gradient norm is global)
    role           "generator" | "trainer" | "reference" | "reward"; nan_gradients: the trainer only
    replica        int >= 0, default 0 (a trainer rank when role is trainer)
    duration_s     float > 0; hang, latency, bandwidth, slow_host: how long the effect lasts (default 5), refused
                   otherwise (null there)
    latency_ms     float > 0; required by latency, refused otherwise: added before each call to the role
    bandwidth_mbps float > 0; required by bandwidth, refused otherwise: each call waits bytes / bandwidth
    duty_cycle     0 < float < 1; required by slow_host, refused otherwise: fraction of time the processes of the
                   target's host are stopped
    schedule       null (now) | {"at_step": int >= 1} | {"every_s": float > 0}
                   | {"random_seed": int >= 0, "rate_per_min": float > 0}

placement_change (PlacementChangeRequest)
    action   "move" | "add" | "remove"
    role     "generator"
    replica  int >= 0; required by move and remove, refused by add
    host     host name; required by move and add (the target), refused by remove

load_redirect (LoadRedirectRequest)
    action   "drain" (stop routing to the host's replicas, start replacements elsewhere) | "undrain"
    host     host name

A host is one of `placement.generator.hosts`: with Monarch workers (a cluster job's,
FORGEBOARD_MONARCH_WORKERS, `placement.local_hosts`) a worker's name, else a label on this machine's procs; when none are
named, every worker, or "local".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from workers.engine.fields import ConfigError, FieldError, FieldProblems, StrictModel, field_errors

DrillKind = Literal["kill", "hang", "raise", "latency", "bandwidth", "slow_host", "nan_gradients"]
DrillRole = Literal["generator", "trainer", "reference", "reward"]
HostName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
ReplicaIndex = Annotated[int, Field(ge=0, le=4096)]
PositiveSeconds = Annotated[float, Field(gt=0.0, le=86_400.0)]

DURATION_KINDS = ("hang", "latency", "bandwidth", "slow_host")  # faults that wear off after duration_s
DEFAULT_DURATION_S = 5.0
FAILING_KINDS = ("kill", "hang", "raise")  # faults that make calls fail (hang: once past the call timeout)
UPDATE_KINDS = ("nan_gradients",)  # faults in the trainer's next update: it is skipped, no call fails


class OperationError(ConfigError):
    """A command payload that cannot be executed; `errors` lists (field, reason) pairs."""


class DrillSchedule(StrictModel):
    """Exactly one form: at_step, every_s, or random_seed with rate_per_min."""

    at_step: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = Field(default=None, description="inject before this step trains")
    every_s: PositiveSeconds | None = Field(default=None, description="inject every this many seconds")
    random_seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = Field(default=None, description="seed of a Poisson schedule")
    rate_per_min: Annotated[float, Field(gt=0.0, le=600.0)] | None = Field(default=None, description="random: mean faults per minute")

    @model_validator(mode="after")
    def _one_form(self) -> DrillSchedule:
        forms = [self.at_step is not None, self.every_s is not None,
                 self.random_seed is not None or self.rate_per_min is not None]
        if sum(forms) != 1:
            raise ValueError("give exactly one of at_step, every_s, or random_seed with rate_per_min")
        if forms[2] and (self.random_seed is None or self.rate_per_min is None):
            raise ValueError("a random schedule needs both random_seed and rate_per_min")
        return self


class FaultDrillRequest(StrictModel):
    kind: DrillKind
    role: DrillRole
    replica: ReplicaIndex = Field(default=0, description="replica index (trainer: rank)")
    duration_s: PositiveSeconds | None = Field(
        default=None, description=f"hang, latency, bandwidth, slow_host: how long it lasts (default {DEFAULT_DURATION_S:g}); "
                                  "other kinds: none")
    latency_ms: Annotated[float, Field(gt=0.0, le=600_000.0)] | None = Field(default=None, description="latency: added per call")
    bandwidth_mbps: Annotated[float, Field(gt=0.0, le=1e6)] | None = Field(default=None, description="bandwidth: megabits/s")
    duty_cycle: Annotated[float, Field(gt=0.0, lt=1.0)] | None = Field(default=None, description="slow_host: fraction of time stopped")
    schedule: DrillSchedule | None = Field(default=None, description="null: now (a config drill: at the first step)")

    @model_validator(mode="before")
    @classmethod
    def _default_duration(cls, data: Any) -> Any:
        """Only a fault that wears off has a duration: its default is filled in, so a dump of the drill validates again."""
        if isinstance(data, dict) and data.get("kind") in DURATION_KINDS and data.get("duration_s") is None:
            return {**data, "duration_s": DEFAULT_DURATION_S}
        return data

    @model_validator(mode="after")
    def _parameters_fit_the_kind(self) -> FaultDrillRequest:
        needs = {"latency": "latency_ms", "bandwidth": "bandwidth_mbps", "slow_host": "duty_cycle"}
        problems = []
        for kind, name in needs.items():
            given = getattr(self, name) is not None
            if self.kind == kind and not given:
                problems.append((name, f"required for kind {kind!r}"))
            elif self.kind != kind and given:
                problems.append((name, f"applies only to kind {kind!r}"))
        if self.duration_s is not None and self.kind not in DURATION_KINDS:
            problems.append(("duration_s", f"does not apply to kind {self.kind!r}"))
        if self.kind in UPDATE_KINDS and self.role != "trainer":
            problems.append(("role", f"kind {self.kind!r} applies only to the trainer (a rank's gradients), "
                                     f"not the {self.role}"))
        if problems:
            raise FieldProblems(problems)
        return self


PlacedRole = Literal["generator", "reward", "reference"]  # the roles whose replicas a placement change adds, moves, removes


class PlacementChangeRequest(StrictModel):
    action: Literal["move", "add", "remove"]
    role: PlacedRole = "generator"
    replica: ReplicaIndex | None = Field(default=None, description="move, remove: which replica")
    host: HostName | None = Field(default=None, description="move, add: the target host")

    @model_validator(mode="after")
    def _fields_fit_the_action(self) -> PlacementChangeRequest:
        problems = []
        if self.action in ("move", "remove") and self.replica is None:
            problems.append(("replica", f"required for action {self.action!r}"))
        if self.action == "add" and self.replica is not None:
            problems.append(("replica", "does not apply to action 'add' (the new replica gets the next index)"))
        if self.action in ("move", "add") and self.host is None:
            problems.append(("host", f"required for action {self.action!r}"))
        if self.action == "remove" and self.host is not None:
            problems.append(("host", "does not apply to action 'remove'"))
        if problems:
            raise FieldProblems(problems)
        return self


class LoadRedirectRequest(StrictModel):
    action: Literal["drain", "undrain"]
    host: HostName


Operation = FaultDrillRequest | PlacementChangeRequest | LoadRedirectRequest
OPERATIONS: dict[str, type[FaultDrillRequest] | type[PlacementChangeRequest] | type[LoadRedirectRequest]] = {
    "fault_drill": FaultDrillRequest,
    "placement_change": PlacementChangeRequest,
    "load_redirect": LoadRedirectRequest,
}


def parse_operation(kind: str, payload: dict[str, Any]) -> Operation:
    """The typed command, or OperationError listing (field, reason) pairs."""
    schema = OPERATIONS.get(kind)
    if schema is None:
        raise OperationError([FieldError("kind", f"unknown operation {kind!r}; expected one of {', '.join(OPERATIONS)}")])
    if not isinstance(payload, dict):
        raise OperationError([FieldError("", f"the payload of {kind} must be an object")])
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        raise OperationError(field_errors(exc)) from None


def operation_json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of each command's payload, by command kind (the dashboard's forms)."""
    return {kind: schema.model_json_schema() for kind, schema in OPERATIONS.items()}
