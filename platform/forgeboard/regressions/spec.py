"""A regression suite, as a typed schema validated in one place.

A suite is a list of stages (the same recipe at growing scale); each stage launches one run of an
experiment with config overrides, and checks metrics of that run against a baseline: a pinned run,
or the suite's recent history (median, tolerance max(5 %, 3 sigma)), one-sided by the metric's
direction, so an improvement never fails. A check either gates (fails the suite) or warns.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeboard.api.schemas import Override, text

Name = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PinnedBaseline(_Spec):
    kind: Literal["pinned"] = "pinned"
    run_id: Annotated[int, Field(ge=1, le=2**63 - 1)]
    tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05


class HistoryBaseline(_Spec):
    kind: Literal["history"] = "history"
    window: Annotated[int, Field(ge=1, le=100)] = 5
    min_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05
    sigmas: Annotated[float, Field(ge=0.0, le=10.0)] = 3.0


class CheckSpec(_Spec):
    name: Name
    metric: text(min_length=1, max_length=200)
    at: Literal["last", "min", "max", "mean"] | Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        "last", description="the value at a step, or last/min/max/mean over the run")
    direction: Literal["higher_is_better", "lower_is_better"]
    gate: bool = True
    baseline: PinnedBaseline | HistoryBaseline = Field(default_factory=HistoryBaseline, discriminator="kind")


class StageSpec(_Spec):
    name: Name
    experiment_id: Annotated[int, Field(ge=1, le=2**63 - 1)]
    config_yaml: text(max_length=64 * 1024)
    overrides: Annotated[list[Override], Field(max_length=100)] = []
    checks: Annotated[list[CheckSpec], Field(min_length=1, max_length=50)]

    @model_validator(mode="after")
    def _unique_checks(self) -> StageSpec:
        names = [c.name for c in self.checks]
        if len(names) != len(set(names)):
            raise ValueError("check names must be unique within a stage")
        return self


class SuiteSpec(_Spec):
    stages: Annotated[list[StageSpec], Field(min_length=1, max_length=20)]

    @model_validator(mode="after")
    def _unique_stages(self) -> SuiteSpec:
        names = [s.name for s in self.stages]
        if len(names) != len(set(names)):
            raise ValueError("stage names must be unique")
        return self
